"""Multi-head Latent Attention over the tuple cache ``MLACache(kv_c, k_pe)``.

Shape legend: B decode rows, H heads, Dn qk_nope_head_dim, Dv v_head_dim, C kv_lora_rank,
R qk_rope_head_dim, T block-table token slots, L a prefill sequence's context, Q its new tokens.

Weights: ``w_uk [H, Dn, C]`` and ``w_uv [H, Dv, C]``, the two parts of ``kv_b_proj.weight``
(any strides; the DeepSeek model passes ``W_UK`` as the transpose of a contiguous ``[H, C, Dn]``,
``models.deepseek.kv_b_parts``). The two cache tensors are always read separately: scores are
``q_latent . kv_c + q_pe . k_pe``, never a concatenation of caches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kv_cache import MLACache
from .metadata import DecodeMetadata, PrefillMetadata
from .paging import (by_rows, causal_mask, float32_products, gather_rows, gather_sequence, masked_softmax,
                     valid_slots)


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
    mask = valid_slots(decode.context_lens, kv.shape[1])[:, None, :]  # [B, 1, T]
    probs = masked_softmax(scores, mask, scale).to(kv.dtype)  # [B, H, T]
    o_lat = by_rows("bht,btc->bhc", probs, kv_in, kv.dtype)  # [B, H, C]
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)


def product_rows(rows: Tensor) -> Tensor:
    """Gathered cache rows as MLA decode's products read them: ``rows`` itself, or in eager mode,
    for bfloat16 on a CPU where aten has no native bfloat16 matmul (``paging.float32_products``), a
    float32 copy, made once for the scores and the values (``by_rows`` then rounds each product
    once to bfloat16, as aten's own bfloat16 product does: float32 sums of the same values).

    There aten's product of the probabilities by ``kv_c`` (a ``[T, C]`` matrix, reduced along its
    rows) runs at about 1 GFLOP/s. Measured (Zen 3, torch 2.13, 1 thread, V2-Lite dims, 16 heads,
    one-off, ms, bfloat16 / float32 with the conversions; latent scores, rope scores, values):
    batch 1, context 256: 0.58 / 0.38, 0.26 / 0.09, 3.62 / 0.22; batch 8, context 256: 4.31 /
    1.58, 1.74 / 0.21, 28.5 / 0.79; batch 32, context 2048: 119.5 / 119.5, 35.8 / 11.1, 1377 /
    135. The three together with ``kv_c`` converted once instead of for each product: batch 32,
    context 2048, 183-215 vs 327-330 ms; context 256, 15-17.5 vs 16.5-20.3 ms. Not done for
    float16 (there the latent scores at batch 32, context 2048 took 123 ms in float16, 161 in
    float32). Compiled, the products stay as written: ``DecodeMatmulPass`` has the kernel read
    the cache in place (GQA's ``paged_decode`` calls the kernel's paged forms itself, eager and
    compiled, under the same condition).
    """
    if torch.compiler.is_compiling() or not float32_products(rows):
        return rows
    return rows.float()


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
