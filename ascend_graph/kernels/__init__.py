"""Native CPU kernels: sources (``csrc/``), their build and cache, and their ``torch.library`` ops."""

from . import ops  # noqa: F401  (registers the ascend_graph::* ops)
from .build import ONE_ROW_KERNEL, SOURCE, available, cache_dir, compiler, isa, one_row_kernel

__all__ = ["ONE_ROW_KERNEL", "SOURCE", "available", "cache_dir", "compiler", "isa", "one_row_kernel", "ops"]
