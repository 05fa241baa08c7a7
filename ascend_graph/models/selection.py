"""The models' choice of attention and MoE backends, made for the weights' dtype and device."""

from __future__ import annotations

from typing import Iterator, Optional

from torch import nn

from ..moe import MoE


class ChoosesBackends:
    """Mixin for the causal LMs: names and sets the backends of every attention layer (an
    ``attention_layers()`` module with ``use_backend`` and ``backend``) and MoE block. Each of
    those chooses when built and again whenever ``.to()`` moves or casts it, keeping a named
    request, so the choice always fits the weights."""

    def attention_layers(self) -> Iterator[nn.Module]:
        raise NotImplementedError

    def select_backends(self, attention: Optional[str] = None, moe: Optional[str] = None) -> dict[str, str]:
        """Choose the backends by name, or the first that runs here (None; ``select_attention_backend``,
        ``select_moe_backend``); returns ``backends()``. ValueError where a named one cannot run."""
        for layer in self.attention_layers():
            layer.use_backend(attention)
        for block in self.modules():
            if isinstance(block, MoE):
                block.use_backend(moe)
        return self.backends()

    def backends(self) -> dict[str, str]:
        """The names of the backends the layers run: ``{"attention": ..., "moe": ...}`` ("none": no MoE)."""
        moe = {m.backend.name for m in self.modules() if isinstance(m, MoE)}
        return {"attention": ",".join(sorted({layer.backend.name for layer in self.attention_layers()})),
                "moe": ",".join(sorted(moe)) or "none"}
