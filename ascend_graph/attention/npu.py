"""Attention backends over torch_npu's fused operators (Ascend NPU), as vllm-ascend's torchair
graph mode called them (docs/npu.md has the calls, the sources, the limits and what has not run).

Shape legend: T tokens, B decode rows, H heads (Hq query, Hk kv), Dn qk_nope_head_dim, R
qk_rope_head_dim, Dv v_head_dim, C kv_lora_rank, D head size, N blocks, S block size,
sum Q / sum L a prefill's new tokens / context tokens.

- Decode: ``torch_npu.npu_fused_infer_attention_score`` over the paged tuple caches in place
  (``block_table``, ``block_size``, ``actual_seq_lengths_kv``: each row's live blocks only); MLA
  passes ``kv_c`` as key and value and ``k_pe`` as ``key_rope`` (absorbed, one kv head, the
  query contiguous as documented). The lengths are host ints (``host_context_lens``): the
  operator's ``SymInt[]``, which a graph compiled with ``dynamic=True`` keeps symbolic.
- MLA cache write: ``npu_kv_rmsnorm_rope_cache_v2`` (7.2 on; its schema declares that it
  mutates both caches) or ``npu_kv_rmsnorm_rope_cache`` (7.1; its schema declares no mutation:
  it writes in place and returns the caches, and the layer reads what it returns, else a graph
  compiler drops the write). RMSNorm of ``kv_c``, rope of ``k_pe`` (stored de-interleaved, so
  ``rope_query`` rotates ``q_pe`` into the same layout), the scatter into both tuple tensors.
  Padding slots stay -1 (the operator skips them). A rotate-half checkpoint: norm and rope in
  torch, ``write_slots``.
- GQA cache write: ``torch_npu.npu_scatter_nd_update_`` on both tensors (padding -> slot 0 of
  the null block: that operator takes no negative index).
- Prefill with cached context: the live context gathered per sequence (no full-width gather),
  then ``npu_fused_infer_attention_score`` in its ``TND`` layout, bottom-right causal
  (``sparse_mode=3``), where the documented head sizes, heads and dtype allow (``npu_limits``;
  float16 cast to bfloat16 on 7.1/7.2); else the pure-torch prefill, counted in
  ``prefill_runs``.
- Chosen only for layers the operators take (``refuses``): MLA latent 512, rope 64 and the
  release's query heads; else selection falls to the next backend (``reference`` on an NPU).

float16 and bfloat16 caches (the operators' dtypes); MLA decode takes block size 128 only (the
size vllm-ascend's MLA kernels declare), GQA multiples of 16 up to 512. torch_npu is imported
only when the backend runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
from collections import Counter
from typing import Optional

import torch
from torch import Tensor

from ..kv_cache import MLACache
from ..layers import apply_rope
from . import npu_limits as limits
from .base import AttentionShape, MLABackend, PagedBackend
from .mla import mla_prefill
from .paged import paged_prefill
from .paging import gather_sequence

logger = logging.getLogger(__name__)
DTYPES = (torch.float16, torch.bfloat16)
FUSED_WRITE_DIMS = limits.FUSED_WRITE_DIMS
CAUSAL_MASK_SIZE = 2048  # sparse_mode=3 takes a [2048, 2048] mask, True above the diagonal
MISSING = ("the npu attention backend needs torch_npu (and the Ascend CANN toolkit): "
           "`pip install 'ascend-graph[npu]'` with a torch_npu matching your torch")


def torch_npu():
    """The ``torch_npu`` module; ImportError with what to install where it is absent."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as e:
        raise ImportError(f"{MISSING} (import torch_npu failed: {e})") from e


def _runs(device: torch.device, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "npu" and dtype in DTYPES
            and importlib.util.find_spec("torch_npu") is not None)


def host_lens(decode) -> list[int]:
    """The decode rows' context lengths as host ints (``DecodeMetadata.context_lens_host``)."""
    if decode.context_lens_host is not None:
        return list(decode.context_lens_host)
    if torch.compiler.is_compiling():
        raise ValueError("decode.context_lens_host must be set for the npu backend inside a graph "
                         "(build_attention_metadata(..., host_context_lens=True))")
    return decode.context_lens.tolist()


def deinterleave(x: Tensor) -> Tensor:
    """``x [..., R]`` with its pairs' first elements first: ``cat(x[..., 0::2], x[..., 1::2])``."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


_MASKS: dict[torch.device, Tensor] = {}


def causal_mask(device: torch.device) -> Tensor:
    """The ``[2048, 2048]`` bool mask ``sparse_mode=3`` reads (True: masked), one per device."""
    if device not in _MASKS:
        ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device)
        _MASKS[device] = torch.triu(ones, diagonal=1)
    return _MASKS[device]


def prefill_tnd(npu, q: Tensor, k: Tensor, v: Tensor, query_lens, context_lens, num_kv_heads: int,
                scale: float) -> Tensor:
    """Causal attention of ``q [sum Q, H, D]`` over ``k [sum L, Hk, D]``, ``v [sum L, Hk, Dv]``
    (each sequence's last ``Q`` of ``L`` tokens are its queries) through the fused operator's
    ``TND`` layout; ``[sum Q, H, Dv]``."""
    out, _ = npu.npu_fused_infer_attention_score(
        q.contiguous(), k.contiguous(), v.contiguous(), num_heads=q.shape[1], num_key_value_heads=num_kv_heads,
        input_layout="TND", atten_mask=causal_mask(q.device), sparse_mode=3, scale=scale,
        actual_seq_lengths=list(itertools.accumulate(query_lens)),
        actual_seq_lengths_kv=list(itertools.accumulate(context_lens)))
    return out


class _NpuOps:
    """What both npu backends share: where they run, the host lengths, the default block size,
    ``torch_npu`` (imported when the backend is built: a graph cannot trace an import), the
    release whose limits apply, and the prefill paths taken (``prefill_runs``: "tnd", or
    "torch: <why>")."""

    name = "npu"
    cache_family = "npu"
    reads_live_only = True
    host_context_lens = True
    default_block_size = 128

    def __init__(self) -> None:
        self.npu = torch_npu()
        self.release = limits.installed_release()
        self.prefill_runs: Counter = Counter()

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return _runs(device, dtype)

    def fallbacks(self) -> dict[str, int]:
        """Prefill calls that ran in torch instead of the fused TND attention, by reason."""
        return {key: n for key, n in self.prefill_runs.items() if key != "tnd"}

    def _tnd(self, q_d: int, v_d: int, hq: int, hk: int, dtype: torch.dtype, prefill) -> Optional[limits.TndPlan]:
        """The TND plan for this prefill, or None (counted and logged once per reason)."""
        plan, why = limits.tnd_plan(self.release, q_d, v_d, hq, hk, dtype)
        why = why or limits.tnd_lengths_refusal(self.release, prefill.query_lens, prefill.context_lens) or ""
        key = f"torch: {why}" if why else "tnd"
        if why and not self.prefill_runs[key]:
            logger.warning("npu attention: this prefill runs in torch, not the fused TND attention: %s", why)
        self.prefill_runs[key] += 1
        return None if why else plan


class NpuMLA(_NpuOps, MLABackend):
    """MLA on the NPU's fused operators: float16 / bfloat16 caches on an ``npu`` device, latent
    512 and rope 64 (the operators' only sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.write_op = limits.WRITE_V2 if self.release >= (7, 2) else limits.WRITE_V1

    @classmethod
    def refuses(cls, shape: Optional[AttentionShape]) -> Optional[str]:
        torch_npu()
        return limits.mla_decode_refusal(shape, limits.installed_release())

    @classmethod
    def block_size_ok(cls, block_size: int) -> bool:
        return block_size == 128

    @staticmethod
    def _fused(c: int, r: int, interleaved: bool) -> bool:
        return interleaved and (c, r) == FUSED_WRITE_DIMS

    def cached_rope_layout(self, interleaved: bool) -> str:
        return "deinterleaved" if interleaved else "half"

    def rope_query(self, q_pe: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
        rotated = apply_rope(q_pe, cos, sin, interleaved)
        return deinterleave(rotated) if interleaved else rotated

    def write_latent(self, cache, kv_c, k_pe, norm, cos, sin, slot_mapping, interleaved) -> MLACache:
        t, c, r = kv_c.shape[0], kv_c.shape[-1], k_pe.shape[-1]
        if not self._fused(c, r, interleaved):
            k_rot = self.rope_query(k_pe[:, None, :], cos, sin, interleaved)
            self.write(cache, norm(kv_c)[:, None, :], k_rot, slot_mapping)
            return cache
        dtype = cache.kv_c.dtype
        both = lambda x: torch.cat((x, x), dim=-1).to(dtype).view(t, 1, 1, r)  # noqa: E731  [T, 1, 1, R]
        kv = torch.cat((kv_c, k_pe), dim=-1).to(dtype).view(t, 1, 1, c + r)  # [B, N, S, C + R] as it takes
        args = (kv, norm.weight.to(dtype), both(cos), both(sin), slot_mapping.to(torch.int64), cache.k_pe, cache.kv_c)
        if self.write_op == limits.WRITE_V2:  # declares the mutation: later reads follow it
            self.npu.npu_kv_rmsnorm_rope_cache_v2(*args, epsilon=norm.eps, cache_mode="PA")
            return cache
        k_pe_out, kv_c_out, _, _ = self.npu.npu_kv_rmsnorm_rope_cache(*args, epsilon=norm.eps, cache_mode="PA")
        return MLACache(kv_c_out, k_pe_out)  # the same memory; reading these keeps the write in a graph

    def decode(self, q_nope, q_pe, cache, decode, w_uk, w_uv, scale):
        b, h = q_nope.shape[:2]
        n, s, _, c = cache.kv_c.shape
        r, dtype = cache.k_pe.shape[-1], cache.kv_c.dtype
        q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk).to(dtype).contiguous()  # [B, H, C], as documented
        kv = cache.kv_c.view(n, 1, s, c)  # [N, 1, S, C]: one kv head, the same memory
        out, _ = self.npu.npu_fused_infer_attention_score(
            q_lat.view(b, h, 1, c), kv, kv, query_rope=q_pe.to(dtype).contiguous().view(b, h, 1, r),
            key_rope=cache.k_pe.view(n, 1, s, r), num_heads=h, num_key_value_heads=1, input_layout="BNSD",
            atten_mask=None, sparse_mode=0, scale=scale, antiquant_mode=0, antiquant_scale=None,
            block_table=decode.block_tables, block_size=s, actual_seq_lengths_kv=host_lens(decode))
        return torch.einsum("bhc,hvc->bhv", out.view(b, h, c), w_uv)

    def prefill(self, q_nope, q_pe, cache, prefill, w_uk, w_uv, scale):
        h, dv, d = q_nope.shape[1], w_uv.shape[1], q_nope.shape[-1] + q_pe.shape[-1]
        plan = self._tnd(d, dv, h, h, cache.kv_c.dtype, prefill)
        if plan is None:
            return mla_prefill(q_nope, q_pe, cache, prefill, w_uk, w_uv, scale)
        ks, vs = [], []
        for i, ctx in enumerate(prefill.context_lens):
            kv = gather_sequence(cache.kv_c, prefill.block_tables[i], ctx).squeeze(1)  # [L, C]
            pe = gather_sequence(cache.k_pe, prefill.block_tables[i], ctx)  # [L, 1, R]
            k_nope = torch.einsum("lc,hdc->lhd", kv, w_uk)  # [L, H, Dn]
            ks.append(torch.cat((k_nope, pe.expand(-1, h, -1).to(k_nope.dtype)), dim=-1))
            vs.append(torch.einsum("lc,hvc->lhv", kv, w_uv))  # [L, H, Dv]
        v = torch.nn.functional.pad(torch.cat(vs), (0, plan.v_width - dv))  # [sum L, H, Dv or D]
        q = torch.cat((q_nope, q_pe.to(q_nope.dtype)), dim=-1)  # [sum Q, H, D]
        k = torch.cat(ks)
        out = prefill_tnd(self.npu, q.to(plan.dtype), k.to(plan.dtype), v.to(plan.dtype), prefill.query_lens,
                          prefill.context_lens, h, scale)
        return out[..., :dv].to(q_nope.dtype)


class NpuPaged(_NpuOps, PagedBackend):
    """Standard (MHA / GQA) attention on the NPU's fused operators: float16 / bfloat16 caches on
    an ``npu`` device."""

    @classmethod
    def refuses(cls, shape: Optional[AttentionShape]) -> Optional[str]:
        return limits.gqa_decode_refusal(shape)

    @classmethod
    def block_size_ok(cls, block_size: int) -> bool:
        return 16 <= block_size <= 512 and block_size % 16 == 0

    def write(self, cache, first, second, slot_mapping) -> None:
        s = cache.k.shape[1]
        slots = slot_mapping.clamp(min=0).to(torch.int64)[:, None]  # padding -> slot 0 of the null block
        indices = torch.cat((slots // s, slots % s), dim=1)  # [T, 2]: (block, offset)
        self.npu.npu_scatter_nd_update_(cache.k, indices, first.to(cache.k.dtype))
        self.npu.npu_scatter_nd_update_(cache.v, indices, second.to(cache.v.dtype))

    def decode(self, q, cache, decode, scale):
        b, hq, d = q.shape
        n, s, hk, _ = cache.k.shape
        out, _ = self.npu.npu_fused_infer_attention_score(
            q.to(cache.k.dtype).reshape(b, 1, hq * d), cache.k.view(n, s, hk * d), cache.v.view(n, s, hk * d),
            num_heads=hq, num_key_value_heads=hk, input_layout="BSH", atten_mask=None, sparse_mode=0,
            scale=scale, antiquant_mode=0, antiquant_scale=None, block_table=decode.block_tables, block_size=s,
            actual_seq_lengths_kv=host_lens(decode))
        return out.view(b, hq, d)

    def prefill(self, q, cache, prefill, scale):
        hq, d, hk = q.shape[1], q.shape[-1], cache.k.shape[2]
        plan = self._tnd(d, d, hq, hk, cache.k.dtype, prefill)
        if plan is None:
            return paged_prefill(q, cache, prefill, scale)
        ks = [gather_sequence(cache.k, prefill.block_tables[i], ctx) for i, ctx in enumerate(prefill.context_lens)]
        vs = [gather_sequence(cache.v, prefill.block_tables[i], ctx) for i, ctx in enumerate(prefill.context_lens)]
        out = prefill_tnd(self.npu, q.to(plan.dtype), torch.cat(ks).to(plan.dtype), torch.cat(vs).to(plan.dtype),
                          prefill.query_lens, prefill.context_lens, hk, scale)
        return out.to(q.dtype)


__all__ = ["NpuMLA", "NpuPaged"]
