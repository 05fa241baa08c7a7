"""Inductor's freezing around a capture size's first call (``InductorOptions.freezing_min_batch``)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

from torch import Tensor


@contextlib.contextmanager
def freezing(threshold: Optional[int], size: int, inputs: Sequence[Tensor]) -> Iterator[None]:
    """Inductor's freezing for a capture size of ``size`` rows when ``threshold`` asks for it.

    Dynamo reads the flag while tracing and Inductor while compiling, so it is set around the
    first call, not passed as a compile option. Under it dynamo turns every static input into a
    graph constant, not only the weights: the caches and the step's input buffers (``inputs``,
    marked static for the device graphs) would be folded in with the values they held at
    capture. Their marks are lifted for the trace, so they stay graph inputs.
    """
    if threshold is None or size < threshold:
        yield
        return
    import torch._inductor.config as inductor_config

    marks = {id(t): (t, t._dynamo_static_input_type) for t in inputs if hasattr(t, "_dynamo_static_input_type")}
    for t, _ in marks.values():
        del t._dynamo_static_input_type
    try:
        with inductor_config.patch(freezing=True):
            yield
    finally:
        for t, mark in marks.values():
            t._dynamo_static_input_type = mark
