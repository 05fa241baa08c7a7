"""Attention backends over the project's CPU kernel (``ascend_graph.kernels``): decode reads each
row's live blocks only (``context_lens``), where they lie, in one pass (``decode_attention``:
scores, online softmax, values), the same call in eager and compiled steps. The graph keeps the
full-width block table as its input; the op's loop bounds follow the context, so a step costs
what the live context costs, whatever ``max_model_len`` is.

Prefill is compute-bound and runs the reference forms (they read each sequence's live blocks only).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from ..kv_cache import KVCache, MLACache
from .base import MLABackend, PagedBackend
from .metadata import DecodeMetadata
from .mla import mla_prefill
from .paged import paged_prefill

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype in _KERNEL_DTYPES and kernels.available()


class CpuMLA(MLABackend):
    """MLA decode in the kernel: float32 or bfloat16 caches on a CPU where the kernel builds. The
    latent query runs against ``kv_c`` and ``k_pe`` (read apart) and the same ``kv_c`` rows give the
    latent output."""

    name = "cpu_kernel"
    reads_live_only = True

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return _kernel_runs(device, dtype)

    def decode(self, q_nope: Tensor, q_pe: Tensor, cache: MLACache, decode: DecodeMetadata,
               w_uk: Tensor, w_uv: Tensor, scale: float) -> Tensor:
        dtype = cache.kv_c.dtype
        q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk).to(dtype)  # [B, H, C]
        o_lat = torch.ops.ascend_graph.decode_attention(q_lat, q_pe.to(dtype), cache.kv_c, cache.k_pe, cache.kv_c,
                                                        decode.block_tables, decode.context_lens, scale)  # [B, H, C]
        return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)

    def prefill(self, q_nope, q_pe, cache, prefill, w_uk, w_uv, scale):
        return mla_prefill(q_nope, q_pe, cache, prefill, w_uk, w_uv, scale)


class CpuPaged(PagedBackend):
    """Standard attention's decode in the kernel, each kv head's rows read in place: float32 or
    bfloat16 caches on a CPU where the kernel builds."""

    name = "cpu_kernel"
    reads_live_only = True

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return _kernel_runs(device, dtype)

    def decode(self, q: Tensor, cache: KVCache, decode: DecodeMetadata, scale: float) -> Tensor:
        return torch.ops.ascend_graph.decode_attention(q.to(cache.k.dtype), None, cache.k, None, cache.v,
                                                       decode.block_tables, decode.context_lens, scale)

    def prefill(self, q, cache, prefill, scale):
        return paged_prefill(q, cache, prefill, scale)
