"""How the runner hands a backend its steps: a ``CompileRecipe``, given by the backend's module.

The runner compiles every capture size with ``torch.compile(step, backend=..., fullgraph=True,
dynamic=recipe.dynamic)``. With ``recipe.mark_static`` it first marks every tensor input of the
step static (``mark_step_inputs_static``): the step's input buffers and each tensor of every
layer's cache tuple. A backend module states its recipe in ``compile_recipe(config)``; a module
without one gets ``DEFAULT_RECIPE`` (static shapes, nothing marked, no recapture counters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class CompileRecipe:
    """``torch.compile``'s ``dynamic``, whether to mark the step's tensors static, and the
    backend's recapture counters (graph name -> recaptures) where it keeps any."""

    dynamic: bool = False
    mark_static: bool = False
    recapture_counts: Optional[Callable[[], Mapping[str, int]]] = None

    def recapture_baseline(self) -> dict[str, int]:
        """The counters now, to count the recaptures after this moment against."""
        return dict(self.recapture_counts()) if self.recapture_counts is not None else {}

    def recaptures_since(self, baseline: Mapping[str, int]) -> int:
        """Recaptures counted since ``baseline`` (a graph dropped since then counts nothing)."""
        if self.recapture_counts is None:
            return 0
        return sum(max(0, n - baseline.get(key, 0)) for key, n in self.recapture_counts().items())


DEFAULT_RECIPE = CompileRecipe()


def mark_step_inputs_static(step_tensors: Sequence[Tensor], kv_caches: Sequence[tuple]) -> list[Tensor]:
    """``torch._dynamo.mark_static`` on each step tensor and each tensor of every layer's cache
    tuple; returns the tensors marked. A layer's cache that is not a tuple raises ``TypeError``."""
    for i, cache in enumerate(kv_caches):
        if not isinstance(cache, tuple):
            raise TypeError(f"kv_caches[{i}] must be a tuple of tensors (MLACache or KVCache), "
                            f"got {type(cache).__name__}")
    tensors = [*step_tensors, *(t for cache in kv_caches for t in cache)]
    for t in tensors:
        torch._dynamo.mark_static(t)
    return tensors
