"""Attention metadata for a batch: block tables, context lengths, slot mapping, positions.

Shape legend: T tokens in the step, B decode sequences, P prefill sequences,
M block-table width (blocks per sequence row).

Tokens are ordered decodes first (one token each), then prefills (contiguous runs), as
vllm-ascend orders them. Everything here is tensors or host tuples of ints, so the decode part
is a graph input with fixed types.
"""

from __future__ import annotations

import array
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..kv_cache import NULL_BLOCK, check_slots


class DecodeMetadata(NamedTuple):
    """Decode rows: one query token per sequence."""

    block_tables: Tensor  # [B, M] int32
    context_lens: Tensor  # [B] int32, cached tokens after this step's write (query included)
    # the same lengths as host ints, where a backend takes them so (``host_context_lens``), else None
    context_lens_host: Optional[tuple[int, ...]] = None


class PrefillMetadata(NamedTuple):
    """Prefill sequences (eager only): several query tokens each, possibly after cached ones."""

    block_tables: Tensor  # [P, M] int32
    query_lens: tuple[int, ...]    # new tokens per sequence
    context_lens: tuple[int, ...]  # cached tokens after the write (earlier + new)


class AttentionMetadata(NamedTuple):
    """Everything attention needs for one step; ``decode`` rows come first in the token order."""

    slot_mapping: Tensor  # [T] int64; negative = padding (writes into the null block)
    decode: Optional[DecodeMetadata]
    prefill: Optional[PrefillMetadata]

    @property
    def num_decode_tokens(self) -> int:
        return 0 if self.decode is None else self.decode.context_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.prefill is None and self.decode is not None


def _check_batch(block_tables, num_cached, num_new, block_size, max_model_len):
    n = len(block_tables)
    if not (len(num_cached) == len(num_new) == n) or n == 0:
        raise ValueError("block_tables, num_cached and num_new must be non-empty and of equal length, "
                         f"got {n}, {len(num_cached)}, {len(num_new)}")
    seen_prefill = False
    for i, (table, cached, new) in enumerate(zip(block_tables, num_cached, num_new)):
        if new < 1 or cached < 0:
            raise ValueError(f"sequence {i}: num_new must be >= 1 and num_cached >= 0, got {new}, {cached}")
        if cached + new > max_model_len:
            raise ValueError(f"sequence {i}: context length {cached + new} exceeds max_model_len={max_model_len}")
        if len(table) * block_size < cached + new:
            raise ValueError(f"sequence {i}: block_tables[{i}] has {len(table)} blocks of {block_size}, "
                             f"too few for {cached + new} tokens")
        if new > 1:
            seen_prefill = True
        elif seen_prefill:
            raise ValueError(f"sequence {i}: decode sequences (num_new == 1) must come before prefills")


# array typecode of a 4-byte int: the block tables' element (``BlockManager`` keeps its tables so)
INT32_TYPECODE = "i" if array.array("i").itemsize == 4 else "l"


def _block_table_tensor(block_tables: Sequence[Sequence[int]], width: int, num_blocks: int) -> Tensor:
    """``[len(block_tables), width]`` int32 block tables, padded with the null block, every id
    checked to be a live block.

    The ids are gathered in an ``array.array`` and checked with one tensor reduction: no Python
    loop per block id (batch 64 at 16384 tokens of context holds 65536 of them). A table that is
    an int32 ``array.array`` (``BlockManager``'s) is copied with one memcpy; other sequences are
    converted id by id.
    """
    ids = array.array(INT32_TYPECODE)
    try:
        for table in block_tables:
            ids.extend(table if isinstance(table, array.array) and table.typecode == INT32_TYPECODE else iter(table))
    except (TypeError, OverflowError) as e:
        raise ValueError(f"block_tables must hold integer block ids below 2**31: {e}") from None
    flat = torch.frombuffer(ids, dtype=torch.int32)  # shares ``ids``, a local: nothing else holds it
    low, high = (v.item() for v in torch.aminmax(flat))
    if low <= NULL_BLOCK or high >= num_blocks:
        for i, table in enumerate(block_tables):  # name the first bad id
            for b in table:
                if not NULL_BLOCK < b < num_blocks:
                    raise ValueError(f"sequence {i}: block id {b} in block_tables[{i}] is out of range "
                                     f"[{NULL_BLOCK + 1}, {num_blocks})")
    n = len(block_tables)
    if len(ids) == n * width:  # every table is full width
        return flat.view(n, width)
    padded = array.array(INT32_TYPECODE, [NULL_BLOCK]) * (n * width)
    start = 0
    for i, table in enumerate(block_tables):
        padded[i * width:i * width + len(table)] = ids[start:start + len(table)]
        start += len(table)
    return torch.frombuffer(padded, dtype=torch.int32).view(n, width)


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    num_cached: Sequence[int],
    num_new: Sequence[int],
    *,
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    block_table_width: Optional[int] = None,
    device: torch.device | str = "cpu",
    host_context_lens: bool = False,
) -> tuple[Tensor, AttentionMetadata]:
    """Metadata and positions for a batch, validated on the host before anything is written.

    Sequence ``i`` owns ``block_tables[i]``, already has ``num_cached[i]`` tokens in the cache,
    and brings ``num_new[i]`` new tokens. ``block_table_width`` fixes the table width ``M``
    (graph mode keeps it constant); by default it is the longest table in the batch.
    ``host_context_lens`` also keeps the decode rows' context lengths as host ints.
    Returns ``(positions [T] int64, metadata)``.
    """
    _check_batch(block_tables, num_cached, num_new, block_size, max_model_len)
    width = max(len(t) for t in block_tables) if block_table_width is None else block_table_width
    if width < 1 or any(len(t) > width for t in block_tables):
        raise ValueError(f"block_table_width={width} must be >= 1 and at least the longest block table "
                         f"({max(len(t) for t in block_tables)} blocks)")
    tables = _block_table_tensor(block_tables, width, num_blocks)  # [n, M] int32
    positions, slots = [], []
    for table, cached, new in zip(block_tables, num_cached, num_new):
        for pos in range(cached, cached + new):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    check_slots(slots, num_blocks * block_size, block_size)  # e.g. two sequences sharing a written block
    n_dec = sum(1 for new in num_new if new == 1)
    totals = [c + n for c, n in zip(num_cached, num_new)]
    decode = prefill = None
    if n_dec:
        decode = DecodeMetadata(tables[:n_dec].to(device),
                                torch.tensor(totals[:n_dec], dtype=torch.int32, device=device),
                                tuple(totals[:n_dec]) if host_context_lens else None)
    if n_dec < len(num_new):
        prefill = PrefillMetadata(tables[n_dec:].to(device), tuple(num_new[n_dec:]), tuple(totals[n_dec:]))
    positions_t, slots_t = torch.tensor([positions, slots], dtype=torch.int64, device=device)  # one conversion
    return positions_t, AttentionMetadata(slots_t, decode, prefill)


# What a padding row of a decode batch holds, per input: token 0 at position 0, written with
# slot -1 (into the null block), context length 0: attention that reads live blocks only reads
# nothing for it (the reference forms read the null block's first slot). It produces finite
# values that the caller drops.
DECODE_PADDING = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "block_tables": NULL_BLOCK,
                  "context_lens": 0}


def pad_decode(positions: Tensor, meta: AttentionMetadata, size: int) -> tuple[Tensor, AttentionMetadata]:
    """Pad a decode-only batch to ``size`` rows with ``DECODE_PADDING``."""
    if not meta.is_decode_only:
        raise ValueError("meta must describe a decode-only batch (no prefill sequences) to be padded")
    n = meta.num_decode_tokens
    if size < n:
        raise ValueError(f"size={size} is smaller than the batch ({n} decode rows)")
    extra = size - n
    dec = meta.decode
    pad = lambda t, value: torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])  # noqa: E731
    p = DECODE_PADDING
    padded = AttentionMetadata(pad(meta.slot_mapping, p["slot_mapping"]),
                               DecodeMetadata(pad(dec.block_tables, p["block_tables"]),
                                              pad(dec.context_lens, p["context_lens"]),
                                              pad_host_lens(dec.context_lens_host, size)), None)
    return pad(positions, p["positions"]), padded


def pad_host_lens(lens: Optional[tuple[int, ...]], size: int) -> Optional[tuple[int, ...]]:
    """Host context lengths padded to ``size`` rows with ``DECODE_PADDING``'s length (None stays None)."""
    return None if lens is None else tuple(lens) + (DECODE_PADDING["context_lens"],) * (size - len(lens))


def with_host_lens(meta: AttentionMetadata, lens: Optional[tuple[int, ...]], size: int) -> AttentionMetadata:
    """A static view's ``meta`` carrying the step's host context lengths padded to ``size`` (None: as is)."""
    if lens is None:
        return meta
    return meta._replace(decode=meta.decode._replace(context_lens_host=pad_host_lens(lens, size)))


def metadata_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """``meta`` with its tensors on ``device`` (host tuples of ints unchanged)."""
    move = lambda x: x.to(device, non_blocking=True) if isinstance(x, Tensor) else x  # noqa: E731
    decode = None if meta.decode is None else type(meta.decode)(*map(move, meta.decode))
    prefill = None if meta.prefill is None else type(meta.prefill)(*map(move, meta.prefill))
    return AttentionMetadata(move(meta.slot_mapping), decode, prefill)
