"""Tensor-parallel shares of a model's weights: which slice of a checkpoint tensor a rank keeps.

A column-parallel linear (q/k/v, gate/up) keeps a run of output rows of the checkpoint's
``[N, K]`` weight (dim 0); a row-parallel linear (o_proj, down_proj) keeps a run of input
columns (dim 1), and its output is a partial sum that an ``all_reduce`` over the TP group
completes. Every rank reads the full checkpoint tensor and keeps a view of its share, as vLLM's
loaders do; embedding, norms and head are replicated.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from torch import Tensor

from ..distributed import Group, local_size


def tp_slice(tensor: Tensor, dim: Optional[int], group: Group, what: str) -> Tensor:
    """This rank's share of a checkpoint tensor along ``dim`` (a view); ``dim`` None: the whole
    tensor (replicated)."""
    if dim is None or group.size == 1:
        return tensor
    (index,) = shard_index(tensor.shape, dim, group, what)
    return tensor[index]


def shard_index(shape: Sequence[int], dim: Optional[int], group: Group, what: str,
                parts: int = 1) -> list[tuple[slice, ...]]:
    """Index tuples of this rank's share of a tensor of ``shape`` split along ``dim``: one, or with
    ``parts`` > 1 (a stacked gate/up) one per equal part, each part split on its own; read and
    concatenated along ``dim`` they are the share (``dim`` None: the whole tensor)."""
    if dim is None or group.size == 1:
        return [(slice(None),)]
    part = shape[dim] // parts
    n = local_size(part, group, what)
    lead = (slice(None),) * dim
    return [lead + (slice(p * part + group.rank * n, p * part + (group.rank + 1) * n),) for p in range(parts)]


def split_dim(name: str, rules: Mapping[str, int]) -> Optional[int]:
    """The dim along which tensor ``name`` is split: that of the first rule whose module name is
    one of its dotted parts followed by ``weight`` (None: replicated)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-1] == "weight":
        return rules.get(parts[-2])
    return None
