"""ascend_graph: graph-mode decoding with tuple KV caches as static inputs, and an eager twin."""

from .kv_cache import (KVCache, KVCacheSpec, MLACache, MLACacheSpec, NULL_BLOCK, allocate_kv_caches,
                       blocks_for_budget, bytes_per_block, write_kv_cache)

from .config import GraphConfig, TorchairOptions
from .backends import detect_platform, resolve_backend
from .block_manager import BlockManager
from .engine import Engine, EngineStats
from .sampling import SamplingParams
from .parity import ParityReport, compare_step
from .runner import GraphRunner, RunnerStats, SequenceStep

__all__ = [
    "GraphConfig", "TorchairOptions", "detect_platform", "resolve_backend", "BlockManager",
    "Engine", "EngineStats", "SamplingParams",
    "ParityReport", "compare_step", "GraphRunner", "RunnerStats", "SequenceStep",
    "KVCache", "KVCacheSpec", "MLACache", "MLACacheSpec", "NULL_BLOCK", "allocate_kv_caches",
    "blocks_for_budget", "bytes_per_block", "write_kv_cache",
]
__version__ = "0.1.0"
