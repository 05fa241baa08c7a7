"""The models' choice of attention and MoE backends, made for the weights' dtype and device."""

from __future__ import annotations

from typing import ClassVar, Iterator, Optional

from torch import nn

from ..attention import select_attention_backend
from ..moe import MoE, select_moe_backend


class ChoosesBackends:
    """Mixin for the causal LMs: every attention layer (an ``attention_layers()`` module with a
    ``backend``) and MoE block gets its backend when the model is built and again whenever
    ``.to()`` moves or casts it, so the choice always fits the weights."""

    attention_kind: ClassVar[str]  # "mla" or "paged"
    _backend_names: tuple[Optional[str], Optional[str]] = (None, None)  # select_backends' last request

    def attention_layers(self) -> Iterator[nn.Module]:
        raise NotImplementedError

    def select_backends(self, attention: Optional[str] = None, moe: Optional[str] = None) -> dict[str, str]:
        """Choose the backends by name, or the first that runs here (``select_attention_backend``,
        ``select_moe_backend``); returns ``backends()``. ValueError where a named one cannot run."""
        weight = next(self.parameters())
        self._backend_names = (attention, moe)
        for layer in self.attention_layers():
            layer.backend = select_attention_backend(self.attention_kind, weight.device, weight.dtype, attention)
        for block in self.modules():
            if isinstance(block, MoE):
                block.backend = select_moe_backend(weight.device, weight.dtype, moe)
        return self.backends()

    def backends(self) -> dict[str, str]:
        """The names of the backends the layers run: ``{"attention": ..., "moe": ...}`` ("none": no MoE)."""
        moe = {m.backend.name for m in self.modules() if isinstance(m, MoE)}
        return {"attention": ",".join(sorted({layer.backend.name for layer in self.attention_layers()})),
                "moe": ",".join(sorted(moe)) or "none"}

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        self.select_backends(*self._backend_names)
        return out
