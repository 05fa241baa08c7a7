"""Paged attention (MHA / GQA) over the tuple cache ``KVCache(k, v)``.

Shape legend: B decode rows, Hq query heads, Hk kv heads, G = Hq / Hk, D head size,
T block-table token slots, L a prefill sequence's context, Q its new tokens.

The pure-torch forms over gathered rows (``reference.ReferencePaged``); ``cpu.CpuPaged`` reads
the cache in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kv_cache import KVCache
from .metadata import DecodeMetadata, PrefillMetadata
from .paging import (by_rows, causal_mask, float32_products, gather_rows, gather_sequence, masked_softmax,
                     reads_one, valid_slots)


def paged_decode(q: Tensor, cache: KVCache, decode: DecodeMetadata, scale: float) -> Tensor:
    """Decode attention over gathered keys and values: ``[B, Hq, D]`` -> ``[B, Hq, D]``.

    Keys and values are multiplied heads first (``[B, Hk, T, D]``, the layout batched products
    take); where ``paging.float32_products`` they are converted to float32 in the same copy and
    each product is rounded once to the cache dtype, as aten's own bfloat16 product is.
    """
    b, hq, d = q.shape
    hk = cache.k.shape[2]
    dtype = torch.float32 if float32_products(cache.k) else cache.k.dtype
    k = _heads_first(gather_rows(cache.k, decode.block_tables), dtype)  # [B, Hk, T, D]
    v = _heads_first(gather_rows(cache.v, decode.block_tables), dtype)  # [B, Hk, T, D]
    qg = q.view(b, hk, hq // hk, d)  # [B, Hk, G, D]
    scores = by_rows("bkgd,bktd->bkgt", qg, k, cache.k.dtype)
    mask = valid_slots(reads_one(decode.context_lens), k.shape[2])[:, None, None, :]  # [B, 1, 1, T]
    probs = masked_softmax(scores, mask, scale).to(cache.v.dtype)
    return by_rows("bkgt,bktd->bkgd", probs, v, cache.v.dtype).reshape(b, hq, d)


def _heads_first(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """``[B, T, Hk, D]`` -> ``[B, Hk, T, D]`` in ``dtype``: a view, or one contiguous copy."""
    rows = rows.transpose(1, 2)
    return rows if rows.dtype == dtype else rows.to(dtype, memory_format=torch.contiguous_format)


def paged_prefill(q: Tensor, cache: KVCache, prefill: PrefillMetadata, scale: float) -> Tensor:
    """Prefill attention with cached context: ``[sum Q, Hq, D]`` -> ``[sum Q, Hq, D]``."""
    outs, start = [], 0
    g = q.shape[1] // cache.k.shape[2]
    for i, (q_len, ctx) in enumerate(zip(prefill.query_lens, prefill.context_lens)):
        k = gather_sequence(cache.k, prefill.block_tables[i], ctx).transpose(0, 1)  # [Hk, L, D]
        v = gather_sequence(cache.v, prefill.block_tables[i], ctx).transpose(0, 1)
        qs = q[start:start + q_len].transpose(0, 1)  # [Hq, Q, D]
        mask = causal_mask(q_len, ctx, q.device)
        out = F.scaled_dot_product_attention(qs, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0),
                                             attn_mask=mask, scale=scale)
        outs.append(out.transpose(0, 1))
        start += q_len
    return torch.cat(outs)
