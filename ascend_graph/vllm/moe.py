"""The routed experts in vLLM's own CPU fused-MoE kernel (``cpu_fused_moe``), inside vLLM.

``use_vllm_fused_moe(model)`` lays out each MoE layer's expert weights once, in place, as that
kernel reads them (``prepack_moe_weight``: the intermediate size padded to ``ALIGN`` with zeros,
as vLLM pads it, then vLLM's packed layout, on huge pages) and switches the layer to
``VllmFusedMoE``, which runs the kernel for decode and prefill, eagerly and inside the graphs
alike (``ascend_graph_vllm::fused_moe``, one opaque call). The packed weights serve no other
backend: the layer refuses to switch to one. Why, and how the two kernels compare since
``expert_rows_mm`` reads one weight row at a time: docs/vllm.md.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..moe.backend import MoEBackend
from ..moe.experts import RoutedExperts
from ..moe.layer import MoE
from ..runtime import huge_page_buffer, huge_pages_supported

# vLLM's unquantized CPU experts: the hidden size a multiple of this, the intermediate padded to it.
ALIGN = 32


@torch.library.custom_op("ascend_graph_vllm::fused_moe", mutates_args=())
def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor, isa: str) -> Tensor:
    """``x [T, E]``, prepacked ``w13 [X, 2I, E]`` / ``w2 [X, E, I]``, ``weights [T, K]``, ``ids
    [T, K]`` -> the weighted sum of each token's experts' SiLU-gated MLPs, ``[T, E]``."""
    from vllm import _custom_ops as ops

    out = torch.empty_like(x)
    ops.cpu_fused_moe(out, x.contiguous(), w13, w2, None, None, weights.float().contiguous(),
                      ids.to(torch.int32).contiguous(), "silu", isa)
    return out


@fused_moe.register_fake
def _(x, w13, w2, weights, ids, isa):
    return torch.empty_like(x)


def kernel_isa(dtype: torch.dtype, hidden: int, intermediate: int) -> str:
    """The instruction set vLLM's own unquantized CPU experts would run: ``"amx"`` for bfloat16 on
    a CPU with AMX tiles where both sizes are multiples of ``ALIGN``, else ``"vec"``."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return "amx" if amx and dtype == torch.bfloat16 and hidden % ALIGN == 0 and intermediate % ALIGN == 0 else "vec"


class VllmFusedMoE(MoEBackend):
    """vLLM's ``cpu_fused_moe`` over weights ``use_vllm_fused_moe`` prepacked, decode and prefill."""

    name = "vllm_fused_moe"

    def __init__(self, isa: str) -> None:
        self.isa = isa

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)

    def decode(self, experts, x, weights, ids):
        return fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids, self.isa)

    prefill = decode


def _padded(experts: RoutedExperts, size: int) -> tuple[Tensor, Tensor]:
    """The gate/up and down weights with the intermediate size zero-padded to ``size`` (each of
    gate and up padded at its end, as vLLM pads them): padded units add nothing."""
    gate_up, down = experts.gate_up_proj.data, experts.down_proj.data
    x, two_i, e = gate_up.shape
    i = two_i // 2
    if size == i:
        return gate_up, down
    new_gate_up = gate_up.new_zeros(x, 2 * size, e)
    new_gate_up[:, :i], new_gate_up[:, size:size + i] = gate_up[:, :i], gate_up[:, i:]
    new_down = down.new_zeros(x, e, size)
    new_down[:, :, :i] = down
    return new_gate_up, new_down


def _packed(weight: Tensor, isa: str) -> Tensor:
    """``weight`` in vLLM's packed layout, on huge pages where the host has them."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's CPU ops into torch.ops._C)

    if huge_pages_supported():
        out = huge_page_buffer(weight.numel() * weight.element_size()).view(weight.dtype).view(weight.shape)
    else:
        out = torch.empty_like(weight, memory_format=torch.contiguous_format)
    torch.ops._C.prepack_moe_weight(weight.contiguous(), out, isa)
    return out


def use_vllm_fused_moe(model: nn.Module) -> int:
    """Switch every MoE layer of ``model`` whose experts vLLM's kernel takes (CPU, float32 or
    bfloat16, hidden size a multiple of ``ALIGN``) to ``VllmFusedMoE``, packing its weights in
    place; the number of layers switched. Call it once the weights are loaded, before a runner
    is built (the parameters become new tensors)."""
    switched = 0
    with torch.no_grad():
        for block in model.modules():
            if not isinstance(block, MoE) or block.packed_for is not None:
                continue
            experts = block.experts
            weight = experts.gate_up_proj
            hidden, intermediate = weight.shape[2], weight.shape[1] // 2
            if not VllmFusedMoE.supports(weight.device, weight.dtype) or hidden % ALIGN:
                continue
            padded = -(-intermediate // ALIGN) * ALIGN
            isa = kernel_isa(weight.dtype, hidden, padded)
            gate_up, down = _padded(experts, padded)
            experts.gate_up_proj = nn.Parameter(_packed(gate_up, isa), requires_grad=False)
            experts.down_proj = nn.Parameter(_packed(down, isa), requires_grad=False)
            block.packed_for = VllmFusedMoE(isa)
            block.use_backend(block.packed_for.name)
            switched += 1
    return switched
