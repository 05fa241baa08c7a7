"""The benchmark suite of ascend_graph: ``python -m benchmarks [--quick]`` (see ``__main__``)."""
