"""DeepSeek's feed-forward blocks: the dense SiLU-gated MLP and the mixture of experts.

Under tensor parallelism (``tp``, as vLLM shards DeepSeek) each rank keeps ``1/tp`` of every
intermediate size: gate/up by output rows, down by input columns, so each block's output is a
partial sum. A dense MLP all-reduces it; a MoE sums its routed and shared experts' partial sums
and all-reduces once. The router is replicated: every rank routes every token alike.

Under expert parallel (``ep``, spanning every ``tp * dp`` rank, as vLLM's flag does) each rank
holds a contiguous range of the routed experts (``expert_range``) with their full intermediate
size; shared experts stay TP-split. One form serves every layout, with all-reduces only
(Inductor's C++ wrapper, the CPU default, refuses all_gather / reduce_scatter / all_to_all, and
vLLM's CPU shared-memory collective is an all-reduce):
- dispatch, under DP only: this rank's rows (and a valid flag) in its slice of a zero
  ``[DP*T, E+1]`` buffer, all-reduced over ``dp``: every replica's tokens on every rank;
- the local experts over all those rows, for the pairs whose expert is here and whose row is
  not padding (``experts.py``: no expert computes the others); the shared experts (TP partial)
  on this rank's own rows, in its own slice;
- combine: one all-reduce over ``ep`` (every rank); this rank keeps its own slice.
TP alone with EP is then "local experts + one all-reduce". T must be equal on every DP rank: a
captured step's size is; an eager step pads to ``distributed.dp_padded_tokens()`` (the runner's
``dp_step``), its padding rows invalid, and drops them after.

Shape legend: T tokens, E hidden size, I intermediate size (this rank's share under TP),
N = DP*T gathered rows, X routed experts (this rank's under EP), K experts per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed import Group, all_reduce, dp_padded_tokens, local_size
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


def expert_range(num_experts: int, ep: Group) -> range:
    """The routed experts rank ``ep.rank`` holds: ``[r*X/W, (r+1)*X/W)``; ``ValueError`` naming
    ``n_routed_experts`` if the ``W`` ranks cannot share them evenly."""
    if num_experts % ep.size:
        raise ValueError(f"n_routed_experts={num_experts} does not split across the {ep.size} expert-parallel "
                         "ranks (enable_expert_parallel spreads the experts over every rank)")
    n = num_experts // ep.size
    return range(ep.rank * n, (ep.rank + 1) * n)


class MoE(ChosenBackend, nn.Module):
    """Routed experts plus the always-on shared experts; ``backend`` computes the routed sum
    (``moe.backend``; None: chosen for ``dtype`` on ``device``). Under ``tp`` alone every rank
    holds every routed expert with its share of the intermediate size, and the sum of routed and
    shared experts is all-reduced once; under ``ep`` (with ``dp``) as the module docstring says."""

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype, device=None,
                 backend: Optional[MoEBackend] = None, tp: Group = Group.single(), dp: Group = Group.single(),
                 ep: Group = Group.single()) -> None:
        super().__init__()
        if ep.size > 1 and ep.size != tp.size * dp.size:
            raise ValueError(f"ep: an expert-parallel group spans every rank (tp * dp = {tp.size * dp.size}), "
                             f"got {ep.size} ranks")
        self.tp, self.dp, self.ep = tp, dp, ep
        self.gate = Router(config, device)
        share = config.moe_intermediate_size if ep.size > 1 else \
            local_size(config.moe_intermediate_size, tp, "moe_intermediate_size")  # EP: whole experts
        self.experts = RoutedExperts(config, dtype, device, share, expert_range(config.n_routed_experts, ep))
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

    def extra_repr(self) -> str:
        r = self.experts.expert_range
        return (f"experts=[{r.start}, {r.stop}) of {self.gate.weight.shape[0]}, tp={self.tp.size}, "
                f"dp={self.dp.size}, ep={self.ep.size}")

    def forward(self, x: Tensor, prefill: bool = False, valid: Optional[Tensor] = None) -> Tensor:
        """``x [T, E]`` -> ``[T, E]``; ``prefill``: the step has prefill tokens (it runs eager);
        ``valid [T]`` bool: False for a padding row (None: every row), which under EP reaches
        no expert (single-process, every row is computed: its output is dropped anyway)."""
        if self.ep.size > 1:
            return self._expert_parallel(x, prefill, valid)
        weights, experts = self.gate(x)
        routed = (self.backend.prefill if prefill else self.backend.decode)(self.experts, x, weights, experts)
        out = routed if self.shared_experts is None else routed + self.shared_experts(x)  # [T, E]
        return all_reduce(out, self.tp)

    def _expert_parallel(self, x: Tensor, prefill: bool, valid: Optional[Tensor]) -> Tensor:
        t = x.shape[0]
        valid = torch.ones(t, dtype=torch.bool, device=x.device) if valid is None else valid
        x, valid = self._pad_rows(x, valid)  # [T', E], [T']: T' equal on every DP rank
        rows, everyone_valid = self._dispatch(x, valid)  # [N, E], [N]
        weights, ids = self.gate(rows)  # replicated router: every rank routes a row alike
        first, n = self.experts.expert_range.start, self.experts.num_experts
        local = ids - first
        local = torch.where((local >= 0) & (local < n) & everyone_valid[:, None], local, n)  # n: the sentinel
        routed = (self.backend.prefill_local if prefill else self.backend.decode_local)(
            self.experts, rows, weights, local)  # [N, E], this rank's experts' share
        if self.shared_experts is not None:
            routed = routed + self._own_slice(self.shared_experts(x))  # TP partial, own rows only
        out = all_reduce(routed, self.ep)  # [N, E]: every expert's and every TP share's sum
        start = self.dp.rank * x.shape[0]
        return out[start:start + t]

    def _pad_rows(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Under DP, an eager step's rows padded to the rows the ranks agreed on (``dp_step``)."""
        if self.dp.size == 1 or torch.compiler.is_compiling():  # a captured step: its size, on every rank
            return x, valid
        tokens = dp_padded_tokens()
        if tokens is None:
            raise RuntimeError("an eager step under data + expert parallel must run through the runner, inside "
                               "distributed.dp_step(tokens) with the rows every DP rank agreed to pad to")
        if tokens < x.shape[0]:
            raise RuntimeError(f"dp_step({tokens}) is fewer rows than this rank's step ({x.shape[0]})")
        pad = tokens - x.shape[0]
        return F.pad(x, (0, 0, 0, pad)), torch.cat([valid, valid.new_zeros(pad)])  # padding rows: invalid

    def _own_slice(self, rows: Tensor) -> Tensor:
        """``rows [T, ...]`` placed at this DP rank's slice of zeros ``[DP*T, ...]``."""
        if self.dp.size == 1:
            return rows
        t, before = rows.shape[0], self.dp.rank
        return F.pad(rows, (0, 0) * (rows.dim() - 1) + (before * t, (self.dp.size - 1 - before) * t))

    def _dispatch(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Every DP rank's rows and valid flags: ``[DP*T, E]``, ``[DP*T]`` (an all-reduce of zeros
        but for each rank's own slice: an all_gather would not compile in Inductor's C++ wrapper)."""
        if self.dp.size == 1:
            return x, valid
        both = all_reduce(self._own_slice(torch.cat([x, valid.to(x.dtype)[:, None]], dim=1)), self.dp)
        return both[:, :-1], both[:, -1] > 0.5
