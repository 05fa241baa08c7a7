"""Checks of a generate call's requests, all before any request is queued."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence


def check_prompts(prompts: Any) -> None:
    """``ValueError`` unless ``prompts`` is a non-empty list of prompts (not one flat prompt)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompt_token_ids must be a non-empty list of prompts (lists of token ids or "
                         f"strings), got {type(prompts).__name__}")
    if isinstance(prompts[0], int):
        raise ValueError("prompt_token_ids must be a list of prompts, got a flat list of ints; "
                         "wrap a single prompt as [ids]")


def check_request(i: int, ids: list[int], budget: int, *, vocab: int, max_model_len: int, block_size: int,
                  num_blocks: int, lookahead: int = 0) -> None:
    """``ValueError`` naming request ``i`` when its prompt ``ids`` plus ``budget`` new tokens (plus
    ``lookahead`` draft slots past them) cannot be served."""
    if not ids:
        raise ValueError(f"request {i}: the prompt is empty; every request needs at least one token")
    for pos, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise ValueError(f"request {i}: token id {t!r} at position {pos} is outside the vocabulary "
                             f"[0, {vocab})")
    total = len(ids) + budget + lookahead
    if total > max_model_len:
        drafts = f" + num_speculative_tokens={lookahead}" if lookahead else ""
        raise ValueError(f"request {i}: prompt of {len(ids)} tokens + max_new_tokens={budget}{drafts} = {total} "
                         f"exceeds max_model_len={max_model_len}")
    need, usable = math.ceil(total / block_size), num_blocks - 1
    if need > usable:
        raise ValueError(f"request {i}: {total} tokens need {need} blocks of {block_size}, more than "
                         f"the whole cache's {usable} usable blocks (num_blocks={num_blocks}, "
                         "one is the null block)")


def budgets(max_new_tokens: int | Sequence[int], n: int) -> list[int]:
    """``max_new_tokens`` (one int, or one per request) as one validated budget per request."""
    budgets = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != n:
        raise ValueError(f"max_new_tokens has {len(budgets)} entries for {n} prompts")
    for i, b in enumerate(budgets):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"request {i}: max_new_tokens must be an int >= 1, got {b!r}")
    return budgets


def stop_ids(config: Any, stop_token_ids: Optional[Sequence[int]], ignore_eos: bool) -> frozenset[int]:
    """The tokens that end a request: ``stop_token_ids`` plus the model's ``eos_token_id`` unless ``ignore_eos``."""
    ints = lambda ids: all(isinstance(t, int) and not isinstance(t, bool) for t in ids)  # noqa: E731
    if stop_token_ids is not None and (isinstance(stop_token_ids, str) or not isinstance(stop_token_ids, Sequence)
                                       or not ints(stop_token_ids)):
        raise ValueError(f"stop_token_ids must be a list of ints, got {stop_token_ids!r}")
    stops = list(stop_token_ids or ())
    eos = None if ignore_eos else getattr(config, "eos_token_id", None)
    if eos is not None:
        stops.extend([eos] if isinstance(eos, int) else eos)
    return frozenset(stops)
