"""What torch_npu's fused operators take, per release, as their documentation states it
(op-plugin's ``docs/context/torch_npu-*.md`` at tags 7.1.0, 7.2.0, 7.3.0; docs/npu.md lists
the sources). The npu attention backends choose from these; nothing here imports torch_npu.

The release is read from the operators' own declarations (``installed_release``), not from
``torch_npu.__version__`` (which follows torch's version): the MLA cache write's
``npu_kv_rmsnorm_rope_cache_v2`` first appears in 7.2.0, its ``v`` argument in 7.3.0.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .base import AttentionShape

Release = tuple[int, int]
OPS_NAMESPACE = "npu"  # torch.ops.<namespace> holds torch_npu's operators
WRITE_V1, WRITE_V2 = "npu_kv_rmsnorm_rope_cache", "npu_kv_rmsnorm_rope_cache_v2"
FUSED_WRITE_DIMS = (512, 64)  # (C, R): rms_size and rope_size npu_kv_rmsnorm_rope_cache takes
MLA_DECODE_HEADS = {(7, 1): (32, 64, 128), (7, 2): (32, 64, 128), (7, 3): (1, 2, 4, 8, 16, 32, 64, 128)}
TND_MAX_SEQUENCES = 4096


def installed_release() -> Release:
    """The torch_npu release whose documented limits apply: (7, 3) where the MLA write declares
    ``v``, (7, 2) where ``npu_kv_rmsnorm_rope_cache_v2`` exists, else (7, 1) (the strictest)."""
    ops = getattr(torch.ops, OPS_NAMESPACE)
    try:
        v1 = getattr(ops, WRITE_V1).default._schema
    except (AttributeError, RuntimeError):
        return (7, 1)
    if any(a.name == "v" for a in v1.arguments):
        return (7, 3)
    return (7, 2) if has_op(WRITE_V2) else (7, 1)


def has_op(name: str) -> bool:
    """Whether the installed torch_npu registers the operator ``name``."""
    try:
        getattr(getattr(torch.ops, OPS_NAMESPACE), name).default
    except (AttributeError, RuntimeError):
        return False
    return True


def mla_decode_refusal(shape: Optional[AttentionShape], release: Release) -> Optional[str]:
    """Why ``npu_fused_infer_attention_score`` with ``query_rope`` (paged, one query token) cannot
    take an MLA layer of ``shape``: latent 512, rope 64, one kv head, query heads by release."""
    if shape is None:
        return None
    heads = MLA_DECODE_HEADS[min(release, (7, 3))]
    if (shape.kv_lora_rank, shape.qk_rope_head_dim) != FUSED_WRITE_DIMS:
        return (f"the fused attention takes kv_lora_rank 512 and qk_rope_head_dim 64 with query_rope, "
                f"this layer has {shape.kv_lora_rank} and {shape.qk_rope_head_dim}")
    if shape.num_heads not in heads:
        return (f"the fused attention with query_rope takes {heads} query heads on torch_npu "
                f"{release[0]}.{release[1]}, this layer has {shape.num_heads}")
    return None


def gqa_decode_refusal(shape: Optional[AttentionShape]) -> Optional[str]:
    """Why the fused attention (``BSH``, paged, one query token) cannot take a layer of ``shape``:
    heads <= 256, head size <= 512, query heads a multiple of kv heads at most 64 times, and
    kv heads x head size under 64K (the ``[N, S, Hk * D]`` cache view)."""
    if shape is None:
        return None
    hq, hk, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    if hq > 256 or d > 512:
        return f"the fused attention takes at most 256 heads of size <= 512, this layer has {hq} of {d}"
    if hq % hk or hq // hk > 64:
        return f"the fused attention takes query heads a multiple (<= 64x) of kv heads, this layer has {hq}/{hk}"
    if hk * d >= 65536:
        return f"the fused attention's [N, S, H] cache view takes kv heads x head size < 65536, got {hk * d}"
    return None


class TndPlan(NamedTuple):
    """How a prefill goes through the fused attention's ``TND`` layout: the dtype it runs in
    and the value head size it is handed (the value padded up to the query's, or as it is)."""

    dtype: torch.dtype
    v_width: int


def tnd_plan(release: Release, q_d: int, v_d: int, hq: int, hk: int,
             dtype: torch.dtype) -> tuple[Optional[TndPlan], str]:
    """``(plan, "")`` where the ``TND`` layout (no rope, ``sparse_mode=3``) takes a prefill with
    query/key head size ``q_d``, value ``v_d``, ``hq``/``hk`` heads in ``dtype``, else
    ``(None, why)``. Documented: query/key 192 with value 128 or 192 (all releases), or all
    128 (7.2 on); bfloat16 only on 7.1/7.2 (float16 is cast, as vllm-ascend does); on 7.1 equal
    query and kv heads, a power of two from 2 to 128."""
    widths = [w for w in (v_d, q_d) if w >= v_d and _tnd_dims_ok(release, q_d, w)]
    if not widths:
        return None, (f"TND takes query head size 192 (value 128/192){' or all 128' if release >= (7, 2) else ''} "
                      f"on torch_npu {release[0]}.{release[1]}, this layer has {q_d} (value {v_d})")
    if release < (7, 2) and (hq != hk or hq not in (2, 4, 8, 16, 32, 64, 128)):
        return None, f"TND on torch_npu 7.1 takes equal query and kv heads (2 to 128), this layer has {hq}/{hk}"
    if hq % hk or hq > 256:
        return None, f"TND takes query heads a multiple of kv heads (<= 256), this layer has {hq}/{hk}"
    return TndPlan(torch.bfloat16 if release < (7, 3) else dtype, widths[0]), ""


def _tnd_dims_ok(release: Release, q_d: int, v_d: int) -> bool:
    return (q_d == 192 and v_d in (128, 192)) or (release >= (7, 2) and q_d == v_d == 128)


def tnd_lengths_refusal(release: Release, query_lens, context_lens) -> Optional[str]:
    """Why one prefill's lengths cannot go through ``TND`` with ``sparse_mode=3``: at most 4096
    sequences; on 7.1/7.2 each sequence's query length below its kv length, as written there
    (a prefill with no cached context has them equal)."""
    if len(query_lens) > TND_MAX_SEQUENCES:
        return f"TND takes at most {TND_MAX_SEQUENCES} sequences, got {len(query_lens)}"
    if release < (7, 3) and any(q >= k for q, k in zip(query_lens, context_lens)):
        return "TND with sparse_mode=3 on torch_npu 7.1/7.2 takes query lengths below kv lengths"
    return None
