"""Multi-head Latent Attention over the tuple cache ``MLACache(kv_c, k_pe)``.

Shape legend: B decode rows, H heads, Dn qk_nope_head_dim, Dv v_head_dim, C kv_lora_rank,
R qk_rope_head_dim, T block-table token slots, L a prefill sequence's context, Q its new tokens.

Weights: ``w_uk [H, Dn, C]`` and ``w_uv [H, Dv, C]``, the two parts of ``kv_b_proj.weight``
(any strides). The two cache tensors are always read separately: scores are
``q_latent . kv_c + q_pe . k_pe``, never a concatenation of caches. These are the pure-torch
forms over gathered rows (``reference.ReferenceMLA``); ``cpu.CpuMLA`` reads the cache in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kv_cache import MLACache
from .metadata import DecodeMetadata, PrefillMetadata
from .paging import (by_rows, causal_mask, float32_products, gather_rows, gather_sequence, masked_softmax,
                     reads_one, valid_slots)


def mla_decode(q_nope: Tensor, q_pe: Tensor, cache: MLACache, decode: DecodeMetadata,
               w_uk: Tensor, w_uv: Tensor, scale: float) -> Tensor:
    """Absorbed MLA decode: ``[B, H, Dn]``, ``[B, H, R]`` -> ``[B, H, Dv]``.

    The query is projected into the latent space (``W_UK``), attention runs over the latent
    cache directly, and the latent output goes back through ``W_UV``.
    """
    q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk)  # [B, H, C]
    kv = gather_rows(cache.kv_c, decode.block_tables).squeeze(2)  # [B, T, C]
    pe = gather_rows(cache.k_pe, decode.block_tables).squeeze(2)  # [B, T, R]
    kv_in, pe_in = product_rows(kv), product_rows(pe)  # as the products read them (float32 in some eager)
    scores = by_rows("bhc,btc->bht", q_lat, kv_in, kv.dtype) + by_rows("bhr,btr->bht", q_pe, pe_in, kv.dtype)
    mask = valid_slots(reads_one(decode.context_lens), kv.shape[1])[:, None, :]  # [B, 1, T]
    probs = masked_softmax(scores, mask, scale).to(kv.dtype)  # [B, H, T]
    o_lat = by_rows("bht,btc->bhc", probs, kv_in, kv.dtype)  # [B, H, C]
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)


def product_rows(rows: Tensor) -> Tensor:
    """Gathered cache rows as ``mla_decode``'s products read them: ``rows`` itself, or a float32
    copy (made once for the scores and the values) where ``paging.float32_products(rows)``; each
    product is then rounded once to the cache dtype (``by_rows``), as aten's bfloat16 product is.
    The same in eager and compiled steps. Why: docs/cpu-kernels.md ("aten without bf16")."""
    return rows.float() if float32_products(rows) else rows


def mla_prefill(q_nope: Tensor, q_pe: Tensor, cache: MLACache, prefill: PrefillMetadata,
                w_uk: Tensor, w_uv: Tensor, scale: float) -> Tensor:
    """MLA prefill with cached context: ``[sum Q, H, Dn]``, ``[sum Q, H, R]`` -> ``[sum Q, H, Dv]``.

    Each sequence's whole context (earlier tokens and the new ones, already written) is read
    from the tuple cache and up-projected; prefill is compute-bound, so the plain form is used.
    """
    outs, start = [], 0
    for i, (q_len, ctx) in enumerate(zip(prefill.query_lens, prefill.context_lens)):
        kv = gather_sequence(cache.kv_c, prefill.block_tables[i], ctx).squeeze(1)  # [L, C]
        pe = gather_sequence(cache.k_pe, prefill.block_tables[i], ctx).squeeze(1)  # [L, R]
        k_nope = torch.einsum("tc,hdc->htd", kv, w_uk)  # [H, L, Dn]
        v = torch.einsum("tc,hvc->htv", kv, w_uv)  # [H, L, Dv]
        k = torch.cat([k_nope, pe.expand(k_nope.shape[0], -1, -1)], dim=-1)  # [H, L, Dn + R]
        q = torch.cat([q_nope[start:start + q_len], q_pe[start:start + q_len]], dim=-1).transpose(0, 1)
        mask = causal_mask(q_len, ctx, q.device)  # [Q, L]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1))
        start += q_len
    return torch.cat(outs)
