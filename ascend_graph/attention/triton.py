"""Attention backends over the Triton op ``ascend_graph::triton_decode_attention``
(``kernels/triton_attention.py``) on CUDA: decode reads each row's live blocks only
(``context_lens``), where they lie, in one kernel (flash decoding, a merge kernel after it where a
small batch splits its rows), the same call in eager and compiled steps. The graph keeps the
full-width block table as its input; the kernel's loop bounds follow the context, inside the
captured CUDA graph.

Shape legend: B decode rows, H heads (Hq query, Hk kv), Dn qk_nope_head_dim, R
qk_rope_head_dim, Dv v_head_dim, C kv_lora_rank, D head size.

Prefill is compute-bound and runs the reference forms (they read each sequence's live blocks only).
"""

from __future__ import annotations

import torch

from ..kernels import triton_attention
from .base import LiveOpMLA, LiveOpPaged


def _kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "cuda" and dtype in triton_attention.DTYPES
            and triton_attention.available())


class TritonMLA(LiveOpMLA):
    """MLA decode in the Triton kernel: float16, bfloat16 or float32 caches on CUDA where triton
    imports; each ``kv_c`` tile read for the scores gives the latent output too."""

    name = "triton"
    op = "triton_decode_attention"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return _kernel_runs(device, dtype)


class TritonPaged(LiveOpPaged):
    """Standard (MHA / GQA) attention's decode in the Triton kernel, the query heads of each kv head
    together: float16, bfloat16 or float32 caches on CUDA where triton imports."""

    name = "triton"
    op = "triton_decode_attention"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return _kernel_runs(device, dtype)
