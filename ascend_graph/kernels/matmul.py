"""``ascend_graph::rows_mm`` and ``ascend_graph::rows_bmm``: products of a few rows over weights
as they are stored, row-major ``[N, K]`` (bfloat16 or float32) and ``[K, N]`` (bfloat16). The compiled decode step runs
them (``compile.inductor.DecodeMatmulPass``; graph mode only, eager keeps aten's)."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from . import ops


@torch.library.custom_op("ascend_graph::rows_mm", mutates_args=())
def rows_mm(x: Tensor, w: Tensor) -> Tensor:
    """``x [M, K] @ w[N, K].T -> [M, N]``, as ``F.linear(x, w)``, each output a float32 sum (bf16:
    rounded once): ``expert_rows_mm``'s kernel with one "expert". CPU, bfloat16 or float32; call
    only where ``available()``. The compiled step runs it for the rows ``decode_matmul.runs_rows_mm``
    names."""
    ops.check_bf16_cpu("rows_mm", x, w, tuple(ops.ROWS_ENTRIES))
    ops.check_shapes("rows_mm", x.dim() == 2 and w.dim() == 2 and w.shape[1] == x.shape[1],
                     "x [M, K] and w [N, K]", x, w)
    end = ctypes.c_int32(x.shape[0])  # one "expert": no tensor for its row end on every call
    return ops._run("rows_mm", x, w.unsqueeze(0), ctypes.addressof(end))


@rows_mm.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("ascend_graph::rows_bmm", mutates_args=())
def rows_bmm(x: Tensor, w: Tensor) -> Tensor:
    """``x [X, M, K] @ w [X, K, N] -> [X, M, N]``, as ``torch.bmm``, over matrices stored with
    the reduced dimension first (``w[e]`` row-major ``[K, N]``; the entries may lie apart, as
    per-head slices of one weight do), each output the float32 sum rounded once to bf16. CPU,
    bfloat16; call only where ``available()``. The compiled MLA decode step runs it for the
    attention's probabilities times the latent cache rows."""
    ops.check_bf16_cpu("rows_bmm", x, w)
    ops.check_shapes("rows_bmm", x.dim() == 3 and w.dim() == 3 and w.shape[0] == x.shape[0]
                     and w.shape[1] == x.shape[2], "x [X, M, K] and w [X, K, N]", x, w)
    return ops._run_kn(x, w)


@rows_bmm.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], x.shape[1], w.shape[2])
