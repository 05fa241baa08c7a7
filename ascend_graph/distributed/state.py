"""The process groups of one process: world, tensor-parallel, data-parallel, expert-parallel, and a
gloo group for the host-side agreement (``agreement.py``).

``init_parallel`` forms them over ``torch.distributed`` (gloo on CPU, NCCL on CUDA, HCCL on an
NPU, chosen by the device), ``get_parallel_state`` returns them, ``destroy_parallel`` ends them.
Before ``init_parallel`` (or after ``destroy_parallel``) the state is one process: every size 1,
no groups, and every collective of ``collectives.py`` is the identity.

The state is held for the process, because ``torch.distributed`` holds its groups for the process
too (its default group, its group registry): one private holder mirrors them, nothing else here
is mutable. Every wait has a deadline: ``timeout_s`` is given to ``init_process_group`` and to
every ``new_group``, so a rank that never arrives makes the others raise instead of hanging.

Listeners are torch's (torch 2.13, measured): a ``tcp://`` rendezvous's TCPStore listens on every
interface of rank 0, whatever host ``init_method`` names (``file://`` has no listener, for ranks
on one host); gloo's sockets bind the interface ``GLOO_SOCKET_IFNAME`` names (``lo``: 127.0.0.1),
else the host name's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .config import ParallelConfig

DEFAULT_TIMEOUT_S = 300.0
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class Group:
    """One process group as the collectives see it: ``pg`` is None when ``size`` is 1.

    ``reduce``, where set, is the group owner's own sum all-reduce (vLLM's
    ``GroupCoordinator.all_reduce``: its shared-memory path where it has one); it may consume its
    input, and ``collectives.all_reduce`` calls it instead of torch's functional all-reduce.
    """

    pg: Optional[dist.ProcessGroup]
    ranks: tuple[int, ...]
    rank: int  # this process's index within ``ranks``
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def single(cls, global_rank: int = 0) -> "Group":
        """The group of this process alone (no process group: collectives are the identity)."""
        return cls(None, (global_rank,), 0)


def local_size(total: int, group: Group, what: str) -> int:
    """This rank's share of ``total`` (heads, features); ``ValueError`` naming ``what`` if the
    group's ranks cannot share it evenly."""
    if total % group.size:
        raise ValueError(f"{what}={total} does not split across tensor_parallel_size={group.size} ranks")
    return total // group.size


@dataclass(frozen=True)
class ParallelState:
    """This process's rank and groups; ``ParallelState()`` is the single-process state."""

    config: ParallelConfig = ParallelConfig()
    rank: int = 0
    device: torch.device = torch.device("cpu")
    timeout_s: float = DEFAULT_TIMEOUT_S
    world: Group = field(default_factory=Group.single)
    tp: Group = field(default_factory=Group.single)
    dp: Group = field(default_factory=Group.single)
    ep: Group = field(default_factory=Group.single)
    host: Group = field(default_factory=Group.single)  # gloo, for agreement on the host
    # Who formed the groups and which collective a step's all-reduce runs: part of the AOT key.
    collectives: str = "torch.distributed"

    @property
    def world_size(self) -> int:
        return self.world.size


class _Holder:
    """The process's state (see the module docstring for why it is held per process); ``owned``:
    whether ``init_parallel`` formed its groups (else ``adopt_parallel`` took someone else's)."""

    state: Optional[ParallelState] = None
    owned: bool = False


def get_parallel_state() -> ParallelState:
    """The state ``init_parallel`` formed, or the single-process state when none was formed."""
    return _Holder.state or ParallelState()


def backend_for(device: torch.device) -> str:
    """The collective backend of a device type: gloo (CPU), nccl (CUDA), hccl (NPU)."""
    if device.type not in BACKENDS:
        raise ValueError(f"device: no collective backend for device type {device.type!r} "
                         f"(known: {', '.join(BACKENDS)})")
    return BACKENDS[device.type]


def init_parallel(config: ParallelConfig, *, rank: Optional[int] = None, world_size: Optional[int] = None,
                  init_method: Optional[str] = None, device: torch.device | str = "cpu",
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelState:
    """Form this process's groups (every rank calls it, with the same config); returns the state.

    ``rank`` and ``world_size`` default to the environment's ``RANK`` / ``WORLD_SIZE`` (torchrun's);
    ``init_method`` to ``tcp://$MASTER_ADDR:$MASTER_PORT`` (``MASTER_ADDR`` 127.0.0.1 when unset).
    ``world_size`` must be ``config.world_size``. Raises ``RuntimeError`` if groups already exist.
    """
    if _Holder.state is not None or dist.is_initialized():
        raise RuntimeError("init_parallel: torch.distributed is already initialized; "
                           "call destroy_parallel() first")
    rank, world_size = _rank_and_size(rank, world_size, config)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    init_method = _init_method(init_method)
    device = torch.device(device)
    backend = backend_for(device)
    if device.type == "npu":
        import torch_npu  # noqa: F401  (registers the hccl backend)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timeout)
    try:
        _Holder.state, _Holder.owned = _form_groups(config, rank, device, timeout_s, backend), True
    except BaseException:
        dist.destroy_process_group()  # no half-formed state: init_parallel may be called again
        raise
    return _Holder.state


def adopt_parallel(state: ParallelState) -> ParallelState:
    """Make ``state``, whose groups another owner formed (vLLM's workers: ``vllm/parallel.py``),
    this process's state; ``destroy_parallel`` then forgets it and leaves the groups to their owner.
    Raises ``RuntimeError`` if ``init_parallel`` formed groups here."""
    if _Holder.owned:
        raise RuntimeError("adopt_parallel: this process formed its own groups (init_parallel); "
                           "call destroy_parallel() first")
    _Holder.state, _Holder.owned = state, False
    return state


def _form_groups(config: ParallelConfig, rank: int, device: torch.device, timeout_s: float,
                 backend: str) -> ParallelState:
    partitions, timeout = group_ranks(config), timedelta(seconds=timeout_s)
    return ParallelState(
        config=config, rank=rank, device=device, timeout_s=timeout_s,
        world=Group(dist.group.WORLD if config.world_size > 1 else None, partitions["host"][0], rank),
        tp=_member_group(partitions["tp"], rank, backend, timeout),
        dp=_member_group(partitions["dp"], rank, backend, timeout),
        ep=_member_group(partitions["ep"], rank, backend, timeout),
        host=_member_group(partitions["host"], rank, "gloo", timeout))


def destroy_parallel() -> None:
    """End every group this process formed (a no-op when there are none); an adopted state is
    only forgotten: its groups stay their owner's."""
    owned, _Holder.state, _Holder.owned = _Holder.owned, None, False
    if owned and dist.is_initialized():
        dist.destroy_process_group()


def group_ranks(config: ParallelConfig) -> dict[str, list[tuple[int, ...]]]:
    """Every group of each kind, as global ranks: TP groups are runs of consecutive ranks, DP
    groups take the same TP rank of each run, EP spans every rank when enabled (else each rank
    alone), and the host group is every rank."""
    tp, world = config.tensor_parallel_size, config.world_size
    everyone = tuple(range(world))
    return {"tp": [tuple(range(i, i + tp)) for i in range(0, world, tp)],
            "dp": [tuple(range(j, world, tp)) for j in range(tp)],
            "ep": [everyone] if config.enable_expert_parallel else [(r,) for r in everyone],
            "host": [everyone]}


def _rank_and_size(rank: Optional[int], world_size: Optional[int], config: ParallelConfig) -> tuple[int, int]:
    rank = int(os.environ["RANK"]) if rank is None and "RANK" in os.environ else rank
    if world_size is None and "WORLD_SIZE" in os.environ:
        world_size = int(os.environ["WORLD_SIZE"])
    world_size = config.world_size if world_size is None else world_size
    if world_size != config.world_size:
        raise ValueError(f"world_size={world_size} is not tensor_parallel_size * data_parallel_size "
                         f"= {config.world_size}")
    if rank is None or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}) (argument or RANK), got {rank!r}")
    return rank, world_size


def _init_method(init_method: Optional[str]) -> str:
    if init_method is not None:
        return init_method
    if "MASTER_PORT" not in os.environ:
        raise ValueError("init_method: none given and MASTER_PORT is not set "
                         "(give tcp://HOST:PORT or set MASTER_ADDR / MASTER_PORT)")
    return f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ['MASTER_PORT']}"


def _member_group(partition: list[tuple[int, ...]], rank: int, backend: str, timeout: timedelta) -> Group:
    """This rank's group of ``partition``. Every rank creates every group of more than one rank,
    in the same order, as ``new_group`` requires; groups of one rank get no process group."""
    mine = Group.single(rank)
    for ranks in partition:
        pg = dist.new_group(list(ranks), timeout=timeout, backend=backend) if len(ranks) > 1 else None
        if rank in ranks:
            mine = Group(pg, ranks, ranks.index(rank))
    return mine
