"""ascend_graph: graph-mode decoding with tuple KV caches as static inputs, and an eager twin."""

from .kv_cache import (KVCache, KVCacheSpec, MLACache, MLACacheSpec, NULL_BLOCK, allocate_kv_caches,
                       blocks_for_budget, bytes_per_block, write_kv_cache)

from .config import GraphConfig, InductorOptions, NpugraphExOptions, TorchairOptions
from .config_sources import from_env
from .attention import select_attention_backend
from .moe import select_moe_backend
from .compile import detect_platform, resolve_backend
from .engine import BlockManager, Engine, EngineStats, SamplingParams
from .runner import GraphRunner, ParityReport, RunnerStats, SequenceStep, compare_step

__all__ = [
    "GraphConfig", "InductorOptions", "NpugraphExOptions", "TorchairOptions", "from_env", "detect_platform",
    "resolve_backend",
    "select_attention_backend", "select_moe_backend", "BlockManager", "Engine", "EngineStats", "SamplingParams",
    "ParityReport", "compare_step", "GraphRunner", "RunnerStats", "SequenceStep",
    "KVCache", "KVCacheSpec", "MLACache", "MLACacheSpec", "NULL_BLOCK", "allocate_kv_caches",
    "blocks_for_budget", "bytes_per_block", "write_kv_cache",
]
__version__ = "0.1.0"
