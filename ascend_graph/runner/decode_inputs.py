"""A decode-only step given as tensors (vLLM's step inputs), checked on the host before anything runs.

Row ``i`` brings token ``token_ids[i]`` at position ``context_lens[i] - 1`` (``context_lens`` is
each sequence's length after the step), written to cache slot ``slot_mapping[i]``;
``block_tables [n, W]`` holds its blocks, columns past the ``ceil(length / block_size)`` its
length needs unread. ``check_decode_inputs`` raises a ValueError naming the argument for: shapes
and dtypes (integer tensors, ``n, W >= 1``); ids outside the vocabulary; lengths outside
``[1, max_model_len]``; slots ``kv_cache.check_slots`` refuses (in the null block, out of range,
one slot twice) or negative; block ids, among those the lengths need, outside the cache. That a
row's slot lies in its own blocks is the caller's to keep (vLLM computes both from one table).
The values are read on the host: ids, lengths and slots as lists, the block ids by one reduction.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kv_cache import NULL_BLOCK, check_slots
from .step import SequenceStep


def check_decode_inputs(token_ids: Tensor, context_lens: Tensor, block_tables: Tensor, slot_mapping: Tensor, *,
                        vocab: int, max_model_len: int, num_blocks: int,
                        block_size: int) -> tuple[list[int], list[int]]:
    """The checks above; ``(token ids, lengths)`` as host ints."""
    n = token_ids.shape[0] if token_ids.dim() == 1 else 0
    width = block_tables.shape[1] if block_tables.dim() == 2 else 0
    for name, t, shape in (("token_ids", token_ids, [n]), ("context_lens", context_lens, [n]),
                           ("slot_mapping", slot_mapping, [n]), ("block_tables", block_tables, [n, width])):
        if n < 1 or width < 1 or list(t.shape) != shape or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor (token_ids, context_lens and slot_mapping "
                             f"[n], block_tables [n, W], n and W >= 1), got {t.dtype} {list(t.shape)}")
    ids, lens, slots = token_ids.tolist(), context_lens.tolist(), slot_mapping.tolist()
    for name, values, low, high in (("token_ids", ids, 0, vocab - 1), ("context_lens", lens, 1, max_model_len)):
        bad = next((i for i, v in enumerate(values) if not low <= v <= high), None)
        if bad is not None:
            raise ValueError(f"{name}[{bad}]={values[bad]} must lie in [{low}, {high}]")
    check_slots(slots, num_blocks * block_size, block_size)
    if any(v < 0 for v in slots):
        raise ValueError(f"slot_mapping must hold each row's slot (>= 0), got {slots}")
    needed = -(-max(lens) // block_size)
    if width < needed:
        raise ValueError(f"block_tables has {width} columns; the longest row needs {needed}")
    low, high = (v.item() for v in torch.aminmax(block_tables[:, :needed]))
    if low < NULL_BLOCK or high >= num_blocks:
        raise ValueError(f"block_tables holds block ids in [{low}, {high}], outside the cache's "
                         f"[{NULL_BLOCK}, {num_blocks})")
    return ids, lens


def decode_steps(ids: list[int], lens: list[int], block_tables: Tensor, block_size: int) -> list[SequenceStep]:
    """Checked rows as ``SequenceStep``s, each with the blocks its length needs."""
    widths = [-(-length // block_size) for length in lens]
    tables = block_tables[:, :max(widths)].tolist()
    return [SequenceStep([t], length - 1, table[:w]) for t, length, table, w in zip(ids, lens, tables, widths)]
