"""A model by name: a built-in DeepSeek-shaped model with seeded weights, or a checkpoint directory."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from .deepseek import DeepseekForCausalLM
from .deepseek_config import DeepseekConfig
from .loader import load_deepseek

BUILTIN_MODELS = ("small", "small-v3")


def builtin_config(name: str) -> DeepseekConfig:
    """The config of built-in model ``name`` (one of ``BUILTIN_MODELS``)."""
    return DeepseekConfig.small() if name == "small" else DeepseekConfig.small_v3()


def named_model(name: str, dtype: Optional[torch.dtype] = None, device: torch.device | str = "cpu",
                mtp_layers: int = 0) -> tuple[nn.Module, str]:
    """``(model, description)`` for ``small`` / ``small-v3`` (seed-0 random weights, so every process
    builds the same one) or a DeepSeek V2/V3 checkpoint directory; ``dtype`` None keeps the default.
    ``mtp_layers``: at most that many of its multi-token-prediction layers (as many as it has)."""
    if name in BUILTIN_MODELS:
        config = builtin_config(name)
        model = DeepseekForCausalLM(config, dtype=dtype or torch.float32, device=device, seed=0,
                                    mtp_layers=min(mtp_layers, config.num_nextn_predict_layers)).eval()
        return model, f"built-in '{name}' (seeded random weights)"
    if os.path.isdir(name):
        layers = min(mtp_layers, DeepseekConfig.from_json(name).num_nextn_predict_layers)
        return load_deepseek(name, dtype=dtype, device=device, mtp_layers=layers), f"checkpoint {name}"
    raise FileNotFoundError(f"model {name!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
                            "nor a checkpoint directory")
