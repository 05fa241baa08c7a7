"""ascend_graph: graph-mode decoding with tuple KV caches as static inputs, and an eager twin."""

from .kv_cache import (KVCache, KVCacheSpec, MLACache, MLACacheSpec, NULL_BLOCK, allocate_kv_caches,
                       blocks_for_budget, bytes_per_block, write_kv_cache)

__all__ = [
    "KVCache", "KVCacheSpec", "MLACache", "MLACacheSpec", "NULL_BLOCK", "allocate_kv_caches",
    "blocks_for_budget", "bytes_per_block", "write_kv_cache",
]
__version__ = "0.1.0"
