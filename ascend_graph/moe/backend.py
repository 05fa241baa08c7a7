"""Choosing how the routed experts are computed: once, when the model is built, from the
platform, the dtype and what is installed. Eager and compiled decode steps run the chosen form.

Shape legend: T tokens, K experts per token, X routed experts.

``MOE_BACKENDS`` is in order of preference; the first whose ``supports(device, dtype)`` holds is
chosen. Prefill steps always run eager and take ``RoutedExperts.grouped`` (one matmul pair per
expert, host-side counts) on every backend.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
from torch import Tensor

from .. import kernels
from .experts import RoutedExperts

# Sorting the (token, expert) pairs pays where an expert's weights do not stay in the core's
# private caches between two uses anyway (docs/cpu-kernels.md).
SORT_PAIRS_MIN_EXPERT_BYTES = 1 << 20


class MoEBackend:
    """One way of computing the routed experts' weighted sum for decode steps."""

    name: ClassVar[str]

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        raise NotImplementedError

    def decode(self, experts: RoutedExperts, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """``x [T, E]``, ``weights [T, K]`` float32, ``ids [T, K]`` -> ``[T, E]``; sync-free."""
        raise NotImplementedError

    def prefill(self, experts: RoutedExperts, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        return experts.grouped(x, weights, ids)

    def decode_local(self, experts: RoutedExperts, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """``decode`` on an expert-parallel rank: ``ids`` are local, ``experts.num_experts`` (the
        sentinel) marks a pair that no expert here computes and that adds nothing."""
        raise NotImplementedError(f"moe backend {self.name!r} does not run under expert parallel")

    def prefill_local(self, experts: RoutedExperts, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """``prefill`` on an expert-parallel rank (``decode_local``'s ids)."""
        return experts.grouped(x, weights, ids, skip=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class KernelMoE(MoEBackend):
    """Sorted rows through the project's ``expert_rows_mm``: bfloat16 or float32 on a CPU where it builds."""

    name = "cpu_kernel"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and kernels.available()

    def decode(self, experts, x, weights, ids):
        return experts.sorted_by_expert(x, weights, ids, kernel=True)

    def decode_local(self, experts, x, weights, ids):
        return experts.sorted_by_expert(x, weights, ids, kernel=True, skip=True)


class GroupedMMMoE(MoEBackend):
    """Sorted rows through ``torch._grouped_mm``: CPU float32 / bfloat16 / float16 (where the
    kernel does not run), and CUDA bfloat16 on compute capability 9.0 or later (where torch's
    grouped kernels run)."""

    name = "grouped_mm"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        if not hasattr(torch, "_grouped_mm"):
            return False
        if device.type == "cpu":
            return dtype in (torch.float32, torch.bfloat16, torch.float16)
        return (device.type == "cuda" and dtype == torch.bfloat16
                and torch.cuda.get_device_capability(device) >= (9, 0))

    def decode(self, experts, x, weights, ids):
        return experts.sorted_by_expert(x, weights, ids, kernel=False)

    def decode_local(self, experts, x, weights, ids):
        return experts.sorted_by_expert(x, weights, ids, kernel=False, skip=True)


class GatheredMoE(MoEBackend):
    """Each token's experts' weights gathered (sorted by expert from 2 tokens where an expert's
    weights are large): runs anywhere; compiled, Inductor fuses the gather into the matmul."""

    name = "gathered"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return True

    def decode(self, experts, x, weights, ids, skip: bool = False):
        if x.shape[0] > 1 and experts.expert_bytes >= SORT_PAIRS_MIN_EXPERT_BYTES:
            return experts.gathered_by_expert(x, weights, ids, skip)
        return experts.gathered(x, weights, ids, skip)

    def decode_local(self, experts, x, weights, ids):
        return self.decode(experts, x, weights, ids, skip=True)


MOE_BACKENDS: tuple[type[MoEBackend], ...] = (KernelMoE, GroupedMMMoE, GatheredMoE)


def select_moe_backend(device: torch.device | str, dtype: torch.dtype, name: Optional[str] = None) -> MoEBackend:
    """The MoE backend for ``dtype`` weights on ``device``: ``name`` if given (ValueError if it
    cannot run there), else the first of ``MOE_BACKENDS`` that can."""
    names = [cls.name for cls in MOE_BACKENDS]
    if name is not None and name not in names:
        raise ValueError(f"moe backend must be one of {names}, got {name!r}")
    device = torch.device(device)
    for cls in MOE_BACKENDS:
        if (name is None or cls.name == name) and cls.supports(device, dtype):
            return cls()
    raise ValueError(f"moe backend {name!r} does not run for {dtype} weights on {device.type}")
