"""An engine's cache geometry from its arguments and its model: block size, longest request,
number of cache blocks. Every rank of a multi-process engine resolves it alike from its share."""

from __future__ import annotations

import math
from typing import Optional

from torch import nn

from ..attention import choose_block_size, model_attention_backends
from ..kv_cache import blocks_for_budget

DEFAULT_MAX_MODEL_LEN = 4096  # used when the model allows more (DeepSeek's 163840 would be huge)


def resolve_block_size(model: nn.Module, block_size: Optional[int]) -> int:
    """``block_size``, or the model's attention backends' default."""
    return choose_block_size(model_attention_backends(model), block_size)


def resolve_max_model_len(model: nn.Module, max_model_len: Optional[int]) -> int:
    """``max_model_len`` checked against the model's ``max_position_embeddings``, or the default."""
    limit = getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    if max_model_len is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN)
    positive("max_model_len", max_model_len)
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
    return max_model_len


def resolve_num_blocks(model: nn.Module, block_size: int, max_model_len: int, max_num_seqs: int,
                       num_blocks: Optional[int], cache_memory_bytes: Optional[int]) -> int:
    """``num_blocks``; or what ``cache_memory_bytes`` holds; or enough for ``max_num_seqs``
    requests of ``max_model_len`` tokens (the null block included)."""
    if num_blocks is not None and cache_memory_bytes is not None:
        raise ValueError("give num_blocks or cache_memory_bytes, not both")
    if cache_memory_bytes is not None:
        positive("cache_memory_bytes", cache_memory_bytes)
        return blocks_for_budget(model.kv_cache_specs(), block_size, cache_memory_bytes)
    if num_blocks is None:
        return 1 + max_num_seqs * math.ceil(max_model_len / block_size)
    return positive("num_blocks", num_blocks, minimum=2, why=" (block 0 is the reserved null block)")


def positive(name: str, value, minimum: int = 1, why: str = "") -> int:
    """``value`` if it is an int >= ``minimum``, else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{why}, got {value!r}")
    return value
