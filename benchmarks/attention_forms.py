"""The earlier forms decode attention is timed against (``benchmarks.attention``), each as it ran
before the form that replaced it, over the same tuple caches.

Shape legend: B batch, H heads, C latent (kv_lora_rank), R rope, Hk kv heads, D head width,
N num_blocks, S block_size, W block-table width, T = W * S block-table token slots.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ascend_graph.attention import DecodeMetadata
from ascend_graph.attention.paging import gather_rows, masked_softmax, valid_slots
from ascend_graph.kv_cache import MLACache, write_slots


def fused_step(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv, scale):
    """vllm-ascend's old eager MLA decode: concatenate both whole caches every step, attend over
    the result."""
    write_slots(cache.kv_c, cache.k_pe, kv_c, k_pe, meta.slot_mapping)
    fused = torch.cat([cache.kv_c, cache.k_pe], dim=-1)  # [N, S, 1, C + R]: the whole cache, copied
    c = cache.kv_c.shape[-1]
    rows = gather_rows(fused, meta.decode.block_tables).squeeze(2)  # [B, T, C + R]
    q = torch.cat([torch.einsum("bhd,hdc->bhc", q_nope, w_uk), q_pe], dim=-1)  # [B, H, C + R]
    mask = valid_slots(meta.decode.context_lens, rows.shape[1])[:, None, :]  # [B, 1, T]
    probs = masked_softmax(torch.einsum("bhk,btk->bht", q, rows), mask, scale).to(rows.dtype)
    o_lat = torch.einsum("bht,btc->bhc", probs, rows[..., :c])  # [B, H, C]
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)


def live_blocks(q_lat: Tensor, q_pe: Tensor, cache: MLACache, decode: DecodeMetadata, scale: float) -> Tensor:
    """The same attention now: ``ascend_graph::decode_attention`` over each row's live blocks."""
    return torch.ops.ascend_graph.decode_attention(q_lat, q_pe, cache.kv_c, cache.k_pe, cache.kv_c,
                                                   decode.block_tables, decode.context_lens, scale)


def former_gqa_decode(q, cache, decode, scale):
    """``paged_decode`` in its first form: the products over the gathered
    ``[B, T, Hk, D]`` rows, in the cache's dtype."""
    b, hq, d = q.shape
    hk = cache.k.shape[2]
    k = gather_rows(cache.k, decode.block_tables)
    v = gather_rows(cache.v, decode.block_tables)
    scores = torch.einsum("bkgd,btkd->bkgt", q.view(b, hk, hq // hk, d), k)
    mask = valid_slots(decode.context_lens, k.shape[1])[:, None, None, :]
    probs = masked_softmax(scores, mask, scale).to(v.dtype)
    return torch.einsum("bkgt,btkd->bkgd", probs, v).reshape(b, hq, d)
