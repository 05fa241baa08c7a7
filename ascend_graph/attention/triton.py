"""Attention backends over the Triton op ``ascend_graph::triton_decode_attention``
(``kernels/triton_attention.py``) on CUDA: decode reads each row's live blocks only
(``context_lens``), where they lie, in one kernel (flash decoding, a merge kernel after it where a
small batch splits its rows), the same call in eager and compiled steps. The graph keeps the
full-width block table as its input; the kernel's loop bounds follow the context, inside the
captured CUDA graph.

Shape legend: B decode rows, H heads (Hq query, Hk kv), Dn qk_nope_head_dim, R
qk_rope_head_dim, Dv v_head_dim, C kv_lora_rank, D head size.

Prefill is compute-bound and runs the reference forms (they read each sequence's live blocks only).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import triton_attention
from ..kv_cache import KVCache, MLACache
from .base import MLABackend, PagedBackend
from .metadata import DecodeMetadata
from .mla import mla_prefill
from .paged import paged_prefill


def _kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "cuda" and dtype in triton_attention.DTYPES
            and triton_attention.available())


class TritonMLA(MLABackend):
    """MLA decode in the Triton kernel: float16, bfloat16 or float32 caches on CUDA where triton
    imports. The latent query runs against ``kv_c`` and ``k_pe`` (read apart), and each ``kv_c``
    tile read for the scores gives the latent output too."""

    name = "triton"
    reads_live_only = True

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return _kernel_runs(device, dtype)

    def decode(self, q_nope: Tensor, q_pe: Tensor, cache: MLACache, decode: DecodeMetadata,
               w_uk: Tensor, w_uv: Tensor, scale: float) -> Tensor:
        dtype = cache.kv_c.dtype
        q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk).to(dtype)  # [B, H, C]
        o_lat = torch.ops.ascend_graph.triton_decode_attention(
            q_lat, q_pe.to(dtype), cache.kv_c, cache.k_pe, cache.kv_c, decode.block_tables, decode.context_lens,
            scale)  # [B, H, C]
        return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)

    def prefill(self, q_nope, q_pe, cache, prefill, w_uk, w_uv, scale):
        return mla_prefill(q_nope, q_pe, cache, prefill, w_uk, w_uv, scale)


class TritonPaged(PagedBackend):
    """Standard (MHA / GQA) attention's decode in the Triton kernel, the query heads of each kv head
    together: float16, bfloat16 or float32 caches on CUDA where triton imports."""

    name = "triton"
    reads_live_only = True

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return _kernel_runs(device, dtype)

    def decode(self, q: Tensor, cache: KVCache, decode: DecodeMetadata, scale: float) -> Tensor:
        return torch.ops.ascend_graph.triton_decode_attention(q.to(cache.k.dtype), None, cache.k, None, cache.v,
                                                              decode.block_tables, decode.context_lens, scale)

    def prefill(self, q, cache, prefill, scale):
        return paged_prefill(q, cache, prefill, scale)
