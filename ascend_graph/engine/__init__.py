"""The offline engine: scheduler, block manager, sampling, tokenizer."""

from .block_manager import BlockManager
from .engine import Engine, EngineStats
from .ranks import RankError
from .sampling import SamplingParams

__all__ = ["BlockManager", "Engine", "EngineStats", "RankError", "SamplingParams"]
