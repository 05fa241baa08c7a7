"""Choosing the next token: greedy, or temperature / top-k / top-p sampling with seeded generators.

Shape legend: n rows (requests in the step), V vocabulary.

Each request draws from its own ``torch.Generator``, seeded from ``(seed, request index)``, so a
request's samples do not depend on which other requests shared its steps (continuous batching
changes the batch composition).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

_SEED_MIX = 1_000_003  # spreads (seed, index) pairs over distinct generator seeds


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen; ``temperature=0`` is greedy (argmax), the default.

    - ``temperature``: ``>= 0``; logits are divided by it before sampling.
    - ``top_k``: keep the ``k`` most likely tokens; 0 = all.
    - ``top_p``: keep the smallest set of most likely tokens whose probability reaches ``top_p``
      (nucleus sampling); 1.0 = all. Must lie in ``(0, 1]``.
    - ``seed``: makes sampling reproducible; ``None`` draws a fresh seed.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = no top-k filter), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1 = no nucleus filter), got {p!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise ValueError(f"seed must be an int >= 0 or None, got {s!r}")

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax of the logits."""
        return self.temperature == 0


def filtered_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """``logits [n, V]`` -> float32 probabilities ``[n, V]`` after temperature, top-k and top-p."""
    scaled = logits.float() / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]  # [n, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1:
        ordered, index = scaled.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the more likely ones already reach top_p; the first always stays.
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        scaled = scaled.scatter(-1, index, ordered.masked_fill(drop, float("-inf")))
    return scaled.softmax(dim=-1)


class Sampler:
    """Picks each request's next token from its logits row, one seeded generator per request."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._base_seed = params.seed if params.seed is not None else torch.Generator().seed()
        self._generators: dict[int, torch.Generator] = {}

    def _generator(self, request: int) -> torch.Generator:
        if request not in self._generators:
            seed = (self._base_seed * _SEED_MIX + request) % (1 << 63)
            self._generators[request] = torch.Generator().manual_seed(seed)
        return self._generators[request]

    def sample(self, logits: Tensor, requests: Sequence[int]) -> list[int]:
        """Next token of each row of ``logits [n, V]``; row ``i`` belongs to request ``requests[i]``."""
        if self.params.greedy:
            return logits.argmax(dim=-1).tolist()
        probs = filtered_probs(logits, self.params).cpu()  # generators live on the CPU
        return [int(torch.multinomial(probs[i], 1, generator=self._generator(r)))
                for i, r in enumerate(requests)]
