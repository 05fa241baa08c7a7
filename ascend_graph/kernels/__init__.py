"""Native CPU kernels: sources (``csrc/``), their build and cache (``build``), and the
``ascend_graph::*`` ops (``ops``: schemas, contracts, fakes; their CPU kernels are C++,
``csrc/ops.cpp``; ``attention``: decode attention's contract and checks). Importing the package
defines the ops; loading the build registers their CPU kernels. Design and measurements:
``docs/cpu-kernels.md``."""

from . import attention, ops  # noqa: F401  (defines the ascend_graph::* ops)
from .build import ONE_ROW_KERNEL, SOURCES, available, cache_dir, compiler, cxx_compiler, isa, one_row_kernel

__all__ = ["ONE_ROW_KERNEL", "SOURCES", "attention", "available", "cache_dir", "compiler", "cxx_compiler", "isa",
           "one_row_kernel", "ops"]
