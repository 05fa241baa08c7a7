"""What the layers of one step need to know across data-parallel ranks, set by the runner.

Under data parallel with expert parallel, every rank's MoE exchanges its tokens with the others
in each layer, so every rank must bring the same number of rows. A captured step has them (every
rank runs the capture size the ranks agreed on); an eager step has its own token count, and the
runner, having agreed on the largest count, runs it inside ``dp_step(tokens)``: the MoE pads its
rows to ``dp_padded_tokens()``. Outside any ``dp_step`` it is None.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional


class _Current:
    tokens: Optional[int] = None


@contextmanager
def dp_step(tokens: int) -> Iterator[None]:
    """Within the block, an eager step's rows are padded to ``tokens`` (the most rows any
    data-parallel rank brings to this step)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"dp_step: tokens must be an int >= 0, got {tokens!r}")
    outer, _Current.tokens = _Current.tokens, tokens
    try:
        yield
    finally:
        _Current.tokens = outer


def dp_padded_tokens() -> Optional[int]:
    """The rows every data-parallel rank's eager step is padded to, or None outside ``dp_step``."""
    return _Current.tokens
