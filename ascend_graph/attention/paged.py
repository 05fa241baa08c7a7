"""Paged attention (MHA / GQA) over the tuple cache ``KVCache(k, v)``.

Shape legend: B decode rows, Hq query heads, Hk kv heads, G = Hq / Hk, D head size,
T block-table token slots, L a prefill sequence's context, Q its new tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from ..kv_cache import KVCache
from .metadata import DecodeMetadata, PrefillMetadata
from .paging import (by_rows, causal_mask, float32_products, gather_rows, gather_sequence, masked_softmax,
                     valid_slots)


def paged_decode(q: Tensor, cache: KVCache, decode: DecodeMetadata, scale: float) -> Tensor:
    """Decode attention: ``[B, Hq, D]`` -> ``[B, Hq, D]``.

    Where aten emulates bfloat16 matmuls (``paging.float32_products``: a CPU without AVX-512) and
    the project's kernel runs (``kernels.available()``), both products read each kv
    head's rows where they lie in the cache, through the block table, eager and compiled alike:
    ``paged_rows_mm`` for the scores, ``paged_rows_bmm`` for the values (float32 sums, each
    rounded once to bfloat16, as aten's own bfloat16 product). No gathered copy is made. Measured
    (Zen 3, torch 2.13, 1 thread, bfloat16, 32 query and 8 kv heads of 128, batch 8, context
    1024, blocks of 16, interleaved, ms, ``_gathered_decode`` / this; ``python -m
    benchmarks.attention``, six runs): eager 34.1-38.8 / 10.1-12.2, compiled 19.2-22.9 /
    9.5-12.3. The two products ran at 16 and 19 GFLOP/s (each timed alone): a kv head's 4 query
    rows against rows of 128 leave the tiles' reductions a large share.

    Elsewhere the gathered keys and values are multiplied heads first (``_gathered_decode``).
    """
    if _products_in_kernel(cache):
        b, hq, d = q.shape
        qg = q.to(cache.k.dtype).reshape(b, cache.k.shape[2], hq // cache.k.shape[2], d)  # [B, Hk, G, D]
        scores = torch.ops.ascend_graph.paged_rows_mm(qg, cache.k, decode.block_tables)  # [B, Hk, G, T]
        mask = valid_slots(decode.context_lens, scores.shape[-1])[:, None, None, :]  # [B, 1, 1, T]
        probs = masked_softmax(scores, mask, scale).to(cache.v.dtype)
        return torch.ops.ascend_graph.paged_rows_bmm(probs, cache.v, decode.block_tables).reshape(b, hq, d)
    return _gathered_decode(q, cache, decode, scale)


def _products_in_kernel(cache: KVCache) -> bool:
    """Whether ``paged_decode`` reads the cache in place through the project's kernel (above)."""
    if not (float32_products(cache.k) and cache.v.dtype == cache.k.dtype):
        return False

    return kernels.available()


def _gathered_decode(q: Tensor, cache: KVCache, decode: DecodeMetadata, scale: float) -> Tensor:
    """``paged_decode`` over gathered keys and values, multiplied heads first (``[B, Hk, T, D]``),
    the layout the batched products take; and in float32 where aten emulates bfloat16 matmuls
    (``paging.float32_products``), transposed and converted in one copy, each product then rounded
    once to the cache's dtype as aten's own bfloat16 product is. Measured (Zen 3, torch 2.13, 1
    thread, bfloat16, 32 query and 8 kv heads of 128, batch 8, context 1024, blocks of 16,
    interleaved, ms, the former form / this; ``python -m benchmarks.attention``, three runs):
    eager 127.2-138.4 / 30.1-36.0, compiled 42.8-46.6 / 20.3-21.4. Over the gathered
    ``[B, T, Hk, D]`` rows as before, float32 alone made eager 70.0 and compiled 45.6 (one-off).
    """
    b, hq, d = q.shape
    hk = cache.k.shape[2]
    dtype = torch.float32 if float32_products(cache.k) else cache.k.dtype
    k = _heads_first(gather_rows(cache.k, decode.block_tables), dtype)  # [B, Hk, T, D]
    v = _heads_first(gather_rows(cache.v, decode.block_tables), dtype)  # [B, Hk, T, D]
    qg = q.view(b, hk, hq // hk, d)  # [B, Hk, G, D]
    scores = by_rows("bkgd,bktd->bkgt", qg, k, cache.k.dtype)
    mask = valid_slots(decode.context_lens, k.shape[2])[:, None, None, :]  # [B, 1, 1, T]
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
