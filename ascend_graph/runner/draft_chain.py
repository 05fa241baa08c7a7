"""A draft chain's steps (speculative decoding with ``num_speculative_tokens > 1``): the model's
``draft_step`` alone, one decode row per request, as per-size captured graphs over the runner's
caches, or eagerly, counted as the runner counts its steps.

A chain step's inputs are a verify step's plus the hidden states that drafted each row's token
(``hidden [n, E]`` float32, a static buffer of the graphs); it writes the MTP layer's cache only.
Its graphs compile with the runner's backend and recipe through ``torch.compile`` at every start:
AOTInductor packages and precompiled steps hold the runner's verify graphs, not these. A sampled
or (``Engine.parity``) every graph step is compared against eager with the runner's parity check.

Shape legend: n requests in the step, s capture size (requests), E hidden size, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from ..attention import AttentionMetadata
from ..attention.metadata import metadata_to, with_host_lens
from ..compile.recipe import mark_step_inputs_static
from ..runtime import memory_in_use
from .freezing import freezing
from .parity import ParityReport, ParitySampler, compare_prepared
from .static_inputs import StaticInputs
from .step import GraphCompileError, GraphCompileWarning, PreparedStep, RecompileError, RunnerStats, step_for_size

if TYPE_CHECKING:  # pragma: no cover
    from .graph_runner import GraphRunner
    from .step import SequenceStep


class DraftStep(nn.Module):
    """The captured unit of a chain step: the model's ``draft_step``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, positions: Tensor, hidden: Tensor, kv_caches: tuple,
                attn_metadata: AttentionMetadata) -> Tensor:
        """``[s]`` ids and positions, ``hidden [s, E]``, the caches, decode metadata -> ``[s, V + E]``."""
        return self.model.draft_step(input_ids, positions, hidden, kv_caches, attn_metadata)


@dataclass
class PreparedDraft(PreparedStep):
    hidden: Optional[Tensor] = None  # [n, E] float32, in batch order


class DraftChain:
    """Chain steps on ``runner``'s caches, as graphs of ``capture_sizes`` (requests) or eagerly.

    Duck-types what ``parity.compare_prepared`` reads of a runner, so a chain step is checked as a
    runner step is: logits and hidden columns, the MTP cache's written blocks, untouched blocks,
    routing near-ties of the MTP layer's router."""

    def __init__(self, runner: "GraphRunner", capture_sizes: Sequence[int]) -> None:
        self.runner, self.model, self.config = runner, runner.model, runner.config
        self.kv_caches, self.block_size, self.device, self.parallel = (runner.kv_caches, runner.block_size,
                                                                     runner.device, runner.parallel)
        self.capture_sizes = tuple(sorted(capture_sizes)) if self.config.enabled else ()
        self.stats = RunnerStats()
        self.static = StaticInputs(max(self.capture_sizes, default=0), runner.table_width, self.device)
        self.hidden = torch.zeros(max(self.capture_sizes, default=0), self.model.config.hidden_size,
                                  device=self.device)
        self._step = DraftStep(self.model)
        self._graphs: dict[int, Callable] = {}
        self._warm = False
        self._parity = ParitySampler(self.config.parity_interval)
        # Engine.parity: every graph step compared, each report handed to it with the step's requests' rows
        self.on_report: Optional[Callable[[ParityReport], None]] = None

    def execute(self, seqs: Sequence["SequenceStep"], hidden: Tensor) -> Tensor:
        """One chain step: one single-token ``SequenceStep`` per request and ``hidden [n, E]``
        float32 -> ``[n, V + E]`` in the caller's order."""
        if any(len(s.token_ids) != 1 for s in seqs):
            raise ValueError("a draft chain step takes one token per request")
        step = self.runner.prepare(seqs)  # decode rows only: the caller's order
        step = PreparedDraft(**{f.name: getattr(step, f.name) for f in dataclasses.fields(PreparedStep)},
                             hidden=hidden)
        size, reason = self._graph_size(len(seqs))
        if size is None:
            self.stats.eager_steps[reason] += 1
            return self.run_prepared(step, "eager")
        self.stats.graph_steps += 1
        self.stats.graph_sizes_run[size] += 1
        if self.on_report is None and not self._parity.due():
            return self.run_prepared(step, "graph")
        report = compare_prepared(self, step, check_untouched="digest")
        report.kind = "draft"
        self.stats.parity_checks += 1
        if not report.ok:
            self.stats.parity_failures += 1
            self.stats.last_parity_failure = report.summary()
            warnings.warn(f"draft chain graph/eager parity check failed: {report.summary()}", stacklevel=2)
        if self.on_report is not None:
            self.on_report(report)
        return report.graph_logits

    def run_prepared(self, step: PreparedDraft, mode: str) -> Tensor:
        """``step`` as ``"graph"`` or ``"eager"``, uncounted (parity uses this)."""
        n = len(step.order)
        if mode == "eager":
            meta, dev = metadata_to(step.meta, self.device), self.device
            with torch.inference_mode():
                return self._step(step.input_ids.to(dev), step.positions.to(dev), step.hidden.to(dev),
                                  self.kv_caches, meta)
        size = self._graph_size(n)[0]
        live = {"input_ids": step.input_ids, "positions": step.positions,
                "slot_mapping": step.meta.slot_mapping, "block_tables": step.meta.decode.block_tables,
                "context_lens": step.meta.decode.context_lens}
        self.static.fill(live, n, size)
        self.hidden[:n].copy_(step.hidden)
        self.hidden[n:size].zero_()
        ids_v, pos_v, meta_v = self.static.views(size, None)
        meta_v = with_host_lens(meta_v, step.meta.decode.context_lens_host, size)
        with torch.inference_mode():
            return self._graphs[size](ids_v, pos_v, self.hidden[:size], self.kv_caches, meta_v)[:n].clone()

    def backends(self) -> dict:
        return self.runner.backends()

    def capture(self) -> None:
        """Compile and warm up every capture size, largest first."""
        if self._warm or not self.capture_sizes:
            self._warm = True
            return
        backend = self.runner._resolve_backend()

        def counting(gm: torch.fx.GraphModule, example_inputs: list, **kwargs):
            self.stats.compiles += 1
            if self._warm:
                self.stats.recompiles += 1
                if self.config.on_recompile == "error":
                    raise RecompileError(f"a draft chain step compiled again after warm-up "
                                         f"(recompile #{self.stats.recompiles})")
            return backend(gm, example_inputs, **kwargs)

        for size in sorted(self.capture_sizes, reverse=True):
            self._capture_size(size, counting)
        self._warm = True

    def _graph_size(self, n: int) -> tuple[Optional[int], str]:
        if not self.config.enabled:
            return None, "disabled"
        if n > max(self.capture_sizes):
            return None, "oversize"
        self.capture()
        size = min(s for s in self.capture_sizes if s >= n)
        return (size, "") if size in self._graphs else (None, "compile_failed")

    def _capture_size(self, size: int, backend: Callable) -> None:
        start, mem0 = time.perf_counter(), memory_in_use(self.device)
        ids_v, pos_v, meta_v = self.static.views(size, None)
        meta_v = with_host_lens(meta_v, () if self.runner._host_lens else None, size)
        hidden_v = self.hidden[:size]
        torch._dynamo.mark_static_address(hidden_v)
        self.static.pad(size)
        hidden_v.zero_()
        inputs = [ids_v, pos_v, hidden_v, meta_v.slot_mapping, meta_v.decode.block_tables, meta_v.decode.context_lens]
        if self.runner.recipe.mark_static:
            mark_step_inputs_static(inputs, self.kv_caches)
        method = step_for_size(self._step, size, "draft_step")
        compiled = torch.compile(method, backend=backend, fullgraph=True, dynamic=self.runner.recipe.dynamic)
        frozen = [*inputs, *(t for cache in self.kv_caches for t in cache)]
        try:
            with torch.inference_mode(), freezing(self.config.inductor.freezing_min_batch, size, frozen):
                for _ in range(2):  # compile, then a warm run
                    compiled(ids_v, pos_v, hidden_v, self.kv_caches, meta_v)
        except Exception as e:  # noqa: BLE001 - a compiler error falls back or is re-raised
            inner = e.inner_exception if isinstance(e, torch._dynamo.exc.BackendCompilerFailed) else e
            error = f"{type(inner).__name__}: {inner}"
            self.stats.compile_failures += 1
            self.stats.compile_errors[size] = error
            if not self.config.fallback_on_compile_error:
                raise GraphCompileError(f"compiling draft chain size {size} failed: {error}") from e
            warnings.warn(GraphCompileWarning(f"compiling draft chain size {size} failed, that size runs "
                                              f"eagerly: {error}"), stacklevel=3)
            return
        seconds = time.perf_counter() - start
        self._graphs[size] = compiled
        self.stats.capture_seconds += seconds
        self.stats.capture[size] = {"seconds": round(seconds, 3), "memory_bytes": memory_in_use(self.device) - mem0}
