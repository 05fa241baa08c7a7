"""The model classes graph mode switches a checkpoint to: their shared base and DeepSeek's
(prototype; docs/vllm.md; Llama's are in ``vllm/llama.py``).

vLLM keeps its scheduler, block pool, sampler and weight streaming; the forward pass is
ascend_graph's model (here ``DeepseekForCausalLM``) run by a ``GraphRunner``: decode-only batches up to the
largest capture size as per-size graphs over the tuple caches, everything else eagerly on the
same caches. The runner is built, and every capture size captured, when vLLM binds the KV
caches (``TupleCacheLayer.bind_kv_cache``, in the worker's ``initialize_from_config``), before
any request.

vLLM calls ``forward`` with the step's flattened tokens under its forward context, whose
metadata (``layer.TupleCacheMetadataBuilder``) gives each request's query span, sequence
length, block table and slots. A decode-only step (one token per request) passes those tensors
to ``GraphRunner.execute_decode``; any other becomes the runner's ``SequenceStep``s. Either gives
``[R, V]`` logits, one row per request, which the model keeps; ``forward`` returns
``steps.token_rows`` (``[T, 2]``: which logits row each token has, if any) and
``compute_logits`` maps vLLM's selection of it back to those logits (``steps.select_logits``).
vLLM's dummy runs (``GPUModelRunner._dummy_run``) set no attention metadata: they run nothing
and have no logits. Any other forward without this model's metadata raises.

With ``speculative_config`` (method ``"mtp"``, k tokens) vLLM's own MTP drafter drafts and vLLM
verifies: the capture sizes count requests of ``1 + k`` rows (``verify_config``, as the Engine's),
each step is laid out by ``steps.speculative_rows`` (logits at every token of a verify request),
and ``get_mtp_target_hidden_states`` hands the drafter the target's hidden state at every token.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context

from ..engine.speculative import verify_config
from ..models import DeepseekConfig, DeepseekForCausalLM
from ..models.loader import CheckpointError, _check_complete, _piece, _target
from ..pd.identity import model_identity
from ..runner import GraphRunner, RunnerStats
from ..runtime import weights_on_huge_pages
from .flags import moe_kernel, parse_additional_config, platform_name, runs_graph_mode
from .layer import TupleCacheLayer
from .moe import use_vllm_fused_moe
from .parallel import adopt_vllm_groups, graph_config_for
from .steps import select_logits, sequence_steps, speculative_rows, token_rows


class AscendGraphForCausalLM(nn.Module):
    """What every architecture shares inside vLLM: the flag, the stand-in cache layers, the step.

    A subclass builds ascend_graph's model (``_build_model``: ``(config, model)``, the model
    with ``kv_cache_specs()`` and the runner's step contract; at tensor_parallel_size > 1 this
    worker's share over ``self.parallel``, vLLM's groups) and copies vLLM's weight stream into
    it (``_load``: vLLM streams the full tensors to every worker; each keeps its share).
    """

    checkpoint_architecture: str
    # Decode-only steps through ``GraphRunner.execute_decode`` (False: as ``SequenceStep``s, the
    # form before; docs/vllm.md says how to compare the two by hand).
    decode_as_tensors: bool = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        _check_platform()
        self.parallel = adopt_vllm_groups(vllm_config)  # before the model: its layers hold the groups
        self.config, self.model = self._build_model(vllm_config)
        self.graph_config = graph_config_for(parse_additional_config(
            vllm_config.additional_config, max_num_seqs=vllm_config.scheduler_config.max_num_seqs), self.parallel)
        self.moe_kernel = moe_kernel(vllm_config.additional_config, self.parallel.config.enable_expert_parallel)
        speculative = vllm_config.speculative_config
        self.speculative_tokens = speculative.num_speculative_tokens if speculative is not None else 0
        if self.speculative_tokens:  # plugin._check_supported let only method "mtp" through
            self.graph_config = verify_config(self.graph_config, self.speculative_tokens)
            self.model.returns_hidden = True
        self.cache_layers = nn.ModuleList(
            TupleCacheLayer(vllm_config, f"{prefix}model.layers.{i}.self_attn.attn", spec)
            for i, spec in enumerate(self.model.kv_cache_specs()))
        identity = functools.partial(model_identity, self.model)  # called once weights are loaded
        for i, layer in enumerate(self.cache_layers):
            layer.tuple_cache = functools.partial(self._layer_cache, i)
            layer.model_identity = identity
            layer.on_bound = self._caches_bound
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = vllm_config.model_config.max_model_len
        self.runner: Optional[GraphRunner] = None
        self._forwards = 0  # forwards so far: the serial number in token_rows
        self._logits: Optional[Tensor] = None  # the latest forward's [R, V]; None after a dummy run
        self._hidden: Optional[Tensor] = None  # with speculation: its hidden states [T, E], vLLM's token order
        self._forward_name = "no forward yet"

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
        """Run the step; keep its ``[R, V]`` logits for ``compute_logits`` and return its
        ``steps.token_rows`` ``[T, 2]``. A dummy run runs nothing and keeps no logits."""
        self._forwards += 1
        self._logits = self._hidden = None
        self._forward_name = f"forward {self._forwards}"
        if input_ids is None:
            raise ValueError("ascend_graph's graph mode takes input_ids; got None (prompt embeddings: not supported)")
        meta = self._metadata()
        if meta is None:
            self._forward_name = f"vLLM's dummy run (forward {self._forwards}: no attention metadata)"
            return token_rows(input_ids.shape[0], self._forwards)
        n = meta.num_reqs
        if self.speculative_tokens:
            return token_rows(input_ids.shape[0], self._forwards, rows=self._speculative_step(input_ids, meta))
        if meta.num_actual_tokens == n and self.decode_as_tensors:  # decode-only: vLLM's tensors go to the graph's inputs as they are
            self._logits = self.runner.execute_decode(input_ids[:n], meta.seq_lens[:n],
                                                      meta.block_table_tensor[:n], meta.slot_mapping[:n])
        else:
            self._logits = self.runner.execute(sequence_steps(input_ids.tolist(), meta, self.block_size))
        return token_rows(input_ids.shape[0], self._forwards, meta)

    def _speculative_step(self, input_ids: Tensor, meta: Any) -> Tensor:
        """A step under speculative decoding (``steps.speculative_rows``): keeps its logits and its
        hidden states at every token; returns each token's logits row."""
        layout = speculative_rows(input_ids[:meta.num_actual_tokens].tolist(), meta, self.block_size,
                                  self.speculative_tokens)
        vocab = self.config.vocab_size
        if layout.decode is not None:  # every token a decode row: the graphs take it
            lens, request = layout.decode
            total = len(lens)
            out = self.runner.execute_decode(input_ids[:total], lens, meta.block_table_tensor[request],
                                             meta.slot_mapping[:total])
            hidden = out[:, vocab:]  # rows in vLLM's token order: no gather on the decode path
        else:  # a prompt: run eagerly, its hidden states read whole off the model's body
            kept = []
            hook = self.model.model.register_forward_hook(lambda module, args, output: kept.append(output))
            try:
                out = self.runner.execute(layout.seqs)
            finally:
                hook.remove()
            hidden = kept[-1][layout.order]
        self._logits = out[:, :vocab]
        self._hidden = hidden.to(self.model.dtype)
        return layout.rows

    def get_mtp_target_hidden_states(self) -> Tensor:
        """The latest forward's hidden states at every token (``[T, E]``, vLLM's token order): what
        vLLM's MTP drafter reads in place of ``forward``'s output (``GPUModelRunner``'s hook)."""
        if self._hidden is None:
            raise RuntimeError(f"vLLM's drafter asked for the target's hidden states of {self._forward_name}, "
                               "which has none: only a step under speculative decoding keeps them")
        return self._hidden

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        """vLLM's text-generation interface asks for it; our steps embed inside the model."""
        return self.model.model.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """The latest forward's logits at the rows vLLM selected (``forward(...)[logits_indices]``):
        ``[k, V]``; the runner's own tensor where those are its rows in order (decode steps)."""
        return select_logits(hidden_states, self._logits, self._forwards, self._forward_name)

    def runner_stats(self) -> dict:
        """The runner's counters (all zero before vLLM binds the caches, when it captures), with
        this worker's place under ``"parallel"`` (``parallel_layout()``, or the TP rank and size)
        and which all-reduce its steps run (``ParallelState.collectives``), and the bytes of vLLM's
        KV buffer kept beside the runner's caches (``TupleCacheLayer.kept_bytes``; 0 without a drafter)."""
        stats = (self.runner.stats if self.runner is not None else RunnerStats()).to_dict()
        layout = getattr(self.model, "parallel_layout", None)
        place = layout() if layout is not None else {"tp_size": self.parallel.tp.size, "tp_rank": self.parallel.tp.rank}
        kept = max(layer.kept_bytes for layer in self.cache_layers)  # one buffer: every layer's view of it
        return stats | {"parallel": place | {"collectives": self.parallel.collectives},
                        "vllm_kv_buffer_kept_bytes": kept}

    def _metadata(self) -> Any:
        """This step's metadata: ``None`` where vLLM passes none (its dummy runs: ``_dummy_run``
        sets ``attn_metadata=None`` unless it captures full device graphs); else an error naming
        what is missing."""
        metadata = get_forward_context().attn_metadata
        if metadata is None:
            return None
        if isinstance(metadata, list):
            raise NotImplementedError("ascend_graph's graph mode does not run vLLM's micro-batches (ubatching)")
        name = self.cache_layers[0].layer_name
        if not isinstance(metadata, dict) or name not in metadata:
            held = sorted(metadata)[:4] if isinstance(metadata, dict) else type(metadata).__name__
            raise RuntimeError(f"vLLM's forward context has no attention metadata for layer {name!r} (it holds "
                               f"{held}): this model's stand-in layers were not in the step")
        if self.runner is None:  # built once every layer is bound
            unbound = [layer.layer_name for layer in self.cache_layers if layer.num_blocks is None]
            raise RuntimeError(f"a step ran before vLLM bound the KV caches of layers {unbound[:4]}")
        return metadata[name]

    def _caches_bound(self) -> None:
        """Once vLLM has bound every layer's cache: build the runner and capture every size
        (vLLM's start-up, so no request pays it; ``runner_stats`` shows the time)."""
        counts = {layer.num_blocks for layer in self.cache_layers}
        if None in counts:
            return
        if len(counts) > 1 or (self.runner is not None and counts != {self.runner.num_blocks}):
            had = "none" if self.runner is None else self.runner.num_blocks
            raise RuntimeError(f"vLLM bound {sorted(counts)} blocks to the layers (the runner has {had}): "
                               "graph mode needs one block count, bound once")
        with torch.inference_mode():  # vLLM steps run in inference mode: the caches and graphs match it
            self._runner().capture(show_progress=False)

    def _layer_cache(self, index: int) -> Any:
        """Layer ``index``'s cache tuple in the runner (built once vLLM has bound the caches)."""
        if self.cache_layers[0].num_blocks is None:
            raise RuntimeError("the tuple caches exist once vLLM has bound its KV blocks")
        return self._runner().kv_caches[index]

    def _runner(self) -> GraphRunner:
        if self.runner is None:
            self.runner = GraphRunner(self.model, self.graph_config, num_blocks=self.cache_layers[0].num_blocks,
                                      block_size=self.block_size, max_model_len=self.max_model_len)
        return self.runner


def _check_platform() -> None:
    """Graph mode builds its model on the host: any other vLLM platform is an error naming it."""
    from vllm.platforms import current_platform

    if not runs_graph_mode(current_platform):
        raise RuntimeError(f"ascend_graph's graph mode runs on vLLM's CPU platform; the active platform is "
                           f"{platform_name(current_platform)}")


class AscendGraphDeepseekV2ForCausalLM(AscendGraphForCausalLM):
    """DeepSeek V2 (MLA) served by ascend_graph's model and graph runner inside vLLM."""

    checkpoint_architecture = "DeepseekV2ForCausalLM"

    def _build_model(self, vllm_config: VllmConfig) -> tuple[DeepseekConfig, DeepseekForCausalLM]:
        hf = vllm_config.model_config.hf_config.to_dict()
        config = DeepseekConfig.from_dict({**hf, "architectures": [self.checkpoint_architecture]})
        return config, DeepseekForCausalLM(config, dtype=vllm_config.model_config.dtype, device="cpu",
                                           init_weights=False, tp=self.parallel.tp, ep=self.parallel.ep)

    def _load(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy vLLM's stream of checkpoint tensors into the model (names as the checkpoint's),
        each cut to this worker's share (``tp_shard``; another expert-parallel rank's experts are
        skipped); ``CheckpointError`` naming what is misshapen, unexpected or missing."""
        state, filled, unexpected = self.model.state_dict(), set(), []
        for name, tensor in weights:
            target = _target(name, self.config, self.model.expert_range)
            if target is None:
                continue
            if target.name not in state:
                unexpected.append(name)
                continue
            tensor = self.model.tp_shard(name, tensor)
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
