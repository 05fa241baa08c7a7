"""transformers' DeepSeek decode step on the same configuration, batch and context as ours.

A user without this project runs ``DeepseekV2ForCausalLM`` with its ``DynamicCache`` (sdpa
attention, full per-head K/V cache). One timed call is one decode step of ``batch`` rows after
``context - 1`` prefilled tokens, logits of the last token only; the cache is cropped back after
each call so every call decodes at the same length.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from ascend_graph.models import DeepseekConfig


class HFDecoder:
    """A transformers model with one prefilled cache per batch size."""

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype, context: int) -> None:
        from benchmarks.models import hf_model

        self.model, self.context = hf_model(config, dtype), context
        self.vocab = config.vocab_size
        # transformers 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns, then goes)
        params = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def step_fn(self, batch: int) -> Callable[[], object]:
        """Prefill ``batch`` rows of ``context - 1`` tokens; return a function that decodes one token."""
        from transformers import DynamicCache

        ids = (torch.arange(self.context - 1)[None, :] * 7 + torch.arange(batch)[:, None]) % self.vocab
        cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.cache_arg: cache})
        nxt = torch.ones(batch, 1, dtype=torch.long)
        pos = torch.full((batch, 1), self.context - 1, dtype=torch.long)

        def step() -> torch.Tensor:
            with torch.inference_mode():
                out = self.model(input_ids=nxt, position_ids=pos, use_cache=True, logits_to_keep=1,
                                 **{self.cache_arg: cache})
            cache.crop(-1)  # drop the token just decoded
            return out.logits

        return step
