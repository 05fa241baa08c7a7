"""Where each rank gets its share of the model: a recipe sent to every rank, built there.

A source is a small picklable object (it travels to spawned ranks through the spawn pipe) with
``config`` (the model's config, known before any rank starts) and ``build(state)`` (this rank's
share, for the groups of ``state``):

- ``FromFullModel``: a model instance's class, config and full state dict; each rank cuts its
  share with ``tp_shard`` (``Engine(model, tensor_parallel_size=...)``; the weights travel through
  the spawn pipe, so it suits models that fit one process).
- ``FromCheckpoint``: a DeepSeek checkpoint directory; each rank reads only its share
  (``load_deepseek(path, tp=...)``).
- ``FromName``: a built-in model (``models.named``); each rank rebuilds the same seeded model and
  cuts its share.

``models.tensor_parallel.check_split`` builds the share on the meta device, so a size the model
cannot split is a ``ValueError`` before any rank starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..distributed import ParallelState
from ..models.tensor_parallel import empty_share, share_kwargs


@dataclass(frozen=True)
class FromFullModel:
    """A model instance's class, config and full weights; each rank cuts its share."""

    cls: type
    config: Any
    state_dict: dict
    dtype: Optional[torch.dtype] = None

    @classmethod
    def of(cls, model: nn.Module) -> "FromFullModel":
        if not hasattr(model, "tp_shard"):
            raise ValueError(f"tensor_parallel_size/data_parallel_size: {type(model).__name__} has no tp_shard; "
                             "only models that can cut their share run on several ranks")
        weights = {name: t.detach() for name, t in model.state_dict().items()}
        return cls(type(model), model.config, weights, getattr(model, "dtype", None))

    def build(self, state: ParallelState) -> nn.Module:
        share = empty_share(self.cls, self.config, state, self.dtype)
        share.load_state_dict({name: share.tp_shard(name, t) for name, t in self.state_dict.items()})
        return share.eval()

    def model_class(self) -> type:
        return self.cls


@dataclass(frozen=True)
class FromCheckpoint:
    """A DeepSeek V2/V3 checkpoint directory; each rank reads its share only."""

    path: str
    dtype: Optional[torch.dtype] = None
    device: str = "cpu"

    @property
    def config(self) -> Any:
        from ..models import DeepseekConfig

        with open(os.path.join(self.path, "config.json"), encoding="utf-8") as f:
            return DeepseekConfig.from_dict(json.load(f))

    def build(self, state: ParallelState) -> nn.Module:
        from ..models import DeepseekForCausalLM, load_deepseek

        return load_deepseek(self.path, dtype=self.dtype, device=self.device,
                             **share_kwargs(DeepseekForCausalLM, state)).eval()

    def model_class(self) -> type:
        from ..models import DeepseekForCausalLM
        return DeepseekForCausalLM


@dataclass(frozen=True)
class FromName:
    """A built-in model (``models.named``): every rank builds the same seeded model, cuts its share."""

    name: str
    dtype: Optional[torch.dtype] = None
    device: str = "cpu"

    @property
    def config(self) -> Any:
        from ..models.named import builtin_config
        return builtin_config(self.name)

    def build(self, state: ParallelState) -> nn.Module:
        from ..models.named import named_model

        full, _ = named_model(self.name, self.dtype, self.device)
        return FromFullModel.of(full).build(state)

    def model_class(self) -> type:
        from ..models import DeepseekForCausalLM
        return DeepseekForCausalLM
