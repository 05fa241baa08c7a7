"""Routed experts stacked per layer and the forms that compute their weighted sum.

Shape legend: T tokens, E hidden size, I intermediate size (of one expert), X routed experts,
K experts per token, P = T*K (token, expert) pairs.

``gate_up_proj [X, 2I, E]`` and ``down_proj [X, E, I]`` are stored stacked, as transformers 5
holds them. Every form computes the same sum; which one a step runs is the MoE backend's choice
(``moe.backend``), made once when the model is built:
- ``gathered``: each token's K experts' weights indexed and multiplied with einsum; static and
  sync-free; compiled, Inductor fuses the indexing into the matmul, eager copies ``T*K`` matrices.
- ``gathered_by_expert``: ``gathered`` over the pairs sorted by expert, so an expert chosen by
  several tokens is read again while its weights are still in the last-level cache.
- ``sorted_by_expert``: rows sorted by expert, one grouped matmul over all experts with
  device-side row ends (the project's ``expert_rows_mm`` or ``torch._grouped_mm``); static,
  sync-free, reads each chosen expert once.
- ``grouped``: sorted rows, one matmul pair per expert in a Python loop; asks the host for the
  counts, so prefill (always eager) only.

Under expert parallel a rank holds the experts ``expert_range`` names (``first`` on), numbered
locally ``0..X-1``; each form then takes ``skip=True`` and ids where ``X`` (the sentinel) marks a
pair that is another rank's or a padding row's. No expert computes those pairs:
- ``sorted_by_expert`` sorts them last, past the last row end: ``torch._grouped_mm`` leaves such
  rows unwritten, ``expert_rows_mm`` writes zeros; either way ``torch.where`` drops them (garbage
  times a zero weight could be NaN);
- ``grouped`` drops them on the host before its loop;
- ``gathered`` / ``gathered_by_expert`` give every pair a static slot, so a sentinel pair's slot
  still multiplies: by an all-zero row (``torch.where``) through local expert 0, which adds
  exactly nothing. The slot count is fixed (``T*K``), so padding cannot load one expert more than
  another there; the sorted forms (the CPU default) skip the work too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


if TYPE_CHECKING:  # the models package builds these layers from its config
    from ..models.deepseek_config import DeepseekConfig


@torch.library.custom_op("ascend_graph::grouped_mm", mutates_args=())
def grouped_mm(rows: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """``rows [P, K]`` sorted by expert times each expert's ``w [X, N, K]`` transposed, ``ends [X]``
    int32 row ends -> ``[P, N]``: ``torch._grouped_mm(rows, w.transpose(1, 2), offs=ends)`` as an
    op, so compiled steps call the same kernel as eager ones for every dtype that
    ``torch._grouped_mm`` takes on the device (torch's fake-tensor rule for it takes bfloat16 only)."""
    return torch._grouped_mm(rows, w.transpose(1, 2), offs=ends)


@grouped_mm.register_fake
def _(rows: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    return rows.new_empty(rows.shape[0], w.shape[1])


def _weighted_sum_unsorted(out: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    """Each token's sum of its K experts' outputs times their weights (``[T, E]``), from ``out``
    ``[T*K, E]`` in the order ``order`` sorted the pairs into: a gather back to ``[T, K, E]`` and
    one contraction, which Inductor generates (an ``index_add`` would be a fallback call in the
    C++ wrapper) and which sums in float32."""
    t, k = weights.shape
    out = out[order.argsort()].view(t, k, -1)  # back to [T, K, E]
    return torch.einsum("tke,tk->te", out, weights.to(out.dtype))


class RoutedExperts(nn.Module):
    """X SiLU-gated expert MLPs, stacked: ``gate_up_proj [X, 2I, E]``, ``down_proj [X, E, I]``;
    ``intermediate_size``: a tensor-parallel rank's share of I (default: the config's);
    ``experts``: the config's experts this rank holds (default: all), numbered from 0 here."""

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype, device=None,
                 intermediate_size: Optional[int] = None, experts: Optional[range] = None) -> None:
        super().__init__()
        self.expert_range = range(config.n_routed_experts) if experts is None else experts
        x, e = len(self.expert_range), config.hidden_size
        i = config.moe_intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(x, 2 * i, e, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(x, e, i, dtype=dtype, device=device))

    @property
    def num_experts(self) -> int:
        """The experts held here (X); as an id, the sentinel of a pair no expert here computes."""
        return self.gate_up_proj.shape[0]

    def gathered(self, x: Tensor, weights: Tensor, experts: Tensor, skip: bool = False) -> Tensor:
        """Sync-free, static-shape form for decode: each token reads its K experts' weights."""
        if skip:
            mine = experts < self.num_experts  # [T, K]
            rows, experts = torch.where(mine[..., None], x[:, None], 0), torch.where(mine, experts, 0)
            gate_up = torch.einsum("tke,tkie->tki", rows, self.gate_up_proj[experts])  # sentinel: zero row
        else:
            gate_up = torch.einsum("te,tkie->tki", x, self.gate_up_proj[experts])  # [T, K, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up  # [T, K, I]
        out = torch.einsum("tki,tkei->tke", h, self.down_proj[experts])  # [T, K, E]
        return torch.einsum("tke,tk->te", out, weights.to(out.dtype))

    def gathered_by_expert(self, x: Tensor, weights: Tensor, experts: Tensor, skip: bool = False) -> Tensor:
        """``gathered`` over the (token, expert) pairs sorted by expert: a compiled kernel reads
        the pairs in order, so an expert chosen by several tokens is read again while its
        weights are still in the last-level cache instead of from memory."""
        k = experts.shape[1]
        flat = experts.flatten()  # [T*K]
        order = flat.argsort(stable=True)
        chosen, rows = flat[order], x[order // k]  # [T*K], [T*K, E]
        if skip:  # sentinel pairs: a zero row through expert 0
            mine = chosen < self.num_experts
            chosen, rows = torch.where(mine, chosen, 0), torch.where(mine[:, None], rows, 0)
        gate_up = torch.einsum("pe,pie->pi", rows, self.gate_up_proj[chosen])  # [T*K, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.einsum("pi,pei->pe", F.silu(gate) * up, self.down_proj[chosen])  # [T*K, E], sorted
        return _weighted_sum_unsorted(out, order, weights)

    def sorted_by_expert(self, x: Tensor, weights: Tensor, experts: Tensor, kernel: bool,
                         skip: bool = False) -> Tensor:
        """Sync-free grouped form: rows sorted by expert, grouped matmuls with device-side row
        ends: the project's ``expert_rows_mm`` (``kernel``) or ``torch._grouped_mm``."""
        k, n = experts.shape[1], self.num_experts
        flat = experts.flatten()  # [T*K]
        order = flat.argsort(stable=True)
        counts = torch.zeros(n + skip, dtype=torch.int32, device=x.device)  # a sentinel's bucket sorts last
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # [X] rows per expert
        offs = counts.cumsum(0, dtype=torch.int32)  # [X] end of each expert's rows
        if skip:
            offs = offs[:n]  # the sentinel pairs' rows lie past the last end: no expert's
        token = order // k
        matmul = torch.ops.ascend_graph.expert_rows_mm if kernel else grouped_mm  # w [X, N, K] as stored
        gate, up = matmul(x[token], self.gate_up_proj, offs).chunk(2, dim=-1)
        out = matmul(F.silu(gate) * up, self.down_proj, offs)  # [T*K, E], sorted
        if skip:  # rows past the last end are unwritten by torch._grouped_mm: select, never multiply
            out = torch.where((flat[order] < n)[:, None], out, 0)
        return _weighted_sum_unsorted(out, order, weights)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert's weights."""
        return (self.gate_up_proj[0].numel() + self.down_proj[0].numel()) * self.gate_up_proj.element_size()

    def grouped(self, x: Tensor, weights: Tensor, experts: Tensor, skip: bool = False) -> Tensor:
        """Eager form for prefill: tokens sorted by expert, one matmul pair per expert."""
        k, n = experts.shape[1], self.num_experts
        flat = experts.flatten()  # [T*K]
        order = flat.argsort(stable=True)
        if skip:
            order = order[flat[order] < n]  # host-side: the sentinel pairs (sorted last) are dropped
        counts = torch.bincount(flat, minlength=n + skip).tolist()[:n]  # host sync
        token = order // k
        outs = [self.expert_mlp(rows, expert) for expert, rows in enumerate(x[token].split(counts))]
        out = torch.cat(outs) * weights.flatten()[order, None].to(x.dtype)  # [T*K, E]
        return torch.zeros_like(x).index_add_(0, token, out)

    def expert_mlp(self, rows: Tensor, expert: int) -> Tensor:
        """One expert's SiLU-gated MLP on its ``[R, E]`` rows (``grouped``'s step)."""
        gate, up = F.linear(rows, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])
