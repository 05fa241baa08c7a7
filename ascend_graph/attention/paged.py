"""Paged attention (MHA / GQA) over the tuple cache ``KVCache(k, v)``.

Shape legend: B decode rows, Hq query heads, Hk kv heads, G = Hq / Hk, D head size,
T block-table token slots, L a prefill sequence's context, Q its new tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kv_cache import KVCache
from .metadata import DecodeMetadata, PrefillMetadata
from .paging import causal_mask, gather_rows, gather_sequence, masked_softmax, valid_slots


def paged_decode(q: Tensor, cache: KVCache, decode: DecodeMetadata, scale: float) -> Tensor:
    """Decode attention: ``[B, Hq, D]`` -> ``[B, Hq, D]``."""
    b, hq, d = q.shape
    hk = cache.k.shape[2]
    k = gather_rows(cache.k, decode.block_tables)  # [B, T, Hk, D]
    v = gather_rows(cache.v, decode.block_tables)  # [B, T, Hk, D]
    qg = q.view(b, hk, hq // hk, d)  # [B, Hk, G, D]
    scores = torch.einsum("bkgd,btkd->bkgt", qg, k)
    mask = valid_slots(decode.context_lens, k.shape[1])[:, None, None, :]  # [B, 1, 1, T]
    probs = masked_softmax(scores, mask, scale).to(v.dtype)
    return torch.einsum("bkgt,btkd->bkgd", probs, v).reshape(b, hq, d)


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
