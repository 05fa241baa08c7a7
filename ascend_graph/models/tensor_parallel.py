"""Tensor-parallel shares of a model's weights: which slice of a checkpoint tensor a rank keeps.

A column-parallel linear (q/k/v, gate/up) keeps a run of output rows of the checkpoint's
``[N, K]`` weight (dim 0); a row-parallel linear (o_proj, down_proj) keeps a run of input
columns (dim 1), and its output is a partial sum that an ``all_reduce`` over the TP group
completes. Every rank reads the full checkpoint tensor and keeps a view of its share, as vLLM's
loaders do; embedding, norms and head are replicated.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from ..distributed import Group, ParallelConfig, ParallelState, local_size


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


def share_kwargs(cls: type, state: ParallelState) -> dict:
    """The group arguments ``cls`` takes: ``tp`` always; ``dp``/``ep`` where it has them (expert parallel)."""
    params = inspect.signature(cls).parameters
    kwargs = {"tp": state.tp}
    for name in ("dp", "ep"):
        if name in params:
            kwargs[name] = getattr(state, name)
        elif getattr(state, name).size > 1 and name == "ep":
            raise ValueError(f"enable_expert_parallel: {cls.__name__} has no expert-parallel form")
    return kwargs


def empty_share(cls: type, config: Any, state: ParallelState, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """An uninitialised share of ``cls`` (no random weights drawn where the class can skip them)."""
    params = inspect.signature(cls).parameters
    kwargs = share_kwargs(cls, state)
    if "init_weights" in params:
        kwargs["init_weights"] = False
    if "dtype" in params and dtype is not None:
        kwargs["dtype"] = dtype
    return cls(config, **kwargs)


def check_split(cls: type, config: Any, parallel: ParallelConfig) -> None:
    """``ValueError`` when model ``cls`` of ``config`` cannot be split as ``parallel`` asks
    (heads, features, experts per rank), found by building rank 0's share on the meta device
    over rank-less groups (the Engine and the vLLM plugin call it before any rank starts)."""
    world = tuple(range(parallel.world_size))
    tp = Group(None, world[:parallel.tensor_parallel_size], 0)
    ep = Group(None, world, 0) if parallel.enable_expert_parallel else Group.single()
    dp = Group(None, world[::parallel.tensor_parallel_size], 0)
    with torch.device("meta"):
        empty_share(cls, config, ParallelState(config=parallel, tp=tp, dp=dp, ep=ep))
