"""``ascend_graph::decode_attention`` (schema: ``kernels/ops.py``; CPU kernel: ``csrc/ops.cpp``
over ``csrc/decode_attention.c``): decode attention over a paged cache that reads each row's live
tokens only (``context_lens``, a bound read when the op runs), in one pass per block: scores,
online softmax, values. Its output shape depends only on its arguments' shapes, so a captured
graph keeps it as one call over the full-width block table and the step still costs what the
live context costs. Here: its contract, and the argument checks the ops of its contract on other
devices share (``triton_attention``; the CPU kernel makes the same checks in C++).

``out[b, h] = sum_t softmax_t(scale * (q[b, h] . k_t + q_rope[b, h] . r_t)) * v_t`` over the
first ``context_lens[b]`` tokens of row b (token t in block ``block_tables[b, t // S]``, row ``t %
S``, kv head ``h // (Hq / Hk)``) -> ``[B, Hq, Dv]`` in q's dtype. A row of context 0 reads nothing
and gives zeros. Float32 sums and softmax, a bfloat16 output rounded once. CPU, float32 or
bfloat16 throughout.

Shape legend: B rows, Hq query heads, Hk kv heads (Hq a multiple), N blocks, S block size, W
block-table width, Dk / Dv key / value width, R MLA's rope width.

MLA (absorbed) passes ``q = q_latent [B, H, C]``, ``q_rope = q_pe [B, H, R]``, ``k_cache =
v_cache = kv_c [N, S, 1, C]``, ``rope_cache = k_pe [N, S, 1, R]``; standard attention passes ``q
[B, Hq, D]``, ``k [N, S, Hk, D]``, ``v [N, S, Hk, D]`` and no rope.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import ops


def check_layout(name: str, q: Tensor, q_rope: Optional[Tensor], k: Tensor, r: Optional[Tensor], v: Tensor,
                 block_tables: Tensor, context_lens: Tensor) -> tuple[int, int]:
    """The decode ops' shape, stride and index-dtype checks (any device): ``(Hk, Hq / Hk)``, or
    ValueError naming the argument that is off."""
    ok = (q.dim() == 3 and k.dim() == 4 and v.dim() == 4 and k.shape[:3] == v.shape[:3]
          and q.shape[-1] == k.shape[-1] and k.shape[2] >= 1 and q.shape[1] % k.shape[2] == 0)
    ops.check_shapes(name, ok, "q [B, Hq, Dk], k_cache [N, S, Hk, Dk] and v_cache [N, S, Hk, Dv], Hq a multiple "
                     "of Hk", q, k, v)
    if (q_rope is None) != (r is None):
        raise ValueError(f"{name}: q_rope and rope_cache go together; got q_rope "
                         f"{'None' if q_rope is None else tuple(q_rope.shape)}, rope_cache "
                         f"{'None' if r is None else tuple(r.shape)}")
    if r is not None:
        ops.check_shapes(name, q_rope.dim() == 3 and q_rope.shape[:2] == q.shape[:2] and r.dim() == 4
                         and r.shape[:3] == k.shape[:3] and q_rope.shape[-1] == r.shape[-1],
                         "q_rope [B, Hq, R] and rope_cache [N, S, Hk, R]", q_rope, r)
    for arg, t in (("k_cache", k), ("rope_cache", r), ("v_cache", v)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name}: {arg}'s last dimension must be contiguous, got strides {tuple(t.stride())}")
    ops.check_shapes(name, block_tables.dim() == 2 and block_tables.shape[0] == q.shape[0]
                     and context_lens.shape == (q.shape[0],), "block_tables [B, W] and context_lens [B]",
                     q, block_tables, context_lens)
    for arg, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: {arg} must be int32 or int64, got {t.dtype}")
    return k.shape[2], q.shape[1] // k.shape[2]


def check_values(name: str, k: Tensor, block_tables: Tensor, context_lens: Tensor) -> None:
    """The decode ops' range checks (read on the host: CPU tensors), ValueError naming the argument."""
    slots = block_tables.shape[1] * k.shape[1]
    if context_lens.numel() and not 0 <= int(context_lens.min()) <= int(context_lens.max()) <= slots:
        raise ValueError(f"{name}: context_lens must lie in [0, {slots}] (block_tables' {block_tables.shape[1]} "
                         f"blocks of {k.shape[1]}), got {int(context_lens.min())}..{int(context_lens.max())}")
    if block_tables.numel() and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < k.shape[0]:
        raise ValueError(f"{name}: block_tables ids must lie in [0, {k.shape[0]}), got "
                         f"{int(block_tables.min())}..{int(block_tables.max())}")
