"""Attention backends over the project's CPU kernel (``ascend_graph.kernels``): decode reads each
row's cache blocks where they lie, through the block table, with no gathered copy.

Shape legend as in ``base.py``; G = Hq / Hk query heads per kv head, T = block-table width x block size.

``paged_rows_mm`` gives the scores, ``paged_rows_bmm`` the probabilities times the rows; both sum
in float32 and round each output once to bfloat16. Prefill is compute-bound and runs the
reference forms. The same calls run in eager and compiled steps.
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
from .paging import aten_bf16_emulated, masked_softmax, valid_slots


def _kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16 and kernels.available()


class CpuMLA(MLABackend):
    """MLA decode in the kernel: bfloat16 caches on a CPU where the kernel builds."""

    name = "cpu_kernel"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return _kernel_runs(device, dtype)

    def decode(self, q_nope: Tensor, q_pe: Tensor, cache: MLACache, decode: DecodeMetadata,
               w_uk: Tensor, w_uv: Tensor, scale: float) -> Tensor:
        dtype = cache.kv_c.dtype
        q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk).to(dtype)  # [B, H, C]
        tables = decode.block_tables
        scores = (torch.ops.ascend_graph.paged_rows_mm(q_lat, cache.kv_c, tables)
                  + torch.ops.ascend_graph.paged_rows_mm(q_pe.to(dtype), cache.k_pe, tables))  # [B, H, T]
        mask = valid_slots(decode.context_lens, scores.shape[-1])[:, None, :]  # [B, 1, T]
        probs = masked_softmax(scores, mask, scale).to(dtype)
        o_lat = torch.ops.ascend_graph.paged_rows_bmm(probs, cache.kv_c, tables)  # [B, H, C]
        return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)

    def prefill(self, q_nope, q_pe, cache, prefill, w_uk, w_uv, scale):
        return mla_prefill(q_nope, q_pe, cache, prefill, w_uk, w_uv, scale)


class CpuPaged(PagedBackend):
    """Standard attention's decode in the kernel, each kv head's rows read in place: bfloat16
    caches on a CPU where the kernel builds and aten has no native bfloat16 matmul (elsewhere
    aten's batched products over the gathered rows were as fast: docs/cpu-kernels.md)."""

    name = "cpu_kernel"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return _kernel_runs(device, dtype) and aten_bf16_emulated()

    def decode(self, q: Tensor, cache: KVCache, decode: DecodeMetadata, scale: float) -> Tensor:
        b, hq, d = q.shape
        hk = cache.k.shape[2]
        qg = q.to(cache.k.dtype).reshape(b, hk, hq // hk, d)  # [B, Hk, G, D]
        scores = torch.ops.ascend_graph.paged_rows_mm(qg, cache.k, decode.block_tables)  # [B, Hk, G, T]
        mask = valid_slots(decode.context_lens, scores.shape[-1])[:, None, None, :]  # [B, 1, 1, T]
        probs = masked_softmax(scores, mask, scale).to(cache.v.dtype)
        return torch.ops.ascend_graph.paged_rows_bmm(probs, cache.v, decode.block_tables).reshape(b, hq, d)

    def prefill(self, q, cache, prefill, scale):
        return paged_prefill(q, cache, prefill, scale)
