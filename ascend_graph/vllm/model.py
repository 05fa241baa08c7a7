"""The model classes graph mode switches a checkpoint to: their shared base and DeepSeek's
(prototype; docs/vllm.md; Llama's are in ``vllm/llama.py``).

vLLM keeps its scheduler, block pool, sampler and weight streaming; the forward pass is
ascend_graph's model (here ``DeepseekForCausalLM``) run by a ``GraphRunner``: decode-only batches up to the
largest capture size as per-size graphs over the tuple caches, everything else eagerly on the
same caches. vLLM calls ``forward`` with the step's flattened tokens under its forward context,
whose metadata (``layer.TupleCacheMetadataBuilder``) gives each request's query span, sequence
length, block table and slots. A decode-only step (one token per request) passes those tensors
to ``GraphRunner.execute_decode``; any other becomes the runner's ``SequenceStep``s. ``forward`` returns
``[T, V]`` logits with each request's row at its last token (the rows vLLM samples; in a
decode-only step, one token per request, the runner's ``[n, V]`` logits themselves), and
``compute_logits`` passes them through.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context

from ..models import DeepseekConfig, DeepseekForCausalLM
from ..models.loader import CheckpointError, _check_complete, _piece, _target
from ..pd.identity import model_identity
from ..runner import GraphRunner, RunnerStats
from ..runtime import weights_on_huge_pages
from .flags import moe_kernel, parse_additional_config
from .layer import TupleCacheLayer
from .moe import use_vllm_fused_moe
from .steps import logits_at_last_tokens, sequence_steps


class AscendGraphForCausalLM(nn.Module):
    """What every architecture shares inside vLLM: the flag, the stand-in cache layers, the step.

    A subclass builds ascend_graph's model (``_build_model``: ``(config, model)``, the model
    with ``kv_cache_specs()`` and the runner's step contract) and copies vLLM's weight stream
    into it (``_load``).
    """

    checkpoint_architecture: str
    # Decode-only steps through ``GraphRunner.execute_decode`` (False: as ``SequenceStep``s, the
    # form ``benchmarks.vllm_decode_inputs`` compares against).
    decode_as_tensors: bool = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config, self.model = self._build_model(vllm_config)
        self.graph_config = parse_additional_config(
            vllm_config.additional_config, max_num_seqs=vllm_config.scheduler_config.max_num_seqs)
        self.moe_kernel = moe_kernel(vllm_config.additional_config)
        self.cache_layers = nn.ModuleList(
            TupleCacheLayer(vllm_config, f"{prefix}model.layers.{i}.self_attn.attn", spec)
            for i, spec in enumerate(self.model.kv_cache_specs()))
        identity = functools.partial(model_identity, self.model)  # called once weights are loaded
        for i, layer in enumerate(self.cache_layers):
            layer.tuple_cache = functools.partial(self._layer_cache, i)
            layer.model_identity = identity
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = vllm_config.model_config.max_model_len
        self.runner: Optional[GraphRunner] = None

    def _build_model(self, vllm_config: VllmConfig) -> tuple[Any, nn.Module]:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Fill the model from vLLM's stream of checkpoint tensors (``_load``), then move its CPU
        weights onto huge pages, as the Engine's loader does (decode streams them faster), and,
        with ``moe_kernel`` "vllm", pack the routed experts for vLLM's fused-MoE kernel."""
        self._load(weights)
        weights_on_huge_pages(self.model)  # moves CPU tensors only
        if self.moe_kernel == "vllm":
            use_vllm_fused_moe(self.model)
        return None  # vLLM's strict check compares parameter names, which ours do not share

    def _load(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        raise NotImplementedError

    def forward(self, input_ids: Tensor, positions: Tensor, intermediate_tensors: Any = None,
                inputs_embeds: Optional[Tensor] = None, **kwargs: Any) -> Tensor:
        meta = self._metadata()
        if meta is None:  # vLLM's profiling and dummy runs, before the caches exist
            return torch.zeros(input_ids.shape[0], self.config.vocab_size, dtype=torch.float32)
        n = meta.num_reqs
        if meta.num_actual_tokens == n and self.decode_as_tensors:  # decode-only: vLLM's tensors go to the graph's inputs as they are
            return self._runner().execute_decode(input_ids[:n], meta.seq_lens[:n], meta.block_table_tensor[:n],
                                                 meta.slot_mapping[:n])  # [n, V]
        token_ids = input_ids.tolist()
        logits = self._runner().execute(sequence_steps(token_ids, meta, self.block_size))  # [n, V]
        return logits_at_last_tokens(logits, meta, len(token_ids))  # [T, V]

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        """vLLM's text-generation interface asks for it; our steps embed inside the model."""
        return self.model.model.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """``forward`` already returns logits: vLLM's selected rows pass through."""
        return hidden_states

    def runner_stats(self) -> dict:
        """The runner's counters (all zero before the first step)."""
        return (self.runner.stats if self.runner is not None else RunnerStats()).to_dict()

    def _metadata(self) -> Any:
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):
            raise NotImplementedError("ascend_graph's graph mode does not run vLLM's micro-batches (ubatching)")
        if not isinstance(metadata, dict) or self.cache_layers[0].layer_name not in metadata:
            return None
        if self.cache_layers[0].num_blocks is None:
            return None
        return metadata[self.cache_layers[0].layer_name]

    def _layer_cache(self, index: int) -> Any:
        """Layer ``index``'s cache tuple in the runner (built here if no step has built it yet)."""
        if self.cache_layers[0].num_blocks is None:
            raise RuntimeError("the tuple caches exist once vLLM has bound its KV blocks")
        return self._runner().kv_caches[index]

    def _runner(self) -> GraphRunner:
        if self.runner is None:
            self.runner = GraphRunner(self.model, self.graph_config, num_blocks=self.cache_layers[0].num_blocks,
                                      block_size=self.block_size, max_model_len=self.max_model_len)
        return self.runner


class AscendGraphDeepseekV2ForCausalLM(AscendGraphForCausalLM):
    """DeepSeek V2 (MLA) served by ascend_graph's model and graph runner inside vLLM."""

    checkpoint_architecture = "DeepseekV2ForCausalLM"

    def _build_model(self, vllm_config: VllmConfig) -> tuple[DeepseekConfig, DeepseekForCausalLM]:
        hf = vllm_config.model_config.hf_config.to_dict()
        config = DeepseekConfig.from_dict({**hf, "architectures": [self.checkpoint_architecture]})
        return config, DeepseekForCausalLM(config, dtype=vllm_config.model_config.dtype, device="cpu",
                                           init_weights=False)

    def _load(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy vLLM's stream of checkpoint tensors into the model (names as the checkpoint's);
        ``CheckpointError`` naming what is misshapen, unexpected or missing."""
        state, filled, unexpected = self.model.state_dict(), set(), []
        for name, tensor in weights:
            target = _target(name, self.config)
            if target is None:
                continue
            if target.name not in state:
                unexpected.append(name)
                continue
            piece = _piece(state[target.name], target)
            if tuple(tensor.shape) != tuple(piece.shape):
                raise CheckpointError(f"tensor {name} has shape {list(tensor.shape)}, the model expects "
                                      f"{list(piece.shape)}")
            piece.copy_(tensor)
            filled.add(name)
        _check_complete(self.model, filled, unexpected)
        self.model.process_weights_after_loading()


class AscendGraphDeepseekV3ForCausalLM(AscendGraphDeepseekV2ForCausalLM):
    """DeepSeek V3 (MLA, query low-rank, ``noaux_tc`` routing) inside vLLM."""

    checkpoint_architecture = "DeepseekV3ForCausalLM"
