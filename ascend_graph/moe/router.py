"""The MoE router: each token's K experts and their weights, in float32.

Shape legend: T tokens, E hidden size, X routed experts, K experts per token, G expert groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers import Float32Module

if TYPE_CHECKING:  # the models package builds these layers from its config
    from ..models.deepseek_config import DeepseekConfig


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
