"""Compile groups: which capture sizes share one compile with a dynamic batch dimension; and
the compile options the runner resolves before capture (Inductor's checks, the backend's recipe).

A capture size's graph is either its own static compile, or one compile shared by the sizes of
its group, whose batch dimension is symbolic over the group's range (``InductorOptions.
dynamic_batch``). Size 1 always compiles alone: dynamo specialises a dimension of size 1, and
one-row products are rewritten differently (``compile/passes/decode_matmul.py``). Dispatch is
unchanged: a batch still runs padded to the smallest capture size that holds it, on that size's
views of the static buffers; only the number of compiles changes.

Shape legend: s capture size, M block-table width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from ..compile.recipe import DEFAULT_RECIPE, CompileRecipe
from ..config import GraphConfig

# Where ``dynamic_batch=None`` may resolve to on (the Inductor backend on these platforms).
DYNAMIC_BATCH_PLATFORMS = ("cpu",)
# Parameter dtypes whose models keep a static compile per size by default: the decode-matmul pass
# takes a shared graph's few-row products to the kernel from their row range (``row_bounds``), but
# a shared bf16/fp16 step has not been measured against static ones.
ROW_COUNT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CompileGroup:
    """Capture sizes ``lo..hi`` (those of them captured) compiled once; static when ``lo == hi``."""

    lo: int
    hi: int

    @property
    def dynamic(self) -> bool:
        """Whether the batch dimension is symbolic (the group spans more than one size)."""
        return self.lo < self.hi

    @property
    def label(self) -> str:
        """``"8"`` for a static size, ``"2-8"`` for a shared one."""
        return str(self.hi) if not self.dynamic else f"{self.lo}-{self.hi}"


def own_cpu_inductor(config: GraphConfig, device: torch.device, backend_given: bool) -> bool:
    """Whether this runner compiles with its own Inductor backend on CPU, the plain way: no
    backend callable, backend ``auto`` or ``inductor``, no ``aot`` or freezing."""
    from ..compile import AUTO_BACKEND

    if backend_given or device.type not in DYNAMIC_BATCH_PLATFORMS:
        return False
    if (AUTO_BACKEND[device.type] if config.backend == "auto" else config.backend) != "inductor":
        return False
    return not (config.inductor.aot or config.inductor.freezing_min_batch is not None)


def dynamic_batch_default(model: nn.Module, config: GraphConfig, device: torch.device,
                          backend_given: bool) -> bool:
    """What ``inductor.dynamic_batch=None`` means for this runner: on for the runner's own Inductor
    backend on CPU, without ``aot`` or freezing, when no parameter is bf16/fp16 (the decode-matmul
    pass then rewrites nothing by row count, so a shared compile gives the same code per row)."""
    return (own_cpu_inductor(config, device, backend_given)
            and not any(p.dtype in ROW_COUNT_DTYPES for p in model.parameters()))


@dataclass(frozen=True)
class CompileOptions:
    """The Inductor options a runner compiles with, defaults resolved."""

    dynamic_batch: bool
    precompile: bool


def resolve_compile_options(model: nn.Module, config: GraphConfig, device: torch.device,
                            backend: Optional[Callable]) -> CompileOptions:
    """Check the Inductor options against this runner (ValueError naming the option) and return
    them with their defaults resolved: ``dynamic_batch`` as ``dynamic_batch_default`` says,
    ``precompile`` on wherever it applies (``own_cpu_inductor``). ``freezing_min_batch``, ``aot``,
    ``dynamic_batch=True`` and ``precompile=True`` are for CPU runners; ``aot`` and ``precompile``
    compile with the runner's own Inductor backend."""
    options = config.inductor
    if not config.enabled:
        return CompileOptions(False, False)
    if options.freezing_min_batch is not None and device.type != "cpu":
        # Frozen graphs keep the caches as ordinary inputs (see freezing.py): a CUDA graph
        # would then copy them in on every replay, or not be recorded at all.
        raise ValueError(f"inductor.freezing_min_batch is for CPU runners; this one runs on {device}")
    for name in ("aot", "precompile"):
        if getattr(options, name):
            _check_own_inductor(f"inductor.{name}=True", config, device, backend)
    precompile = (own_cpu_inductor(config, device, backend is not None) if options.precompile is None
                  else options.precompile)
    if options.dynamic_batch is None:
        return CompileOptions(dynamic_batch_default(model, config, device, backend is not None), precompile)
    if options.dynamic_batch and device.type not in DYNAMIC_BATCH_PLATFORMS:
        raise ValueError(f"inductor.dynamic_batch=True is for CPU runners; this one runs on {device}")
    return CompileOptions(options.dynamic_batch, precompile)


def _check_own_inductor(what: str, config: GraphConfig, device: torch.device, backend: Optional[Callable]) -> None:
    from ..compile import backend_name

    if device.type != "cpu":
        raise ValueError(f"{what} is for CPU runners; this one runs on {device}")
    if backend is not None or backend_name(config, "cpu") != "inductor":
        raise ValueError(f"{what} compiles with Inductor: it needs backend 'auto' or 'inductor' "
                         f"and no backend callable, got backend={config.backend!r}"
                         + (" and a backend callable" if backend is not None else ""))


def compile_recipe_for(config: GraphConfig, device: torch.device, backend: Optional[Callable]) -> CompileRecipe:
    """The runner's compile recipe: its backend's (``compile.compile_recipe``) when the runner resolves
    the backend itself; the default for a caller's backend callable or with graph mode off."""
    from ..compile import compile_recipe

    if backend is not None or not config.enabled:
        return DEFAULT_RECIPE
    return compile_recipe(config, device)


def compile_groups(sizes: Sequence[int], dynamic: bool) -> dict[int, CompileGroup]:
    """Each capture size's group: with ``dynamic``, every size ``>= 2`` in one group ``2..max``
    (size 1 alone); else each size its own."""
    shared = [s for s in sizes if s >= 2] if dynamic else []
    if len(shared) < 2:
        return {s: CompileGroup(s, s) for s in sizes}
    group = CompileGroup(min(shared), max(shared))
    return {s: group if s in shared else CompileGroup(s, s) for s in sizes}


def mark_batch_dynamic(tensors: Sequence[Tensor], group: Optional[CompileGroup]) -> None:
    """Mark dimension 0 of the step's batch inputs symbolic over the group's range (static
    groups: nothing)."""
    if group is not None and group.dynamic:
        for t in tensors:
            torch._dynamo.mark_dynamic(t, 0, min=group.lo, max=group.hi)
