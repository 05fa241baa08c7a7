"""Inductor graph passes of graph mode, one per file; each is a compiled-only rewrite."""
