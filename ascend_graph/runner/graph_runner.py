"""The graph runner: each step as a captured graph of its capture size, or eagerly, on one cache.

The runner owns the model, the tuple KV caches and one compiled step per capture size. A
decode-only batch of ``n <= max(capture_sizes)`` rows runs as the graph of the smallest capture
size ``>= n`` (padded rows write only into the null block; their outputs are dropped). Everything
else runs the same model eagerly on the same cache tensors, and the reason is counted. How a
capture size is compiled (torch.compile's ``dynamic``, static marks) is its backend's recipe
(``compile.recipe``).

Shape legend: T tokens in the step, n sequences in it, s capture size, M block-table width,
V vocabulary.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
import warnings
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from ..attention import (AttentionMetadata, build_attention_metadata, choose_block_size,
                         model_attention_backends)
from ..attention.metadata import metadata_to, with_host_lens
from ..compile.recipe import mark_step_inputs_static
from ..config import GraphConfig
from ..distributed import dp_step, get_parallel_state
from ..kv_cache import allocate_kv_caches
from ..runtime import StaticAddresses, compile_cache_counts, compile_cache_outcome, memory_in_use, progress
from .decode_inputs import check_decode_inputs, decode_steps
from .freezing import freezing
from .lockstep import agreeing_compile, check_same_settings, drop_sizes_missing_elsewhere, execute_dp
from .groups import CompileGroup, compile_groups, compile_recipe_for, resolve_compile_options
from .parity import ParitySampler, sampled_parity_check
from .static_inputs import StaticInputs
from .step import (DecodeStep, GraphCompileError, GraphCompileWarning, PreparedStep, RecompileError, RunnerStats,
                   SequenceStep, step_for_size, step_logits, unpermute)

log = logging.getLogger(__name__)


class GraphRunner:
    """Runs decode steps as per-size graphs and everything else eagerly, on one set of caches."""

    def __init__(self, model: nn.Module, config: GraphConfig, *, num_blocks: int, max_model_len: int,
                 block_size: Optional[int] = None, device: torch.device | str | None = None,
                 backend: Optional[Callable] = None, cache_align_bytes: int = 0) -> None:
        self.model = model
        self.config = config
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.compile_options = resolve_compile_options(model, config, self.device, backend)
        self.recipe = compile_recipe_for(config, self.device, backend)
        backends = model_attention_backends(model)
        self._attention_backends = backends
        self.block_size = choose_block_size(backends, block_size)
        # whether a backend reads the context lengths as host ints (decided with the block size)
        self._host_lens = any(b.host_context_lens for b in backends)
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.table_width = math.ceil(max_model_len / self.block_size)
        self.capture_sizes = config.resolved_capture_sizes() if config.enabled else ()
        self.compile_groups: dict[int, CompileGroup] = compile_groups(self.capture_sizes, self.compile_options.dynamic_batch)
        self.kv_caches = allocate_kv_caches(model.kv_cache_specs(), num_blocks, self.block_size, self.device,
                                            align_bytes=cache_align_bytes, huge_pages=self.device.type == "cpu")
        self.stats = RunnerStats()
        self._backend = backend
        # Device graphs (CUDA graphs, NPU graphs) replay into one output buffer, so a step's logits
        # are copied out; the CPU backends this runner resolves itself (Inductor, AOTInductor)
        # allocate their outputs per call (tests/test_runner.py checks it), a user's may not.
        self._copy_logits = not (self.device.type == "cpu" and backend is None)
        self._graphs: dict[int, Callable] = {}
        self._shared: dict[CompileGroup, tuple[Callable, Optional[str]]] = {}  # compiled group -> (graph, cache)
        self._warm = False
        self._recapture_base: dict[str, int] = {}
        self._parity = ParitySampler(config.parity_interval)
        self._step = DecodeStep(model)
        self.static = StaticInputs(max(self.capture_sizes, default=0), self.table_width, self.device)
        self._addresses = StaticAddresses()
        self._addresses.track(self._cache_tensors_by_name())
        self._addresses.track(self.static.by_name())
        # the ranks' common decisions (``lockstep``); ``_dp_plan``: the step the DP ranks agreed on
        self.parallel, self._dp_plan = get_parallel_state(), None
        check_same_settings(self)

    # -- public API -----------------------------------------------------------------------

    def execute(self, seqs: Sequence[SequenceStep], *, mode: str = "auto") -> Tensor:
        """Run one step; returns ``[n, V]`` float32 logits of each sequence's last new token.

        ``mode`` is ``"auto"`` (graph when the batch allows it), ``"graph"`` or ``"eager"``. Under
        data parallel every rank calls it each step (``lockstep``); ``seqs`` empty: an idle rank.
        """
        if mode not in ("auto", "graph", "eager"):
            raise ValueError(f"mode must be 'auto', 'graph' or 'eager', got {mode!r}")
        if self.parallel.dp.size > 1:
            return execute_dp(self, seqs, mode)
        step = self.prepare(seqs)
        return self.run_counted(step, *self._graph_size(step.meta.num_decode_tokens, step.meta.is_decode_only, mode))

    def run_counted(self, step: PreparedStep, size: Optional[int], reason: str) -> Tensor:
        """``step`` as the graph of ``size``, or eagerly (None) counted under ``reason``; a step
        that ``parity_interval`` samples is also checked against eager."""
        if size is None:
            self.stats.eager_steps[reason] += 1
            return self.run_prepared(step, "eager")
        self.stats.graph_steps += 1
        return sampled_parity_check(self, step) if self._parity.due() else self.run_prepared(step, "graph")

    def backends(self) -> dict:
        """What computes a step: the model's attention and MoE backends (the same in eager and
        graph steps) and the compiled-only rewrites of its graphs, which parity covers (none with
        graph mode off or a caller's own compile backend)."""
        named = getattr(self.model, "backends", None)
        out = dict(named()) if callable(named) else {}
        out["compiled_only_rewrites"] = []
        if self.config.enabled and self._backend is None:
            from ..compile import backend_name, detect_platform
            from ..compile.inductor import compiled_only_rewrites

            platform = detect_platform(self.device)
            if backend_name(self.config, platform) == "inductor":
                out["compiled_only_rewrites"] = compiled_only_rewrites(platform)
        return out

    def execute_decode(self, token_ids: Tensor, context_lens: Tensor, block_tables: Tensor,
                       slot_mapping: Tensor) -> Tensor:
        """A decode-only step given as tensors (``decode_inputs``: their contract and checks);
        ``[n, V]`` logits as ``execute``. As a graph, the tensors are copied into the static inputs
        as they are (no ``SequenceStep``s, no metadata rebuilt); what the graphs do not take (graph
        mode off, oversize, a failed compile, ``parity_interval`` on) runs ``execute`` on the same values."""
        ids, lens = check_decode_inputs(token_ids, context_lens, block_tables, slot_mapping,
                                        vocab=self.model.config.vocab_size, max_model_len=self.max_model_len,
                                        num_blocks=self.num_blocks, block_size=self.block_size)
        n = len(ids)
        size, _ = self._graph_size(n, True, "auto")
        if size is None or self.config.parity_interval or self.parallel.dp.size > 1:
            return self.execute(decode_steps(ids, lens, block_tables, self.block_size))
        self.stats.graph_steps += 1
        self._addresses.check()
        self.static.fill({"input_ids": token_ids, "positions": context_lens - 1, "slot_mapping": slot_mapping,
                          "block_tables": block_tables[:, :self.table_width], "context_lens": context_lens}, n, size)
        return self._call_graph(size, n, tuple(lens) if self._host_lens else None)

    def run_prepared(self, step: "PreparedStep", mode: str) -> Tensor:
        """Run a prepared step as ``"graph"`` or ``"eager"``, uncounted (parity uses this)."""
        self._addresses.check()
        plan = self._dp_plan
        if mode == "eager":
            with dp_step(plan.tokens) if plan else contextlib.nullcontext():
                return self._run_eager(step)
        return self._run_graph(step, plan.size if plan else self._graph_size(step.meta.num_decode_tokens,
                                                                            step.meta.is_decode_only, "graph")[0])

    def capture(self, show_progress: bool = True) -> None:
        """Compile and warm up every capture size, largest first; record time and memory."""
        if not self.config.enabled or self._warm:
            return
        # torchair's graph cache compiles through its own entry point, not a torch.compile backend
        backend = None if self._uses_torchair_graph_cache() else self._counting_backend(self._resolve_backend())
        self._recapture_base = self.recipe.recapture_baseline()
        sizes = sorted(self.capture_sizes, reverse=True)
        if backend is not None and self.parallel.world_size > 1:
            backend = agreeing_compile(backend, self.parallel, "a decode graph")
        for i, size in enumerate(sizes):
            if show_progress:
                progress(i, len(sizes), f"capturing graph for batch size {size}")
            self._capture_size(size, backend)
        drop_sizes_missing_elsewhere(self)
        if show_progress:
            progress(len(sizes), len(sizes), "captured")
        self._warm = True

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """Capture sizes that have a working graph."""
        return tuple(sorted(self._graphs))

    # -- preparation ----------------------------------------------------------------------

    def prepare(self, seqs: Sequence[SequenceStep]) -> "PreparedStep":
        """Validate a batch on the host and build its inputs (decode rows first)."""
        if not seqs:
            raise ValueError("seqs must hold at least one SequenceStep")
        vocab = self.model.config.vocab_size
        for i, s in enumerate(seqs):
            if not s.token_ids or any(not 0 <= t < vocab for t in s.token_ids):
                raise ValueError(f"seqs[{i}].token_ids must be non-empty ids in [0, {vocab}), "
                                 f"got {list(s.token_ids)[:8]}")
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids) > 1)  # decodes first
        rows = [seqs[i] for i in order]
        positions, meta = build_attention_metadata(
            [r.block_table for r in rows], [r.num_cached for r in rows], [len(r.token_ids) for r in rows],
            block_size=self.block_size, num_blocks=self.num_blocks, max_model_len=self.max_model_len,
            block_table_width=self.table_width, device="cpu", host_context_lens=self._host_lens)
        ids = [t for r in rows for t in r.token_ids]
        last = [end - 1 for end in itertools.accumulate(len(r.token_ids) for r in rows)]
        both = torch.tensor(ids + last, dtype=torch.int64)  # one conversion, two views
        return PreparedStep(both[:len(ids)], positions, meta, order, both[len(ids):])

    def graph_size(self, seqs: Sequence[SequenceStep]) -> Optional[int]:
        """The capture size ``execute(seqs)`` would run as a graph, or ``None`` when it runs eagerly."""
        n_decode = sum(1 for s in seqs if len(s.token_ids) == 1)
        return self._graph_size(n_decode, n_decode == len(seqs), "auto")[0]

    def _graph_size(self, n: int, decode_only: bool, mode: str) -> tuple[Optional[int], str]:
        """``(capture size, "")`` for a batch of ``n`` decode rows that runs as a graph, else
        ``(None, reason)``; ``mode="graph"`` raises instead of returning a reason."""
        if mode == "eager":
            return None, "forced"
        if not decode_only:
            reason = "mixed" if n else "prefill"
        elif not self.config.enabled:
            reason = "disabled"
        elif n > max(self.capture_sizes):
            reason = "oversize"
        else:
            self.capture()
            size = min(s for s in self.capture_sizes if s >= n)
            if size in self._graphs:
                return size, ""
            reason = "compile_failed"
        if mode == "graph":
            raise ValueError(f"mode='graph' is impossible for this batch: {reason}")
        return None, reason

    # -- eager ----------------------------------------------------------------------------

    def _run_eager(self, step: PreparedStep) -> Tensor:
        dev = self.device
        meta = metadata_to(step.meta, dev)
        with torch.inference_mode():
            ids, pos, caches = step.input_ids.to(dev), step.positions.to(dev), self.kv_caches
            logits = step_logits(self.model, self.model(ids, pos, caches, meta), step.last.to(dev), ids, pos, caches, meta)
        self._count_attention_fallbacks()
        return unpermute(logits, step.order)

    def _count_attention_fallbacks(self) -> None:
        """``stats.attention_fallbacks``: per reason, the most calls any one layer's backend sent there."""
        for backend in self._attention_backends:
            for reason, n in backend.fallbacks().items():
                self.stats.attention_fallbacks[reason] = max(n, self.stats.attention_fallbacks.get(reason, 0))

    # -- graph ----------------------------------------------------------------------------

    def _run_graph(self, step: PreparedStep, size: int) -> Tensor:
        n = step.meta.num_decode_tokens
        live = {"input_ids": step.input_ids, "positions": step.positions, "slot_mapping": step.meta.slot_mapping,
                "block_tables": step.meta.decode.block_tables, "context_lens": step.meta.decode.context_lens}
        self.static.fill(live, n, size)
        return unpermute(self._call_graph(size, n, step.meta.decode.context_lens_host), step.order)

    def _call_graph(self, size: int, n: int, host_lens: Optional[tuple[int, ...]]) -> Tensor:
        """The graph of capture size ``size`` over the static inputs; the first ``n`` rows' logits."""
        ids_v, pos_v, meta_v = self._views(size)
        meta_v = with_host_lens(meta_v, host_lens, size)
        self.stats.graph_sizes_run[size] += 1
        try:
            with torch.inference_mode():
                logits = self._graphs[size](ids_v, pos_v, self.kv_caches, meta_v)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if isinstance(e.inner_exception, RecompileError):
                raise e.inner_exception from None
            raise
        if self.recipe.recapture_counts is not None:
            self.stats.recaptures = self.recipe.recaptures_since(self._recapture_base)
        return logits[:n].clone() if self._copy_logits else logits[:n]

    def _capture_size(self, size: int, backend: Optional[Callable]) -> None:
        start, mem0, cache0, loaded0 = (time.perf_counter(), memory_in_use(self.device), compile_cache_counts(),
                                        self.stats.packages_loaded)
        ids_v, pos_v, meta_v = self._views(size)
        meta_v = with_host_lens(meta_v, () if self._host_lens else None, size)
        self.static.pad(size)
        group = self.compile_groups[size]
        step_inputs = [ids_v, pos_v, meta_v.slot_mapping, meta_v.decode.block_tables, meta_v.decode.context_lens]
        if self.recipe.mark_static:
            mark_step_inputs_static(step_inputs, self.kv_caches)
        frozen_inputs = [*step_inputs, *self._cache_tensors_by_name().values()]
        try:
            compiled = self._compile_for_size(size, backend)
            with torch.inference_mode(), freezing(self.config.inductor.freezing_min_batch, size, frozen_inputs):
                for _ in range(2):  # compile, then a warm run (device graphs record on it)
                    compiled(ids_v, pos_v, self.kv_caches, meta_v)
        except Exception as e:  # noqa: BLE001 - any compiler error falls back or is re-raised
            if group.dynamic:  # e.g. the model chose by row count inside the range: compile each size alone
                self._compile_failed(group.label, e, f"the shared compile of sizes {group.label} failed, "
                                                     "they compile one by one")
                self.stats.capture_seconds += time.perf_counter() - start
                self._split_group(group)
                return self._capture_size(size, backend)
            fallback = self.config.fallback_on_compile_error
            error = self._compile_failed(size, e, f"compiling capture size {size} failed, that size runs eagerly"
                                         if fallback else None)
            if not fallback:
                raise GraphCompileError(f"compiling capture size {size} failed: {error}") from e
            return
        seconds = time.perf_counter() - start
        self._graphs[size] = compiled
        self.stats.capture_seconds += seconds
        if group in self._shared:  # compiled with another size of its group: that compile's outcome
            cache = self._shared[group][1]
        else:
            from_files = self.config.inductor.aot or self.compile_options.precompile  # packages, precompiled steps
            cache = (("hit" if self.stats.packages_loaded > loaded0 else "miss") if from_files
                     else compile_cache_outcome(cache0))
            if group.dynamic:
                self._shared[group] = (compiled, cache)
        self.stats.capture[size] = {"seconds": round(seconds, 3), "memory_bytes": memory_in_use(self.device) - mem0,
                                    "compile_cache": cache, "compile_group": group.label}

    def _compile_failed(self, key: int | str, e: Exception, fallback: Optional[str]) -> str:
        """Count a failed compile of ``key`` (a capture size, or a compile group's label) and keep
        its ``"ExceptionType: message"`` (the compiler's own exception, not dynamo's wrapper) in
        ``stats.compile_errors``; warn ``fallback`` with it (``GraphCompileWarning``), unless None
        (the caller raises). Returns that text."""
        inner = e.inner_exception if isinstance(e, torch._dynamo.exc.BackendCompilerFailed) else e
        error = f"{type(inner).__name__}: {inner}"
        self.stats.compile_failures += 1
        self.stats.compile_errors[key] = error
        if fallback is not None:
            warnings.warn(GraphCompileWarning(f"{fallback}: {error}"), stacklevel=2)
        return error

    def _compile_for_size(self, size: int, backend: Optional[Callable]) -> Callable:
        if self.config.inductor.aot:
            from ..compile.aot_inductor import load_or_compile

            ids_v, pos_v, meta_v = self._views(size)
            model, compiled = load_or_compile(self._step, f"decode_step_{size}", (ids_v, pos_v, self.kv_caches, meta_v),
                                              self.config, "cpu", on_compile=self._count_compile)
            self.stats.packages_loaded += not compiled
            return model
        group = self.compile_groups[size]
        if group in self._shared:
            return self._shared[group][0]
        method = step_for_size(self._step, group.label)
        if self.compile_options.precompile:
            from ..compile.precompile import load_or_precompile

            ids_v, pos_v, meta_v = self._views(size)
            compiled, loaded = load_or_precompile(method, self._step, (ids_v, pos_v, self.kv_caches, meta_v),
                                                  self.config, self._resolve_backend(), backend)
            self.stats.packages_loaded += loaded
            return compiled
        if self._uses_torchair_graph_cache():
            from ..compile.torchair import cache_compile
            return cache_compile(method, self.config, dynamic=self.recipe.dynamic)
        return torch.compile(method, backend=backend, fullgraph=True, dynamic=self.recipe.dynamic)

    def _split_group(self, group: CompileGroup) -> None:
        """Give each size of a failed compile group that has no graph yet its own static compile."""
        for s in [s for s, g in self.compile_groups.items() if g == group and s not in self._graphs]:
            self.compile_groups[s] = CompileGroup(s, s)
            self.static.forget_views(s)  # new views of the same buffers, without the dynamic marks

    def _uses_torchair_graph_cache(self) -> bool:
        if self._backend is not None or not self.config.torchair.use_cached_graph:
            return False
        from ..compile import backend_name, detect_platform
        return backend_name(self.config, detect_platform(self.device)) == "torchair"

    def _resolve_backend(self) -> Callable:
        if self._backend is not None:
            return self._backend
        from ..compile import resolve_backend
        return resolve_backend(self.config, self.device)

    def _counting_backend(self, backend: Callable) -> Callable:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: list, **kwargs):
            self._count_compile()
            return backend(gm, example_inputs, **kwargs)
        return compile_graph

    def _count_compile(self) -> None:
        self.stats.compiles += 1
        if self._warm:
            self.stats.recompiles += 1
            msg = (f"a captured step compiled again after warm-up (recompile #{self.stats.recompiles}); "
                   "an input's shape, dtype, device or address changed")
            if self.config.on_recompile == "error":
                raise RecompileError(msg)
            log.warning(msg)

    # -- static inputs --------------------------------------------------------------------

    def _views(self, size: int) -> tuple[Tensor, Tensor, AttentionMetadata]:
        return self.static.views(size, self.compile_groups.get(size))

    def _cache_tensors_by_name(self) -> dict[str, Tensor]:
        named = {}
        for i, cache in enumerate(self.kv_caches):
            for name, t in zip(cache._fields, cache):
                torch._dynamo.mark_static_address(t)
                named[f"kv_caches[{i}].{name}"] = t
        return named
