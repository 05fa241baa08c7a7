"""Native CPU kernels: sources (``csrc/``), their build and cache (``build``), and their
``torch.library`` ops (``matmul``, ``attention``, ``moe``; what they share: ``ops``). Importing the package
registers the ``ascend_graph::*`` ops. Design and measurements: ``docs/cpu-kernels.md``."""

from . import attention, matmul, moe, ops  # noqa: F401  (registers the ascend_graph::* ops)
from .build import ONE_ROW_KERNEL, SOURCES, available, cache_dir, compiler, isa, one_row_kernel

__all__ = ["ONE_ROW_KERNEL", "SOURCES", "attention", "available", "cache_dir", "compiler", "isa", "matmul", "moe",
           "one_row_kernel", "ops"]
