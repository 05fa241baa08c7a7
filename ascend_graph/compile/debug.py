"""torch's own backends: ``cudagraphs`` (CUDA graphs without codegen), ``aot_eager``
(AOTAutograd tracing, no codegen) and ``eager`` (dynamo tracing only), for isolating a bug to
tracing, AOTAutograd, codegen or graph capture."""

from __future__ import annotations

from typing import Callable, Optional

from ..config import GraphConfig


def make_backend(name: str, config: GraphConfig, platform: str, mode: Optional[str]) -> Callable:
    """torch's backend registered under ``name``; it takes no options, so ``mode`` is refused."""
    if mode is not None:
        raise ValueError(f"mode={mode!r} has no meaning for the {name!r} backend; leave mode unset")
    from torch._dynamo import lookup_backend

    return lookup_backend(name)
