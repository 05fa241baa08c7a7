"""What the ``ascend_graph::*`` ops share: their argument checks (each error names the op, the
argument and what was expected, raised before anything runs) and their calls into the native
library (``build._library()``). The ops themselves: ``matmul`` (``rows_mm``, ``rows_bmm``),
``moe`` (``expert_rows_mm``), ``attention`` (``decode_attention``).

CPU, bfloat16 (``decode_attention`` float32 too); each op is called only where ``build.available()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import build


def check_bf16_cpu(name: str, x: Tensor, w: Tensor) -> None:
    """The ops take bfloat16 CPU tensors only (``x`` and the weight or cache ``w``): ValueError otherwise."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError(f"{name}: x and w must be bfloat16 CPU tensors, got {x.dtype}/{w.dtype} "
                         f"on {x.device}/{w.device}")


def check_shapes(name: str, ok: bool, expected: str, *tensors: Tensor) -> None:
    """ValueError ``"{name}: expected {expected}; got <the shapes>"`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}: expected {expected}; got {', '.join(str(tuple(t.shape)) for t in tensors)}")


def _status(name: str, status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{name}: the kernel could not run (out of memory for the {what})")


def _run(name: str, x: Tensor, w: Tensor, ends: int) -> Tensor:
    """``expert_rows`` (``csrc/moe.c``) on checked arguments: ``x [P, K]``, ``w [X, N, K]``,
    ``ends`` the address of X int32 row ends (kept alive by the caller) -> ``[P, N]``."""
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty(x.shape[0], w.shape[1], dtype=torch.bfloat16)
    status = build._library().expert_rows(x.data_ptr(), w.data_ptr(), ends, out.data_ptr(),
                                          w.shape[0], w.shape[1], w.shape[2], torch.get_num_threads())
    _status(name, status, "copied rows")
    return out


def _run_kn(x: Tensor, w: Tensor) -> Tensor:
    """``kn_rows`` (``csrc/matmul_kn.c``) on checked arguments ``x [X, M, K]``, ``w [X, K, N]``
    (rows of each entry contiguous; entries may lie apart) -> ``[X, M, N]``."""
    x = x.contiguous()
    if w.stride(2) != 1 or w.stride(1) != w.shape[2]:
        w = w.contiguous()
    experts, rows, k = x.shape
    n = w.shape[2]
    out = torch.empty(experts, rows, n, dtype=torch.bfloat16)
    status = build._library().kn_rows(x.data_ptr(), w.data_ptr(), w.stride(0), out.data_ptr(), experts, rows, k, n,
                                      torch.get_num_threads())
    _status("rows_bmm", status, "packed rows")
    return out

