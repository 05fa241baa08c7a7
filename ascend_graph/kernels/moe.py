"""``ascend_graph::expert_rows_mm``: the routed experts' rows, each times its expert's weight as the
checkpoint stores it. Both the eager runner and the compiled step call it for the MoE
(``RoutedExperts.sorted_by_expert``), so the two modes compute the MoE the same way; the compiled
MLA decode step also runs it with one "expert" per sequence or head."""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops


@torch.library.custom_op("ascend_graph::expert_rows_mm", mutates_args=())
def expert_rows_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """``x [P, K]`` rows sorted by expert, ``w [X, N, K]`` the experts' weights, ``ends [X]``
    int32 the end of each expert's rows (``ends[-1] = P``) -> ``[P, N]``: each row times its
    expert's weight transposed, as ``torch._grouped_mm(x, w.transpose(1, 2), offs=ends)``, each
    output a float32 sum (bf16: rounded once). CPU, bfloat16 or float32; call only where
    ``available()``."""
    ops.check_bf16_cpu("expert_rows_mm", x, w, tuple(ops.ROWS_ENTRIES))
    ops.check_shapes("expert_rows_mm", x.dim() == 2 and w.dim() == 3 and w.shape[2] == x.shape[1]
                     and ends.shape == (w.shape[0],), "x [P, K], w [X, N, K], ends [X]", x, w, ends)
    if x.shape[0] and int(ends[-1]) != x.shape[0]:
        raise ValueError(f"expert_rows_mm: ends[-1] must be the row count {x.shape[0]}, got {int(ends[-1])}")
    ends = ends.to(torch.int32).contiguous()
    return ops._run("expert_rows_mm", x, w, ends.data_ptr())


@expert_rows_mm.register_fake
def _(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[1])
