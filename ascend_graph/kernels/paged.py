"""``ascend_graph::paged_rows_mm`` and ``ascend_graph::paged_rows_bmm``: attention's two decode
products over a paged KV cache, read through the block table, each block where it lies (no
gathered copy is made). The compiled MLA decode step runs them where the rows are the cache's
gathered rows (``compile.inductor.DecodeMatmulPass``); head by head (``x [B, Hk, M, *]`` over a
``[NB, S, Hk, D]`` cache) standard attention's decode runs them, eager and compiled
(``attention.paged.paged_decode``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import ops


@torch.library.custom_op("ascend_graph::paged_rows_mm", mutates_args=())
def paged_rows_mm(x: Tensor, cache: Tensor, block_tables: Tensor) -> Tensor:
    """``x [B, M, K]`` by each sequence's cached tokens, read in place through its block table:
    ``out[b, m, t] = x[b, m] . token t of sequence b``, ``[B, M, T]`` with ``T = W * S``. ``cache
    [NB, S, ..., K]`` holds S token rows of K per block (each block contiguous), ``block_tables
    [B, W]`` block ids; as ``bmm(x, gather_rows(cache, block_tables).view(B, T, K).transpose(1, 2))``
    without the gathered copy. Head by head: ``x [B, H, M, K]`` against a cache ``[NB, S, H, K]``
    (standard attention's keys, H kv heads) -> ``[B, H, M, T]``, ``out[b, h, m, t] = x[b, h, m] .
    head h of token t``. Each output the float32 sum rounded once to bf16. CPU, bfloat16; call
    only where ``available()``."""
    ops.check_bf16_cpu("paged_rows_mm", x, cache)
    bs, heads, tables = _check_paged("paged_rows_mm", x, cache, block_tables)
    if x.shape[-1] != cache.shape[-1]:
        raise ValueError(f"paged_rows_mm: x [B, (H,) M, K] must end in the cache's row width {cache.shape[-1]}, "
                         f"got {tuple(x.shape)}")
    return ops._run_paged("paged_rows_mm", x, cache, tables, bs, heads, tables.shape[1] * bs)


@paged_rows_mm.register_fake
def _(x: Tensor, cache: Tensor, block_tables: Tensor) -> Tensor:
    rows = cache.shape[1] if x.dim() == 4 else _rows_per_block(cache)
    return x.new_empty(*x.shape[:-1], block_tables.shape[1] * rows)


@torch.library.custom_op("ascend_graph::paged_rows_bmm", mutates_args=())
def paged_rows_bmm(x: Tensor, cache: Tensor, block_tables: Tensor) -> Tensor:
    """``x [B, M, T]`` times each sequence's cached tokens ``[T, N]`` (``T = W * S``), read in place
    through its block table: as ``bmm(x, gather_rows(cache, block_tables).view(B, T, N))`` without
    the gathered copy (``cache``, ``block_tables`` as for ``paged_rows_mm``). Head by head: ``x [B,
    H, M, T]`` times head h's rows of a cache ``[NB, S, H, N]`` -> ``[B, H, M, N]``. Each output
    the float32 sum rounded once to bf16. CPU, bfloat16; call only where ``available()``."""
    ops.check_bf16_cpu("paged_rows_bmm", x, cache)
    bs, heads, tables = _check_paged("paged_rows_bmm", x, cache, block_tables)
    if x.shape[-1] != tables.shape[1] * bs:
        raise ValueError(f"paged_rows_bmm: x [B, (H,) M, T] needs T = {tables.shape[1]} blocks x {bs} rows = "
                         f"{tables.shape[1] * bs}, got {tuple(x.shape)}")
    return ops._run_paged("paged_rows_bmm", x, cache, tables, bs, heads, cache.shape[-1])


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
    ops.check_shapes(name, (by_head or by_rows) and block_tables.dim() == 2 and block_tables.shape[0] == x.shape[0],
                     "x [B, M, *] with cache [NB, S, ..., width], or x [B, H, M, *] with cache [NB, S, H, width], "
                     "and block_tables [B, W]", x, cache, block_tables)
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
