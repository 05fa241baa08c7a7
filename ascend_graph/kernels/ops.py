"""What the ``ascend_graph::*`` ops share: their argument checks (each error names the op, the
argument and what was expected, raised before anything runs) and their calls into the native
library (``build._library()``). The ops themselves: ``matmul`` (``rows_mm``, ``rows_bmm``),
``moe`` (``expert_rows_mm``), ``attention`` (``decode_attention``).

CPU; ``expert_rows_mm``, ``rows_mm`` and ``decode_attention`` bfloat16 or float32, ``rows_bmm``
bfloat16; each op is called only where ``build.available()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import build


# The element types of the row-major forms' entries (``_run``): bfloat16 and float32.
ROWS_ENTRIES = {torch.bfloat16: "expert_rows", torch.float32: "expert_rows_f32"}


def check_bf16_cpu(name: str, x: Tensor, w: Tensor, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> None:
    """``x`` and the weight or cache ``w`` must be CPU tensors of one dtype among ``dtypes``
    (default bfloat16 only): ValueError otherwise."""
    if x.dtype not in dtypes or w.dtype != x.dtype or x.device.type != "cpu" or w.device.type != "cpu":
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: x and w must be {names} CPU tensors of one dtype, got {x.dtype}/{w.dtype} "
                         f"on {x.device}/{w.device}")


def check_shapes(name: str, ok: bool, expected: str, *tensors: Tensor) -> None:
    """ValueError ``"{name}: expected {expected}; got <the shapes>"`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}: expected {expected}; got {', '.join(str(tuple(t.shape)) for t in tensors)}")


def _status(name: str, status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{name}: the kernel could not run (out of memory for the {what})")


def _run(name: str, x: Tensor, w: Tensor, ends: int) -> Tensor:
    """``expert_rows`` (``csrc/moe.c``; ``expert_rows_f32`` for float32) on checked arguments:
    ``x [P, K]``, ``w [X, N, K]``, ``ends`` the address of X int32 row ends (kept alive by the
    caller) -> ``[P, N]`` in their dtype."""
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype)
    entry = getattr(build._library(), ROWS_ENTRIES[x.dtype])
    status = entry(x.data_ptr(), w.data_ptr(), ends, out.data_ptr(), w.shape[0], w.shape[1], w.shape[2],
                   torch.get_num_threads())
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

