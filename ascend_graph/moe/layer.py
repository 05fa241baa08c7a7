"""DeepSeek's feed-forward blocks: the dense SiLU-gated MLP and the mixture of experts.

Under tensor parallelism (``tp``, as vLLM shards DeepSeek) each rank keeps ``1/tp`` of every
intermediate size: gate/up by output rows, down by input columns, so each block's output is a
partial sum. A dense MLP all-reduces it; a MoE sums its routed and shared experts' partial sums
and all-reduces once. The router is replicated: every rank routes every token alike.

Shape legend: T tokens, E hidden size, I intermediate size (this rank's share under TP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed import Group, all_reduce, local_size
from ..layers import ChosenBackend, linear
from .backend import MoEBackend, select_moe_backend
from .experts import RoutedExperts
from .router import Router

if TYPE_CHECKING:  # the models package builds these layers from its config
    from ..models.deepseek_config import DeepseekConfig


class MLP(nn.Module):
    """SiLU-gated MLP: ``down(silu(gate(x)) * up(x))`` (dense layers and shared experts); under
    ``tp`` this rank's share of the intermediate features (``what`` names their config key),
    all-reduced when ``reduce`` (a MoE's shared experts leave it to the MoE)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device=None,
                 tp: Group = Group.single(), reduce: bool = True, what: str = "intermediate_size") -> None:
        super().__init__()
        self.tp, self.reduce = tp, reduce
        intermediate_size = local_size(intermediate_size, tp, what)
        self.gate_proj = linear(hidden_size, intermediate_size, dtype, device)
        self.up_proj = linear(hidden_size, intermediate_size, dtype, device)
        self.down_proj = linear(intermediate_size, hidden_size, dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [T, E], partial under TP
        return all_reduce(out, self.tp) if self.reduce else out


class MoE(ChosenBackend, nn.Module):
    """Routed experts plus the always-on shared experts; ``backend`` computes the routed sum
    (``moe.backend``; None: chosen for ``dtype`` on ``device``). Under ``tp`` every rank holds
    every routed expert with its share of the intermediate size, and the sum of routed and shared
    experts is all-reduced once."""

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype, device=None,
                 backend: Optional[MoEBackend] = None, tp: Group = Group.single()) -> None:
        super().__init__()
        self.tp = tp
        self.gate = Router(config, device)
        self.experts = RoutedExperts(config, dtype, device,
                                     local_size(config.moe_intermediate_size, tp, "moe_intermediate_size"))
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                      dtype, device, tp, reduce=False,
                                      what="moe_intermediate_size * n_shared_experts")
        self.backend: MoEBackend = backend or self.use_backend()

    # A backend whose own weight layout the experts were packed into (``vllm.moe``): the only one
    # they serve from then on.
    packed_for: Optional[MoEBackend] = None

    def _choose_backend(self, name: Optional[str]) -> MoEBackend:
        if self.packed_for is not None:
            if name not in (None, self.packed_for.name):
                raise ValueError(f"moe backend {name!r} cannot run: the experts' weights are packed for "
                                 f"{self.packed_for.name!r}")
            return self.packed_for
        weight = self.experts.gate_up_proj
        return select_moe_backend(weight.device, weight.dtype, name)

    def forward(self, x: Tensor, prefill: bool = False) -> Tensor:
        """``x [T, E]`` -> ``[T, E]``; ``prefill``: the step has prefill tokens (it runs eager)."""
        weights, experts = self.gate(x)
        routed = (self.backend.prefill if prefill else self.backend.decode)(self.experts, x, weights, experts)
        out = routed if self.shared_experts is None else routed + self.shared_experts(x)  # [T, E]
        return all_reduce(out, self.tp)
