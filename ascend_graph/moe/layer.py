"""DeepSeek's feed-forward blocks: the dense SiLU-gated MLP and the mixture of experts.

Shape legend: T tokens, E hidden size, I intermediate size (of one expert), X routed experts,
K experts per token (``num_experts_per_tok``), G expert groups (``n_group``).

Routed experts are stored stacked (``gate_up_proj [X, 2I, E]``, ``down_proj [X, E, I]``, as
transformers 5 holds them). Four forms compute the same sum (``RoutedExperts.decode`` picks):

- ``gathered``: each token's K experts' weights indexed and multiplied with einsum. Static,
  sync-free; compiled, Inductor fuses the indexing into the matmul kernel, so when few experts
  are chosen (``T*K < X``) it reads just those. Eager, the indexing copies ``T*K`` weight
  matrices (measured 390 ms vs 11 ms sorted for one V2-Lite token), so eager never uses it.
- ``gathered_by_expert``: ``gathered`` over the (token, expert) pairs sorted by expert, the
  compiled form when ``T*K < 3X``, ``T > 1`` and an expert's weights are large
  (``SORT_PAIRS_MIN_EXPERT_BYTES``): an expert chosen by several tokens is read again right
  after, from the last-level cache.
- ``sorted_by_expert``: token rows sorted by expert, one grouped matmul over all experts with
  device-side offsets (``torch._grouped_mm``; on a CPU with AVX512-BF16, bfloat16, the project's
  ``expert_rows_mm``, 2-2.5x faster at these few rows per expert: ``kernels/ops.py``).
  Static, sync-free, reads each chosen expert once: the eager decode form (CPU, float32/16 and
  bfloat16) and the compiled one from 2 tokens on where ``expert_rows_mm`` runs (from 1 where
  the kernel's build takes one-row products, ``kernels.ONE_ROW_KERNEL``: AVX2, where the
  generated reduction streams the experts at 0.7 of one core's read rate), else when
  ``T*K >= 3X`` (``GROUPED_MIN_PAIRS_PER_EXPERT``, bfloat16). On a CUDA GPU of compute
  capability 9.0 or later in bfloat16 it is the compiled form at every batch (``grouped_mm_on_gpu``):
  there Inductor materialised the gathered forms' weights, 4.6 GB of capture memory for one
  V2-Lite MoE layer at batch 64 on an H200.
- ``grouped``: sorted rows, a Python loop of one matmul pair per expert; it asks the host for
  the per-expert counts, so it is eager-only (prefill, and decode where ``_grouped_mm`` is not
  usable).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..layers import Float32Module, linear

if TYPE_CHECKING:  # the models package builds these layers from its config
    from ..models.deepseek_config import DeepseekConfig


class MLP(nn.Module):
    """SiLU-gated MLP: ``down(silu(gate(x)) * up(x))`` (dense layers and shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.gate_proj = linear(hidden_size, intermediate_size, dtype, device)
        self.up_proj = linear(hidden_size, intermediate_size, dtype, device)
        self.down_proj = linear(intermediate_size, hidden_size, dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(Float32Module):
    """Chooses each token's K experts and their weights, in float32 (as the references do).

    softmax or sigmoid scores; ``greedy`` top-K, or top-K within the ``topk_group`` best groups
    (``group_limited_greedy`` ranks groups by their best expert, ``noaux_tc`` by the sum of their
    two best, after adding ``e_score_correction_bias`` — which only steers the choice; weights
    come from the uncorrected scores). Weights are optionally normalised, then scaled.
    """

    def __init__(self, config: DeepseekConfig, device=None) -> None:
        super().__init__()
        num_experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size, dtype=torch.float32,
                                               device=device))
        bias = None  # noaux_tc only; a buffer, as in the checkpoints
        if config.topk_method == "noaux_tc":
            bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.register_buffer("e_score_correction_bias", bias)
        self.top_k = config.num_experts_per_tok
        self.num_groups, self.topk_group = config.num_groups, config.topk_group or 1
        self.topk_method, self.sigmoid = config.topk_method, config.scoring_func == "sigmoid"
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x [T, E]`` -> ``(weights [T, K] float32, experts [T, K] int64)``."""
        scores, choice = self.scores(x)
        experts = choice.topk(self.top_k, dim=-1).indices  # [T, K]
        return self.expert_weights(scores, experts), experts

    def scores(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x [T, E]`` -> ``(scores, choice)``, both ``[T, X]`` float32: the experts' scores, and
        what the top-K is taken over (the scores with the correction bias, outside the best groups
        -inf)."""
        logits = F.linear(x.float(), self.weight.float())  # [T, X]
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = self.unmasked_choice(scores)
        if self.group_limited:
            choice = self.in_groups(choice, self.group_scores(choice).topk(self.topk_group, dim=-1).indices)
        return scores, choice

    @property
    def group_limited(self) -> bool:
        """Whether the top-K is taken within each token's ``topk_group`` best groups."""
        return self.topk_method != "greedy" and self.num_groups > 1

    def unmasked_choice(self, scores: Tensor) -> Tensor:
        """What the experts are ranked by, before any group is masked: the scores, plus the
        correction bias where there is one."""
        return scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias

    def expert_weights(self, scores: Tensor, experts: Tensor) -> Tensor:
        """The chosen ``experts [T, K]``'s weights: their scores, optionally normalised, scaled."""
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling

    def group_scores(self, choice: Tensor) -> Tensor:
        """``choice [T, X]`` (unmasked) -> ``[T, G]``: what the groups are ranked by, each group's
        best expert (``group_limited_greedy``) or the sum of its two best (``noaux_tc``)."""
        grouped = choice.view(choice.shape[0], self.num_groups, -1)  # [T, G, X/G]
        if self.topk_method == "noaux_tc":
            return grouped.topk(2, dim=-1).values.sum(dim=-1)
        return grouped.amax(dim=-1)

    def in_groups(self, choice: Tensor, groups: Tensor) -> Tensor:
        """``choice [T, X]`` with the experts outside each token's ``groups [T, topk_group]`` masked
        to -inf."""
        grouped = choice.view(choice.shape[0], self.num_groups, -1)  # [T, G, X/G]
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=choice.device).scatter(1, groups, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)


# Sorting the (token, expert) pairs pays where an expert's weights do not stay in the core's
# private caches between two uses anyway. Measured (torch 2.13, 1 thread, compiled through the
# runner's backend): one V2-Lite MoE layer (17.3 MB per expert) at T=8, 32.4 -> 29.9 ms; the
# small model's graph step (24 KiB per expert, float32) at batch 8, 0.571 -> 0.616 ms (timed
# interleaved in one process).
SORT_PAIRS_MIN_EXPERT_BYTES = 1 << 20

# Compiled without ``expert_rows_mm`` (it takes over from 2 tokens on where it runs),
# ``sorted_by_expert`` (``_grouped_mm``) takes over from the gathered forms at this many
# (token, expert) pairs per routed expert. Measured (same conditions, one V2-Lite MoE layer, 64
# experts, K=6): T=16 (1.5 pairs per expert) 84.3 ms grouped vs 55.9 ms gathered_by_expert; T=32
# (3 per expert) 98.5 vs 103.0 ms.
GROUPED_MIN_PAIRS_PER_EXPERT = 3


def grouped_mm_on_gpu(x: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` multiplies ``x``'s rows on a GPU: CUDA, bfloat16, compute
    capability 9.0 or later (where torch's grouped kernels run)."""
    return (hasattr(torch, "_grouped_mm") and x.device.type == "cuda" and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def _weighted_sum_unsorted(out: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    """Each token's sum of its K experts' outputs times their weights (``[T, E]``), from ``out``
    ``[T*K, E]`` in the order ``order`` sorted the pairs into: a gather back to ``[T, K, E]`` and
    one contraction, which Inductor generates (an ``index_add`` would be a fallback call in the
    C++ wrapper) and which sums in float32."""
    t, k = weights.shape
    out = out[order.argsort()].view(t, k, -1)  # back to [T, K, E]
    return torch.einsum("tke,tk->te", out, weights.to(out.dtype))


class RoutedExperts(nn.Module):
    """X SiLU-gated expert MLPs, stacked: ``gate_up_proj [X, 2I, E]``, ``down_proj [X, E, I]``."""

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        x, e, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        # compiled, one token's experts: ``expert_rows_mm`` (True) or the gathered reduction;
        # None: ``kernels.one_row_kernel()``, the kernel's build here (the ``levers``
        # benchmark sets it to time the other choice)
        self.one_token_kernel: bool | None = None
        self.gate_up_proj = nn.Parameter(torch.empty(x, 2 * i, e, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(x, e, i, dtype=dtype, device=device))

    def gathered(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Sync-free, static-shape form for decode: each token reads its K experts' weights."""
        gate_up = torch.einsum("te,tkie->tki", x, self.gate_up_proj[experts])  # [T, K, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up  # [T, K, I]
        out = torch.einsum("tki,tkei->tke", h, self.down_proj[experts])  # [T, K, E]
        return torch.einsum("tke,tk->te", out, weights.to(out.dtype))

    def gathered_by_expert(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """``gathered`` over the (token, expert) pairs sorted by expert: a compiled kernel reads
        the pairs in order, so an expert chosen by several tokens is read again while its
        weights are still in the last-level cache instead of from memory."""
        k = experts.shape[1]
        flat = experts.flatten()  # [T*K]
        order = flat.argsort(stable=True)
        chosen = flat[order]
        gate_up = torch.einsum("pe,pie->pi", x[order // k], self.gate_up_proj[chosen])  # [T*K, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.einsum("pi,pei->pe", F.silu(gate) * up, self.down_proj[chosen])  # [T*K, E], sorted
        return _weighted_sum_unsorted(out, order, weights)

    def sorted_by_expert(self, x: Tensor, weights: Tensor, experts: Tensor, kernel: bool | None = None) -> Tensor:
        """Sync-free grouped form: rows sorted by expert, grouped matmuls with device offsets;
        ``kernel`` None: ``expert_rows_mm`` where it runs (``uses_kernel``), False: ``_grouped_mm``."""
        k = experts.shape[1]
        flat = experts.flatten()  # [T*K]
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # [X] rows per expert
        offs = counts.cumsum(0, dtype=torch.int32)  # [X] end of each expert's rows
        token = order // k
        if self.uses_kernel(x) if kernel is None else kernel:
            matmul = torch.ops.ascend_graph.expert_rows_mm  # w [X, N, K] as stored
        else:
            matmul = lambda rows, w, ends: torch._grouped_mm(rows, w.transpose(1, 2), offs=ends)  # noqa: E731
        gate, up = matmul(x[token], self.gate_up_proj, offs).chunk(2, dim=-1)
        out = matmul(F.silu(gate) * up, self.down_proj, offs)  # [T*K, E], sorted
        return _weighted_sum_unsorted(out, order, weights)

    def decode(self, x: Tensor, weights: Tensor, experts: Tensor, kernel: bool | None = None) -> Tensor:
        """The fastest form that suits how this step runs (see the module docstring); ``kernel``
        as for ``sorted_by_expert`` (False: the choice and forms of before ``expert_rows_mm``)."""
        kernel = self.uses_kernel(x) if kernel is None else kernel
        can_sort = (hasattr(torch, "_grouped_mm") and x.device.type == "cpu"
                    and x.dtype in (torch.float32, torch.bfloat16, torch.float16))
        if not torch.compiler.is_compiling():
            if can_sort:
                return self.sorted_by_expert(x, weights, experts, kernel)
            return self.grouped(x, weights, experts)
        if kernel and (x.shape[0] > 1 or self.one_token_in_kernel):
            return self.sorted_by_expert(x, weights, experts, kernel)
        if grouped_mm_on_gpu(x):
            return self.sorted_by_expert(x, weights, experts, kernel=False)
        # torch 2.13's fake-tensor rule for _grouped_mm accepts bfloat16 only.
        many_pairs = experts.numel() >= GROUPED_MIN_PAIRS_PER_EXPERT * self.gate_up_proj.shape[0]
        if can_sort and x.dtype == torch.bfloat16 and many_pairs:
            return self.sorted_by_expert(x, weights, experts, kernel)
        if x.shape[0] > 1 and self.expert_bytes >= SORT_PAIRS_MIN_EXPERT_BYTES:
            return self.gathered_by_expert(x, weights, experts)
        return self.gathered(x, weights, experts)

    def uses_kernel(self, x: Tensor) -> bool:
        """Whether ``sorted_by_expert`` multiplies with ``expert_rows_mm`` (CPU, bfloat16, and the
        kernel built here) rather than ``torch._grouped_mm``; in AOTInductor packages too
        (``tests/test_aot_inductor.py``)."""
        return (x.device.type == "cpu" and x.dtype == self.gate_up_proj.dtype == torch.bfloat16
                and kernels.available())

    @property
    def one_token_in_kernel(self) -> bool:
        """Whether a compiled step multiplies one token's experts with ``expert_rows_mm`` (where
        ``uses_kernel``) rather than as the gathered reduction (``one_token_kernel``)."""
        return kernels.one_row_kernel() if self.one_token_kernel is None else self.one_token_kernel

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert's weights."""
        return (self.gate_up_proj[0].numel() + self.down_proj[0].numel()) * self.gate_up_proj.element_size()

    def grouped(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Eager form for prefill: tokens sorted by expert, one matmul pair per expert."""
        k = experts.shape[1]
        flat = experts.flatten()  # [T*K]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()  # host sync
        token = order // k
        outs = [self.expert_mlp(rows, expert) for expert, rows in enumerate(x[token].split(counts))]
        out = torch.cat(outs) * weights.flatten()[order, None].to(x.dtype)  # [T*K, E]
        return torch.zeros_like(x).index_add_(0, token, out)

    def expert_mlp(self, rows: Tensor, expert: int) -> Tensor:
        """One expert's SiLU-gated MLP on its ``[R, E]`` rows (``grouped``'s step)."""
        gate, up = F.linear(rows, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])


class MoE(nn.Module):
    """Routed experts plus the always-on shared experts."""

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.gate = Router(config, device)
        self.experts = RoutedExperts(config, dtype, device)
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                      dtype, device)

    def forward(self, x: Tensor, grouped: bool = False) -> Tensor:
        """``x [T, E]`` -> ``[T, E]``; ``grouped`` picks the eager prefill path (see the module doc)."""
        weights, experts = self.gate(x)
        routed = self.experts.grouped if grouped else self.experts.decode
        out = routed(x, weights, experts)
        return out if self.shared_experts is None else out + self.shared_experts(x)
