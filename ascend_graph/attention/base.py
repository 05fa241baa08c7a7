"""The attention backend interface: one implementation computes one kind of attention over the
tuple caches, the same way in eager and in graph mode.

Shape legend: T tokens in the step, B decode rows, H heads (Hq query, Hk kv), Dn qk_nope_head_dim,
R qk_rope_head_dim, Dv v_head_dim, C kv_lora_rank, D head size, sum Q a prefill's new tokens.

A backend is chosen once, when the model is built (``backend.select_attention_backend``), and
the model calls it in every step. Contracts every implementation keeps:
- ``write`` stores the step's new entries through ``kv_cache.write_slots`` (the one cache write,
  which sends padding slots to the null block and declares its mutation), before ``decode``/``prefill``.
- ``decode`` reads each row's blocks through its block table, masked to ``context_lens``; padded
  rows (null block, context 0) give finite values that the runner drops. An implementation with
  ``reads_live_only`` reads only the first ``context_lens`` tokens of each row, so its cost follows
  the live context whatever the table's width; the others read the full width, masked.
- ``prefill`` reads each sequence's whole context (earlier tokens and the new ones).
- No host sync in ``decode`` (it runs inside captured graphs). A backend with
  ``host_context_lens`` reads the lengths as host ints (``DecodeMetadata.context_lens_host``,
  which the runner then fills), as the NPU's fused attention takes them.
- ``block_size_ok``: the cache block sizes its kernels take; ``default_block_size`` the one an
  engine uses when none is given.
- MLA: ``rope_query`` and ``write_latent`` own the rope and the latent write, so a backend whose
  fused write also norms and rotates (the NPU's) keeps ``q_pe`` and the cached ``k_pe`` in the
  same layout. ``write_latent`` returns the cache the layer then reads: a fused write whose
  operator returns the caches it wrote (torch_npu's, which declares no mutation) must be read
  through what it returns, or a graph compiler drops it. The tensors returned ARE the caches
  (the same memory); the runner's static cache objects never change.
- ``refuses(shape)``: why an implementation cannot take a layer of these dimensions (None: it
  can); selection skips a backend that refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch
from torch import Tensor

from ..kv_cache import KVCache, MLACache, write_slots
from ..layers import apply_rope
from .metadata import DecodeMetadata, PrefillMetadata
from .mla import mla_prefill
from .paged import paged_prefill


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's dimensions, for backends whose kernels take only some.
    ``head_dim``: the query's head size (MLA: ``qk_nope_head_dim + qk_rope_head_dim``); MLA
    layers also give ``kv_lora_rank``, ``qk_rope_head_dim`` and ``v_head_dim`` (0 elsewhere)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


class AttentionBackend:
    """Common part of the attention backends: the name, the kind of cache, the cache write."""

    name: ClassVar[str]
    kind: ClassVar[str]  # "mla" over MLACache(kv_c, k_pe), "paged" over KVCache(k, v)
    reads_live_only: ClassVar[bool] = False  # decode reads each row's live blocks only
    host_context_lens: ClassVar[bool] = False  # decode reads DecodeMetadata.context_lens_host
    default_block_size: ClassVar[int] = 16
    # Which implementations store the same bytes for the same step: the PD handshake refuses peers
    # whose families differ ("torch": write_slots in the model's layout; "npu": torch_npu's fused ops).
    cache_family: ClassVar[str] = "torch"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this implementation runs for caches of ``dtype`` on ``device``."""
        raise NotImplementedError

    @classmethod
    def refuses(cls, shape: Optional[AttentionShape]) -> Optional[str]:
        """Why this implementation cannot take a layer of ``shape`` (None: it can, or no shape given)."""
        return None

    @classmethod
    def block_size_ok(cls, block_size: int) -> bool:
        """Whether this implementation reads caches of ``block_size`` tokens per block."""
        return block_size >= 1

    def fallbacks(self) -> dict[str, int]:
        """Calls this backend handed to a slower form than its own, by reason (none by default)."""
        return {}

    def write(self, cache: MLACache | KVCache, first: Tensor, second: Tensor, slot_mapping: Tensor) -> None:
        """Write ``[T, 1 or Hk, width]`` new entries of both cache elements at ``slot_mapping [T]``."""
        write_slots(cache[0], cache[1], first, second, slot_mapping)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class MLABackend(AttentionBackend):
    """Multi-head latent attention over ``MLACache(kv_c, k_pe)``; ``w_uk [H, Dn, C]`` and
    ``w_uv [H, Dv, C]`` are the two parts of ``kv_b_proj`` (any strides)."""

    kind = "mla"

    def cached_rope_layout(self, interleaved: bool) -> str:
        """How ``k_pe`` lies in the cache for a checkpoint whose rope is ``interleaved``:
        ``"interleaved"`` (pairs side by side), ``"half"`` (a rotate-half checkpoint, as it is)
        or ``"deinterleaved"`` (an interleaved checkpoint's pairs split into halves)."""
        return "interleaved" if interleaved else "half"

    def rope_query(self, q_pe: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
        """``q_pe [T, H, R]`` rotated by ``cos``/``sin [T, R/2]``, in the layout ``write_latent``
        stores ``k_pe`` in (``interleaved``: the checkpoint's rope layout)."""
        return apply_rope(q_pe, cos, sin, interleaved)

    def write_latent(self, cache: MLACache, kv_c: Tensor, k_pe: Tensor, norm: Callable[[Tensor], Tensor],
                     cos: Tensor, sin: Tensor, slot_mapping: Tensor, interleaved: bool) -> MLACache:
        """Write ``norm(kv_c [T, C])`` and ``k_pe [T, R]`` rotated (as ``rope_query``) at
        ``slot_mapping [T]``; ``norm`` is the layer's ``kv_a_layernorm``. Returns the cache to
        read from then on (here ``cache`` itself; the same tensors in every implementation)."""
        self.write(cache, norm(kv_c)[:, None, :], apply_rope(k_pe[:, None, :], cos, sin, interleaved), slot_mapping)
        return cache

    def decode(self, q_nope: Tensor, q_pe: Tensor, cache: MLACache, decode: DecodeMetadata,
               w_uk: Tensor, w_uv: Tensor, scale: float) -> Tensor:
        """Absorbed decode: ``[B, H, Dn]``, ``[B, H, R]`` -> ``[B, H, Dv]``."""
        raise NotImplementedError

    def prefill(self, q_nope: Tensor, q_pe: Tensor, cache: MLACache, prefill: PrefillMetadata,
                w_uk: Tensor, w_uv: Tensor, scale: float) -> Tensor:
        """``[sum Q, H, Dn]``, ``[sum Q, H, R]`` -> ``[sum Q, H, Dv]``."""
        raise NotImplementedError


class PagedBackend(AttentionBackend):
    """Standard (MHA / GQA) attention over ``KVCache(k, v)``."""

    kind = "paged"

    def decode(self, q: Tensor, cache: KVCache, decode: DecodeMetadata, scale: float) -> Tensor:
        """``[B, Hq, D]`` -> ``[B, Hq, D]``."""
        raise NotImplementedError

    def prefill(self, q: Tensor, cache: KVCache, prefill: PrefillMetadata, scale: float) -> Tensor:
        """``[sum Q, Hq, D]`` -> ``[sum Q, Hq, D]``."""
        raise NotImplementedError


class LiveOpMLA(MLABackend):
    """MLA decode through an op with ``kernels.attention.decode_attention``'s contract (named by
    ``op``, under ``torch.ops.ascend_graph``): the latent query against ``kv_c`` and ``k_pe`` (read
    apart), the same ``kv_c`` rows giving the latent output; each row's live blocks only."""

    op: ClassVar[str]
    reads_live_only = True

    @property
    def _op(self):
        return getattr(torch.ops.ascend_graph, self.op)

    def decode(self, q_nope: Tensor, q_pe: Tensor, cache: MLACache, decode: DecodeMetadata,
               w_uk: Tensor, w_uv: Tensor, scale: float) -> Tensor:
        dtype = cache.kv_c.dtype
        q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk).to(dtype)  # [B, H, C]
        o_lat = self._op(q_lat, q_pe.to(dtype), cache.kv_c, cache.k_pe, cache.kv_c, decode.block_tables,
                         decode.context_lens, scale)  # [B, H, C]
        return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)

    def prefill(self, q_nope, q_pe, cache, prefill, w_uk, w_uv, scale):
        return mla_prefill(q_nope, q_pe, cache, prefill, w_uk, w_uv, scale)  # the reference form: live blocks only


class LiveOpPaged(PagedBackend):
    """Standard attention's decode through an op with ``decode_attention``'s contract (``op``), the
    query heads of each kv head together; each row's live blocks only."""

    op: ClassVar[str]
    reads_live_only = True

    @property
    def _op(self):
        return getattr(torch.ops.ascend_graph, self.op)

    def decode(self, q: Tensor, cache: KVCache, decode: DecodeMetadata, scale: float) -> Tensor:
        return self._op(q.to(cache.k.dtype), None, cache.k, None, cache.v, decode.block_tables,
                        decode.context_lens, scale)

    def prefill(self, q, cache, prefill, scale):
        return paged_prefill(q, cache, prefill, scale)
