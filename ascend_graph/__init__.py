"""ascend_graph: graph-mode decoding with tuple KV caches as static inputs, and an eager twin."""

from .kv_cache import (KVCache, KVCacheSpec, MLACache, MLACacheSpec, NULL_BLOCK, allocate_kv_caches,
                       blocks_for_budget, bytes_per_block, write_kv_cache)

from .config import GraphConfig, TorchairOptions
from .compile import detect_platform, resolve_backend
from .engine.block_manager import BlockManager
from .engine.engine import Engine, EngineStats
from .engine.sampling import SamplingParams
from .runner.parity import ParityReport, compare_step
from .runner.graph_runner import GraphRunner, RunnerStats, SequenceStep

__all__ = [
    "GraphConfig", "TorchairOptions", "detect_platform", "resolve_backend", "BlockManager",
    "Engine", "EngineStats", "SamplingParams",
    "ParityReport", "compare_step", "GraphRunner", "RunnerStats", "SequenceStep",
    "KVCache", "KVCacheSpec", "MLACache", "MLACacheSpec", "NULL_BLOCK", "allocate_kv_caches",
    "blocks_for_budget", "bytes_per_block", "write_kv_cache",
]
__version__ = "0.1.0"
