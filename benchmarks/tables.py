"""Kept only for ``vllm_peer_rows``'s import until it takes ``fmt`` and ``table`` from ``benchmarks.common``."""

from benchmarks.common import fmt, table  # noqa: F401
