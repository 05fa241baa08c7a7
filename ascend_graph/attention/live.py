"""The bounded fallback where no live-only kernel runs (no C compiler or vector layer for the CPU
kernel, a cache dtype it does not take): the reference forms over gathered rows, cut to the
batch's longest live context. Each decode runs as one opaque op (``ascend_graph::mla_decode_live``,
``ascend_graph::paged_decode_live``) whose body reads ``context_lens`` on the host and gathers
``ceil(max(context_lens) / S)`` blocks per row, so a captured graph keeps its full-width shapes
while the step costs what the batch's longest row costs. CPU only: the host read would end a
device graph's capture.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kv_cache import KVCache, MLACache
from .base import MLABackend, PagedBackend
from .metadata import DecodeMetadata
from .mla import mla_decode, mla_prefill
from .paged import paged_decode, paged_prefill


def live_width(decode: DecodeMetadata, block_size: int) -> DecodeMetadata:
    """``decode`` with its block tables cut to the blocks the longest row uses (at least one)."""
    longest = int(decode.context_lens.max()) if decode.context_lens.numel() else 0
    return DecodeMetadata(decode.block_tables[:, :max(1, -(-longest // block_size))], decode.context_lens)


@torch.library.custom_op("ascend_graph::mla_decode_live", mutates_args=())
def mla_decode_live(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, block_tables: Tensor,
                    context_lens: Tensor, w_uk: Tensor, w_uv: Tensor, scale: float) -> Tensor:
    """``mla.mla_decode`` over the live width of the tables (``live_width``)."""
    decode = live_width(DecodeMetadata(block_tables, context_lens), kv_c.shape[1])
    return mla_decode(q_nope, q_pe, MLACache(kv_c, k_pe), decode, w_uk, w_uv, scale)


@mla_decode_live.register_fake
def _(q_nope, q_pe, kv_c, k_pe, block_tables, context_lens, w_uk, w_uv, scale):
    return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])


@torch.library.custom_op("ascend_graph::paged_decode_live", mutates_args=())
def paged_decode_live(q: Tensor, k: Tensor, v: Tensor, block_tables: Tensor, context_lens: Tensor,
                      scale: float) -> Tensor:
    """``paged.paged_decode`` over the live width of the tables (``live_width``)."""
    decode = live_width(DecodeMetadata(block_tables, context_lens), k.shape[1])
    return paged_decode(q, KVCache(k, v), decode, scale)


@paged_decode_live.register_fake
def _(q, k, v, block_tables, context_lens, scale):
    return torch.empty_like(q)


class LiveMLA(MLABackend):
    """MLA's reference forms over the batch's live width: CPU, any dtype."""

    name = "gathered_live"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return torch.device(device).type == "cpu"

    def decode(self, q_nope, q_pe, cache, decode, w_uk, w_uv, scale):
        return torch.ops.ascend_graph.mla_decode_live(q_nope, q_pe, cache.kv_c, cache.k_pe, decode.block_tables,
                                                      decode.context_lens, w_uk, w_uv, scale)

    def prefill(self, q_nope, q_pe, cache, prefill, w_uk, w_uv, scale):
        return mla_prefill(q_nope, q_pe, cache, prefill, w_uk, w_uv, scale)


class LivePaged(PagedBackend):
    """Standard attention's reference forms over the batch's live width: CPU, any dtype."""

    name = "gathered_live"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return torch.device(device).type == "cpu"

    def decode(self, q, cache, decode, scale):
        return torch.ops.ascend_graph.paged_decode_live(q, cache.k, cache.v, decode.block_tables,
                                                        decode.context_lens, scale)

    def prefill(self, q, cache, prefill, scale):
        return paged_prefill(q, cache, prefill, scale)
