"""Attention backends over the project's CPU kernel (``ascend_graph.kernels``): decode reads each
row's live blocks only (``context_lens``), where they lie, in one pass (``decode_attention``:
scores, online softmax, values), the same call in eager and compiled steps. The graph keeps the
full-width block table as its input; the op's loop bounds follow the context, so a step costs
what the live context costs, whatever ``max_model_len`` is.

Prefill is compute-bound and runs the reference forms (they read each sequence's live blocks only).
"""

from __future__ import annotations

import torch

from .. import kernels
from .base import LiveOpMLA, LiveOpPaged

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype in _KERNEL_DTYPES and kernels.available()


class CpuMLA(LiveOpMLA):
    """MLA decode in the kernel (``decode_attention``): float32 or bfloat16 caches on a CPU where
    the kernel builds."""

    name = "cpu_kernel"
    op = "decode_attention"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return _kernel_runs(device, dtype)


class CpuPaged(LiveOpPaged):
    """Standard attention's decode in the kernel, each kv head's rows read in place: float32 or
    bfloat16 caches on a CPU where the kernel builds."""

    name = "cpu_kernel"
    op = "decode_attention"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return _kernel_runs(device, dtype)
