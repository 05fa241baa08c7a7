"""The native kernel's ops, registered with ``torch.library`` as ``ascend_graph::*``.

CPU, bfloat16; each op is called only where ``build.available()`` (see ``build``).
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from .build import _library

def _check_bf16_cpu(name: str, x: Tensor, w: Tensor) -> None:
    """The kernel's ops take bfloat16 CPU tensors only."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError(f"{name}: x and w must be bfloat16 CPU tensors, got {x.dtype}/{w.dtype} on {x.device}/{w.device}")


@torch.library.custom_op("ascend_graph::expert_rows_mm", mutates_args=())
def expert_rows_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """``x [P, K]`` rows sorted by expert, ``w [X, N, K]`` the experts' weights, ``ends [X]``
    int32 the end of each expert's rows (``ends[-1] = P``) -> ``[P, N]``: each row times its
    expert's weight transposed, as ``torch._grouped_mm(x, w.transpose(1, 2), offs=ends)``.
    CPU, bfloat16; call only where ``available()``."""
    _check_bf16_cpu("expert_rows_mm", x, w)
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1] or ends.shape != (w.shape[0],):
        raise ValueError(f"expert_rows_mm: expected x [P, K], w [X, N, K], ends [X]; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(ends.shape)}")
    if x.shape[0] and int(ends[-1]) != x.shape[0]:
        raise ValueError(f"expert_rows_mm: ends[-1] must be the row count {x.shape[0]}, got {int(ends[-1])}")
    ends = ends.to(torch.int32).contiguous()
    return _run("expert_rows_mm", x, w, ends.data_ptr())


def _run(name: str, x: Tensor, w: Tensor, ends: int) -> Tensor:
    """The C kernel on checked arguments: ``x [P, K]``, ``w [X, N, K]``, ``ends`` the address of
    X int32 row ends (kept alive by the caller)."""
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty(x.shape[0], w.shape[1], dtype=torch.bfloat16)
    status = _library().expert_rows(x.data_ptr(), w.data_ptr(), ends, out.data_ptr(),
                                    w.shape[0], w.shape[1], w.shape[2], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"{name}: the kernel could not run (out of memory for the copied rows)")
    return out


@expert_rows_mm.register_fake
def _(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("ascend_graph::rows_mm", mutates_args=())
def rows_mm(x: Tensor, w: Tensor) -> Tensor:
    """``x [M, K] @ w[N, K].T -> [M, N]``, as ``F.linear(x, w)``: the same kernel with one
    "expert". CPU, bfloat16; call only where ``available()``. The compiled decode step's dense
    products of a few rows run it (``compile.inductor.DecodeMatmulPass``)."""
    _check_bf16_cpu("rows_mm", x, w)
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"rows_mm: expected x [M, K] and w [N, K]; got {tuple(x.shape)}, {tuple(w.shape)}")
    end = ctypes.c_int32(x.shape[0])  # one "expert": no tensor for its row end on every call
    return _run("rows_mm", x, w.unsqueeze(0), ctypes.addressof(end))


@rows_mm.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("ascend_graph::rows_bmm", mutates_args=())
def rows_bmm(x: Tensor, w: Tensor) -> Tensor:
    """``x [X, M, K] @ w [X, K, N] -> [X, M, N]``, as ``torch.bmm``, over matrices stored with
    the reduced dimension first (``w[e]`` row-major ``[K, N]``; the entries may lie apart, as
    per-head slices of one weight do): the kernel's ``[K, N]`` form
    (``expert_rows.c``, ``kn_rows``). CPU, bfloat16; call only where ``available()``. The
    compiled MLA decode step runs it for the attention's probabilities times the latent cache
    rows (``compile.inductor.DecodeMatmulPass``)."""
    _check_bf16_cpu("rows_bmm", x, w)
    if x.dim() != 3 or w.dim() != 3 or w.shape[0] != x.shape[0] or w.shape[1] != x.shape[2]:
        raise ValueError(f"rows_bmm: expected x [X, M, K] and w [X, K, N]; got {tuple(x.shape)}, {tuple(w.shape)}")
    return _run_kn(x, w)


def _run_kn(x: Tensor, w: Tensor) -> Tensor:
    """The kernel's ``[K, N]`` form on checked arguments ``x [X, M, K]``, ``w [X, K, N]``."""
    x = x.contiguous()
    if w.stride(2) != 1 or w.stride(1) != w.shape[2]:
        w = w.contiguous()
    experts, rows, k = x.shape
    n = w.shape[2]
    out = torch.empty(experts, rows, n, dtype=torch.bfloat16)
    status = _library().kn_rows(x.data_ptr(), w.data_ptr(), w.stride(0), out.data_ptr(), experts, rows, k, n,
                                torch.get_num_threads())
    if status != 0:
        raise RuntimeError("rows_bmm: the kernel could not run (out of memory for the packed rows)")
    return out


@rows_bmm.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], x.shape[1], w.shape[2])


@torch.library.custom_op("ascend_graph::paged_rows_mm", mutates_args=())
def paged_rows_mm(x: Tensor, cache: Tensor, block_tables: Tensor) -> Tensor:
    """``x [B, M, K]`` by each sequence's cached tokens, read in place through its block table:
    ``out[b, m, t] = x[b, m] . token t of sequence b``, ``[B, M, T]`` with ``T = W * S``. ``cache
    [NB, S, ..., K]`` holds S token rows of K per block (each block contiguous), ``block_tables
    [B, W]`` block ids; as ``bmm(x, gather_rows(cache, block_tables).view(B, T, K).transpose(1, 2))``
    without the gathered copy. Head by head: ``x [B, H, M, K]`` against a cache ``[NB, S, H, K]``
    (standard attention's keys, H kv heads) -> ``[B, H, M, T]``, ``out[b, h, m, t] = x[b, h, m] .
    head h of token t``. CPU, bfloat16; call only where ``available()``. The compiled MLA decode
    step runs it for its attention scores (``compile.inductor.DecodeMatmulPass``), standard
    attention's decode for its own (``attention.paged_decode``)."""
    _check_bf16_cpu("paged_rows_mm", x, cache)
    bs, heads, tables = _check_paged("paged_rows_mm", x, cache, block_tables)
    if x.shape[-1] != cache.shape[-1]:
        raise ValueError(f"paged_rows_mm: x [B, (H,) M, K] must end in the cache's row width {cache.shape[-1]}, "
                         f"got {tuple(x.shape)}")
    return _run_paged("paged_rows_mm", x, cache, tables, bs, heads, tables.shape[1] * bs)


@paged_rows_mm.register_fake
def _(x: Tensor, cache: Tensor, block_tables: Tensor) -> Tensor:
    rows = cache.shape[1] if x.dim() == 4 else _rows_per_block(cache)
    return x.new_empty(*x.shape[:-1], block_tables.shape[1] * rows)


@torch.library.custom_op("ascend_graph::paged_rows_bmm", mutates_args=())
def paged_rows_bmm(x: Tensor, cache: Tensor, block_tables: Tensor) -> Tensor:
    """``x [B, M, T]`` times each sequence's cached tokens ``[T, N]`` (``T = W * S``), read in place
    through its block table: as ``bmm(x, gather_rows(cache, block_tables).view(B, T, N))`` without
    the gathered copy (``cache``, ``block_tables`` as for ``paged_rows_mm``). Head by head: ``x [B,
    H, M, T]`` times head h's rows of a cache ``[NB, S, H, N]`` -> ``[B, H, M, N]``. CPU, bfloat16;
    call only where ``available()``. The compiled MLA decode step runs it for the attention's
    probabilities times the latent cache rows, standard attention's decode for its values."""
    _check_bf16_cpu("paged_rows_bmm", x, cache)
    bs, heads, tables = _check_paged("paged_rows_bmm", x, cache, block_tables)
    if x.shape[-1] != tables.shape[1] * bs:
        raise ValueError(f"paged_rows_bmm: x [B, (H,) M, T] needs T = {tables.shape[1]} blocks x {bs} rows = "
                         f"{tables.shape[1] * bs}, got {tuple(x.shape)}")
    return _run_paged("paged_rows_bmm", x, cache, tables, bs, heads, cache.shape[-1])


@paged_rows_bmm.register_fake
def _(x: Tensor, cache: Tensor, block_tables: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], cache.shape[-1])


def _rows_per_block(cache: Tensor) -> int:
    return math.prod(cache.shape[1:-1])


def _check_paged(name: str, x: Tensor, cache: Tensor, block_tables: Tensor) -> tuple[int, int, Tensor]:
    """Rows per block (per head), the heads read one by one (1 for ``x [B, M, *]``) and the table
    as contiguous int32, or ValueError naming what is off: the shapes, a block not laid out as
    its rows one after another, an id outside the cache."""
    by_head = x.dim() == 4 and cache.dim() == 4 and cache.shape[2] == x.shape[1]
    by_rows = x.dim() == 3 and cache.dim() >= 3
    if not (by_head or by_rows) or block_tables.dim() != 2 or block_tables.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: expected x [B, M, *] with cache [NB, S, ..., width], or x [B, H, M, *] with "
                         f"cache [NB, S, H, width], and block_tables [B, W]; got "
                         f"{tuple(x.shape)}, {tuple(cache.shape)}, {tuple(block_tables.shape)}")
    if block_tables.dtype not in (torch.int32, torch.int64) or block_tables.device.type != "cpu":
        raise ValueError(f"{name}: block_tables must be int32 or int64 on the CPU, got {block_tables.dtype} "
                         f"on {block_tables.device}")
    if not cache[:1].is_contiguous():
        raise ValueError(f"{name}: each cache block must hold its rows one after another (strides "
                         f"{tuple(cache.stride())} for shape {tuple(cache.shape)})")
    if block_tables.numel() and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < cache.shape[0]:
        raise ValueError(f"{name}: block_tables ids must lie in [0, {cache.shape[0]}), got "
                         f"{int(block_tables.min())}..{int(block_tables.max())}")
    tables = block_tables.to(torch.int32).contiguous()
    return (cache.shape[1], x.shape[1], tables) if by_head else (_rows_per_block(cache), 1, tables)


def _run_paged(name: str, x: Tensor, cache: Tensor, tables: Tensor, bs: int, heads: int, n: int) -> Tensor:
    """The kernel's paged forms on checked arguments; ``n`` the output's last dimension."""
    x = x.contiguous()
    rows = x.shape[-2]
    out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    kernel = _library().paged_rows if name == "paged_rows_mm" else _library().paged_kn
    if out.numel():
        status = kernel(x.data_ptr(), cache.data_ptr(), tables.data_ptr(), out.data_ptr(), x.shape[0] * heads,
                        tables.shape[1], bs, cache.stride(0), rows, cache.shape[-1], heads, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"{name}: the kernel could not run (out of memory for the packed rows)")
    return out
