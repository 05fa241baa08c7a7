"""Collectives a captured step can hold: ``torch.distributed._functional_collectives`` over a
``Group``, each traced by ``torch.compile(fullgraph=True)`` as one ``_c10d_functional`` node (and
its ``wait_tensor``). Over a group of one rank each is the identity and adds nothing to the graph,
so single-process code paths are unchanged.

Inductor's C++ wrapper (``cpp_wrapper=True``) refuses all_gather, reduce_scatter and all_to_all
(``arg type Any is not yet supported by custom_op_wrapper``, torch 2.13); all_reduce compiles.
Graphs that hold the others need the Python wrapper.

Shape legend: N rows along the collective's dimension, W the group's size.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed._functional_collectives as funcol
from torch import Tensor

from .state import Group


def all_reduce(x: Tensor, group: Group, op: str = "sum") -> Tensor:
    """The elementwise ``op`` ("sum", "max", "min", ...) of ``x`` over the group's ranks; a sum
    through the group's own ``reduce`` where it has one (``x`` may then be consumed)."""
    if group.size == 1:
        return x
    if op == "sum" and group.reduce is not None:
        return group.reduce(x)
    return funcol.all_reduce(x, op, group.pg)


def all_gather(x: Tensor, group: Group, dim: int = 0) -> Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order: ``[N, ...]`` -> ``[W*N, ...]``."""
    if group.size == 1:
        return x
    return funcol.all_gather_tensor(x.contiguous(), dim, group.pg)


def reduce_scatter(x: Tensor, group: Group, dim: int = 0, op: str = "sum") -> Tensor:
    """The ``op`` over ranks of ``x``, of which this rank keeps its ``1/W`` slice along ``dim``:
    ``[W*N, ...]`` -> ``[N, ...]``."""
    if group.size == 1:
        return x
    if x.shape[dim] % group.size:
        raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} does not split into "
                         f"{group.size} ranks")
    return funcol.reduce_scatter_tensor(x.contiguous(), op, dim, group.pg)


def all_to_all(x: Tensor, group: Group, output_split_sizes: Optional[Sequence[int]] = None,
               input_split_sizes: Optional[Sequence[int]] = None) -> Tensor:
    """Rows of ``x`` (dim 0) sent to each rank by ``input_split_sizes`` (equal splits when None),
    rows received from each rank, in rank order, by ``output_split_sizes``. The sizes are Python
    ints: a captured step keeps them fixed (a capacity per destination)."""
    if group.size == 1:
        return x
    out_sizes = None if output_split_sizes is None else list(output_split_sizes)
    in_sizes = None if input_split_sizes is None else list(input_split_sizes)
    return funcol.all_to_all_single(x.contiguous(), out_sizes, in_sizes, group.pg)
