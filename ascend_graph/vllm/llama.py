"""The model class graph mode switches a transformers ``LlamaForCausalLM`` checkpoint to (docs/vllm.md).

Standard attention (GQA over ``KVCache(k, v)`` per layer): ascend_graph's ``LlamaForCausalLM``
run by the ``GraphRunner`` exactly as the DeepSeek classes run theirs (``model.AscendGraphForCausalLM``:
per-size graphs for decode-only batches, eager steps on the same caches). The stand-in layers
report a full-attention spec of the model's kv heads and head size, so vLLM's block pool counts
the bytes our two tensors per layer take.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor
from vllm.config import VllmConfig

from ..models.llama import ARCHITECTURE, LlamaConfig, LlamaForCausalLM
from ..models.llama_loader import load_llama_weights
from .model import AscendGraphForCausalLM


class AscendGraphLlamaForCausalLM(AscendGraphForCausalLM):
    """A plain Llama checkpoint (no rope scaling, no biases) served by ascend_graph inside vLLM."""

    checkpoint_architecture = ARCHITECTURE

    def _build_model(self, vllm_config: VllmConfig) -> tuple[LlamaConfig, LlamaForCausalLM]:
        hf = vllm_config.model_config.hf_config.to_dict()
        config = LlamaConfig.from_dict({**hf, "architectures": [self.checkpoint_architecture]})
        with torch.device("meta"):  # no random init: every tensor comes from the checkpoint
            model = LlamaForCausalLM(config, tp=self.parallel.tp)
        model = model.to_empty(device="cpu")
        model.tie_weights()
        return config, model.to(vllm_config.model_config.dtype)

    def _load(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy vLLM's stream of checkpoint tensors (transformers' names) into the model;
        ``CheckpointError`` naming what is misshapen, unexpected or missing."""
        load_llama_weights(self.model, weights)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        """vLLM's text-generation interface asks for it; our steps embed inside the model."""
        return self.model.embed_tokens(input_ids)
