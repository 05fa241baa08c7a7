"""The serving engine: continuous batching of requests over one graph runner and its caches.

Prompts prefill eagerly (the runner runs any step with a prefill eagerly); decode steps run
through the runner, as captured graphs where graph mode is on and the batch fits a capture size.
Each loop iteration admits waiting requests (``scheduler.py``), prefills them in one step, then
runs one decode step for every running request; finished requests leave and free their blocks,
so the decode batch size changes as requests come and go.

Shape legend: n requests in a step, V vocabulary.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import os
import time
import weakref
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .block_manager import BlockManager
from ..config import GraphConfig
from ..config_sources import from_env
from ..distributed import ParallelConfig
from ..distributed.state import DEFAULT_TIMEOUT_S
from ..runner.parity import ParityReport, compare_step
from ..runner.graph_runner import GraphRunner, SequenceStep
from ..runtime import progress
from .geometry import positive as _positive, resolve_block_size, resolve_max_model_len, resolve_num_blocks
from ..models.tensor_parallel import check_split
from .model_source import FromCheckpoint, FromFullModel
from .ranks import RankSet, RankSettings, external_rank, serve_external
from .requests import budgets as _budgets, check_prompts, check_request, stop_ids
from .sampling import Sampler, SamplingParams
from .scheduler import Request, Scheduler, append_token
from .speculative import speculation
from .stats import EngineStats
from .step_wire import StepKind
from .tokenizer import Tokenizer, load_tokenizer

Prompt = Union[str, Sequence[int]]


class Engine:
    """Serves batches of prompts on a DeepSeek (or any runner-compatible) model.

    - ``graph_config``: graph mode settings; ``None`` = ``config_sources.from_env()`` (graph
      mode off unless the environment turns it on).
    - ``block_size``: tokens per cache block; default the attention backend's (16; 128 on an NPU).
    - ``max_model_len``: longest prompt + generation; default ``min(max_position_embeddings, 4096)``.
    - ``max_num_seqs``: most requests running at once; default ``graph_config.max_batch_size``.
    - ``num_blocks``: cache blocks (the null block included). Default: from
      ``cache_memory_bytes`` when given, else enough for ``max_num_seqs`` requests of
      ``max_model_len`` tokens.
    - ``cache_align_bytes``: align each cache tensor's start (a power of two, e.g. 2 MiB, as
      transfer engines that register memory want; 0 = no constraint).
    - ``tokenizer``: an object with ``encode``/``decode``, or a directory to load one from on
      first use (``load_tokenizer``); needed only for string prompts and ``decode``.
    - ``tensor_parallel_size``, ``data_parallel_size``, ``enable_expert_parallel``: run on
      ``tp * dp`` processes of this host (vLLM's flags; ``ranks.py``): this one is rank 0, it
      schedules; each rank holds its share of the model, its runner and caches. ``model`` is then
      a model with ``tp_shard`` (its weights go to the other ranks through the spawn pipe) or a
      ``model_source`` (``FromCheckpoint``, ``FromName``: each rank loads its share itself);
      ``rank_timeout_s`` bounds every wait on another rank. Requests go to the data-parallel
      replica with the fewest requests of the call. ``close()`` (or ``with Engine(...)``) stops the
      ranks. Under an external launcher (``RANK``/``WORLD_SIZE`` set), ranks > 0 serve rank 0's
      steps inside this constructor, then exit the process (``docs/distributed.md``).
    - ``num_speculative_tokens``: k drafts k tokens per step with the model's MTP layer and
      verifies them in the next decode step (``speculative.py``; greedy, one process); capture
      sizes then count requests, each 1 + k rows of the runner's graphs.
    """

    def __init__(self, model, *, graph_config: Optional[GraphConfig] = None, block_size: Optional[int] = None,
                 num_blocks: Optional[int] = None, cache_memory_bytes: Optional[int] = None,
                 max_model_len: Optional[int] = None, max_num_seqs: Optional[int] = None,
                 device: torch.device | str | None = None,
                 tokenizer: Union[Tokenizer, str, os.PathLike, None] = None,
                 backend: Optional[Callable] = None, cache_align_bytes: int = 0,
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1, enable_expert_parallel: bool = False,
                 rank_timeout_s: float = DEFAULT_TIMEOUT_S, num_speculative_tokens: int = 0) -> None:
        self.graph_config = graph_config if graph_config is not None else from_env()
        self.parallel = ParallelConfig(tensor_parallel_size, data_parallel_size, enable_expert_parallel)
        seats = self.graph_config.max_batch_size if max_num_seqs is None else max_num_seqs
        self.max_num_seqs = _positive("max_num_seqs", seats)
        self.spec, self.graph_config = speculation(num_speculative_tokens, model, self.parallel, self.graph_config)
        self.ranks: Optional[RankSet] = None
        if self.parallel.world_size > 1:
            if self.graph_config.inductor.precompile is None:  # a saved step's process groups do not load again
                inductor = dataclasses.replace(self.graph_config.inductor, precompile=False)
                self.graph_config = dataclasses.replace(self.graph_config, inductor=inductor)
            settings = RankSettings(self.graph_config, block_size, max_model_len, self.max_num_seqs, num_blocks,
                                    cache_memory_bytes, cache_align_bytes, str(device or "cpu"), torch.get_num_threads())
            self.ranks = self._start_ranks(model, settings, backend, rank_timeout_s)
            self.model, self.runner = self.ranks.model, self.ranks.runner
            self.block_size, self.max_model_len = self.runner.block_size, self.runner.max_model_len
            self.num_blocks = self.runner.num_blocks
        else:
            self.model = model
            self.block_size = block_size = resolve_block_size(model, block_size)
            self.max_model_len = resolve_max_model_len(model, max_model_len)
            self.num_blocks = resolve_num_blocks(model, block_size, self.max_model_len, self.max_num_seqs,
                                                 num_blocks, cache_memory_bytes)
            self.runner = GraphRunner(model, self.graph_config, num_blocks=self.num_blocks, block_size=block_size,
                                      max_model_len=self.max_model_len, device=device, backend=backend,
                                      cache_align_bytes=cache_align_bytes)
            if self.spec is not None:
                self.spec.attach(self.runner)
        # one block manager per data-parallel replica (each has its own caches on its ranks)
        self.replica_blocks = [BlockManager(self.num_blocks, self.block_size)
                               for _ in range(self.parallel.data_parallel_size)]
        self.blocks = self.replica_blocks[0]
        self.rank_parity: list[list[dict]] = []  # per checked step, every rank's summary (multi-process)
        self._eager = False  # every step eager (eager_twin)
        self.counters = EngineStats()
        is_path = isinstance(tokenizer, (str, os.PathLike))
        self._tokenizer: Optional[Tokenizer] = None if is_path else tokenizer
        self._tokenizer_path: Optional[str] = os.fspath(tokenizer) if is_path else None
        self._seq_ids = itertools.count()

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, graph_config: Optional[GraphConfig] = None,
                        dtype: Optional[torch.dtype] = None, device: torch.device | str = "cpu",
                        **kwargs) -> "Engine":
        """An engine on the DeepSeek V2/V3 checkpoint in directory ``path`` (see ``load_deepseek``;
        on several ranks each reads its share only).

        Its tokenizer, if the directory has one, is loaded on first use (string prompts,
        ``decode``); ``kwargs`` go to ``Engine``.
        """
        from ..models import load_deepseek

        kwargs.setdefault("tokenizer", os.fspath(path))
        sizes = (kwargs.get("tensor_parallel_size", 1), kwargs.get("data_parallel_size", 1))
        model = (FromCheckpoint(os.fspath(path), dtype, str(device)) if sizes != (1, 1)
                 else load_deepseek(path, dtype=dtype, device=device))
        return cls(model, graph_config=graph_config, device=device, **kwargs)

    def _start_ranks(self, model, settings: RankSettings, backend: Optional[Callable], timeout_s: float) -> RankSet:
        """Check that the model splits as asked, then start the ranks (or, under an external
        launcher, serve as a rank > 0 and exit)."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"rank_timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if backend is not None:
            raise ValueError("backend: a compile backend object cannot be sent to other ranks; leave it None "
                             "with tensor_parallel_size/data_parallel_size > 1 (graph_config.backend names one)")
        source = FromFullModel.of(model) if isinstance(model, nn.Module) else model
        check_split(source.model_class(), source.config, self.parallel)
        if (external_rank(self.parallel) or 0) > 0:
            serve_external(self.parallel, source, settings, timeout_s)
            raise SystemExit(0)
        ranks = RankSet(self.parallel, source, settings, timeout_s)
        weakref.finalize(self, ranks.close)
        return ranks

    def eager_twin(self) -> "Engine":
        """An engine on this one's model, ranks, runner and caches whose every step runs eagerly,
        with its own engine counters: graph against eager on a multi-process engine (a process
        forms one set of groups). Run the two one after the other, never interleaved."""
        twin = copy.copy(self)
        twin.counters, twin._eager = EngineStats(), True
        return twin

    def close(self) -> None:
        """Stop the other ranks of a multi-process engine and end its groups (no-op otherwise)."""
        if self.ranks is not None:
            self.ranks.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- configuration ----------------------------------------------------------------------

    @property
    def tokenizer(self) -> Optional[Tokenizer]:
        """The tokenizer, loaded from the checkpoint on first use; ``None`` when there is none."""
        if self._tokenizer is None and self._tokenizer_path is not None:
            self._tokenizer = load_tokenizer(self._tokenizer_path)
        return self._tokenizer

    @property
    def stats(self) -> dict:
        """The runner's counters (graph/eager steps, compiles, capture) and the engine's."""
        out = {**self.runner.stats.to_dict(), **self.counters.to_dict(),
               **({"speculative": self.spec.to_dict()} if self.spec else {}),
               "free_blocks": sum(b.num_free for b in self.replica_blocks), "num_blocks": self.num_blocks}
        if self.ranks is not None:  # every rank's runner counters, rank 0's first
            out["ranks"] = self.ranks.step(StepKind.STATS)[1]
        return out

    def capture(self, show_progress: bool = True) -> None:
        """Compile every capture size now instead of at the first decode step."""
        if self.ranks is None:
            self.runner.capture(show_progress=show_progress)
            if self.spec is not None and self.spec.chain is not None:
                self.spec.chain.capture()
        else:  # every rank at once: a captured step holds the collectives
            self.ranks.step(StepKind.CAPTURE, int(show_progress))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (needs a tokenizer)."""
        return self._require_tokenizer("decode").decode(list(token_ids))

    # -- generation -------------------------------------------------------------------------

    def generate(self, prompt_token_ids: Sequence[Prompt], max_new_tokens: int | Sequence[int], *,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                 stop_token_ids: Optional[Sequence[int]] = None, ignore_eos: bool = False,
                 show_progress: bool = False, return_logits: bool = False):
        """Serve every prompt; returns the new token ids per request, in request order.

        Prompts are lists of token ids, or strings (with a tokenizer). Greedy by default;
        ``temperature`` > 0 samples (with ``top_k``/``top_p``), reproducibly given ``seed``.
        A request ends after ``max_new_tokens`` (one int, or one per request) or at a stop token:
        ``stop_token_ids`` plus the model's ``eos_token_id`` unless ``ignore_eos``; the stop token
        is kept in the output. With ``return_logits`` the result is ``(tokens, logits)`` where
        ``logits[i]`` is ``[len(tokens[i]), V]`` float32: the logits each token was chosen from.
        Every argument is validated before any work; errors are ``ValueError`` naming the request.
        """
        params = SamplingParams(temperature, top_k, top_p, seed)
        if self.spec is not None:
            self.spec.check_greedy(params)
        stops = stop_ids(self.model.config, stop_token_ids, ignore_eos)
        requests = self._make_requests(prompt_token_ids, max_new_tokens, keep_logits=return_logits)
        self._serve(requests, Sampler(params), stops, self._run_plan, show_progress)
        tokens = [r.output for r in requests]
        if return_logits:
            return tokens, [torch.stack(r.logits) for r in requests]
        return tokens

    def generate_checked(self, prompt_token_ids: Sequence[Prompt], max_new_tokens: int | Sequence[int], *,
                         check_untouched: bool = True, **kwargs) -> tuple[list[list[int]], list[ParityReport]]:
        """``generate``, with every decode step that can run as a graph checked against eager.

        Such a step runs through ``compare_step`` (eager from the cache state, restored, then the
        graph; logits and written blocks compared, and with ``check_untouched`` every other block
        proven unchanged); the graph's logits continue the generation. Each reproduced routing
        near-tie (``ParityReport.routing_flips``) also names its ``request`` (index in
        ``prompt_token_ids``), its ``step`` and ``positions``: for every request, the position of
        its first token made at or after that step (from there the batch runs on other experts). Returns ``(tokens,
        reports)``, one ``ParityReport`` per checked step; with ``return_logits``, ``tokens`` is
        ``(tokens, logits)`` as ``generate`` returns them. These steps are not in the runner's
        graph/eager counters. Needs graph mode on.
        """
        if not self.graph_config.enabled:
            raise ValueError("generate_checked compares graph with eager: it needs graph_config.enabled=True")
        unknown = set(kwargs) - {"temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos",
                                 "show_progress", "return_logits"}
        if unknown:
            raise TypeError(f"generate_checked got unexpected argument(s): {', '.join(sorted(unknown))}")
        show, keep_logits = kwargs.pop("show_progress", False), kwargs.pop("return_logits", False)
        stops = stop_ids(self.model.config, kwargs.pop("stop_token_ids", None), kwargs.pop("ignore_eos", False))
        params = SamplingParams(**kwargs)
        requests = self._make_requests(prompt_token_ids, max_new_tokens, keep_logits=keep_logits)
        reports: list[ParityReport] = []

        produced: list[dict[int, int]] = []  # per step: request index -> position of the token it makes

        self.rank_parity = []

        def step(plan: list[list[SequenceStep]], batches: list[list[Request]]) -> list[Optional[Tensor]]:
            produced.append({r.index: len(r.output) for batch in batches for r in batch})
            # checked on every rank or on none: every replica has rows that run as a graph
            if not all(plan) or any(self.runner.graph_size(entries) is None for entries in plan):
                return self._run_plan(plan, batches)
            if self.ranks is None:
                reports.append(compare_step(self.runner, plan[0], check_untouched=check_untouched))
                logits = [reports[-1].graph_logits]
            else:
                logits, (report, summaries) = self.ranks.step(StepKind.CHECK, int(check_untouched), plan)
                reports.append(report)
                self.rank_parity.append(summaries)
            rows = 1 + (self.spec.k if self.spec else 0)  # a decode step's rows per request
            for flip in reports[-1].routing_flips:  # decode-only steps: row t is rank 0's entries[t]
                flip.update(request=batches[0][flip["token"] // rows].index, step=len(produced) - 1)
            return logits

        with self.spec.checked(reports, produced) if self.spec else contextlib.nullcontext():
            self._serve(requests, Sampler(params), stops, step, show)
        for flip in (f for r in reports for f in r.routing_flips):
            flip["positions"] = {}  # each request's first token from the flip's step on
            for made in produced[flip["step"]:]:
                for index, position in made.items():
                    flip["positions"].setdefault(index, position)
        tokens = [r.output for r in requests]
        if keep_logits:
            return (tokens, [torch.stack(r.logits) for r in requests]), reports
        return tokens, reports

    # -- the serving loop -------------------------------------------------------------------

    def _run_plan(self, plan: list[list[SequenceStep]], batches: list[list[Request]]) -> list[Optional[Tensor]]:
        """One step of every data-parallel replica: each replica's ``[n, V]`` logits (None if idle)."""
        if self.ranks is None:
            return [self.runner.execute(plan[0], mode="eager" if self._eager else "auto")]
        return self.ranks.step(StepKind.EAGER if self._eager else StepKind.RUN, 0, plan)[0]

    def _serve(self, requests: list[Request], sampler: Sampler, stops: frozenset[int], step: Callable,
               show_progress: bool) -> None:
        schedulers = [Scheduler(blocks, self.max_num_seqs) for blocks in self.replica_blocks]
        for request in requests:  # to the replica with the fewest requests of this call (the first of those)
            min(schedulers, key=lambda s: len(s.waiting)).add([request])
        total, done = sum(r.max_new_tokens for r in requests), 0
        self.counters.requests += len(requests)
        self.counters.prompt_tokens += sum(len(r.prompt) for r in requests)
        try:
            while any(s.has_work for s in schedulers):
                admitted = [s.admit() for s in schedulers]
                if any(admitted):
                    done += self._replicas_step(schedulers, admitted, True, sampler, stops, step)
                batches = [s.decoding() for s in schedulers]
                if any(batches):
                    done += self._replicas_step(schedulers, batches, False, sampler, stops, step)
                if show_progress:
                    progress(min(done, total), total, "tokens generated")
        finally:
            for scheduler in schedulers:
                scheduler.release_all()
        if show_progress and done < total:
            progress(total, total, "tokens generated (some requests stopped early)")

    def _step(self, scheduler: Scheduler, batch: list[Request], prefill: bool, sampler: Sampler,
              stops: frozenset[int], step: Callable) -> int:
        """``_replicas_step`` of one replica (PD's decode engine serves one)."""
        return self._replicas_step([scheduler], [batch], prefill, sampler, stops, step)

    def _replicas_step(self, schedulers: list[Scheduler], batches: list[list[Request]], prefill: bool,
                       sampler: Sampler, stops: frozenset[int], step: Callable) -> int:
        """Run one step of every replica's ``batches`` (``step(plan, batches)``: logits per replica),
        append each request's next token; returns the step's token count towards the progress total
        (a request stopped early counts its remaining budget)."""
        spec = self.spec
        plan = [s.prefill_entries(b) if prefill else spec.decode_entries(s, b) if spec else s.decode_entries(b)
                for s, b in zip(schedulers, batches)]
        start = time.perf_counter()
        logits = step(plan, batches)  # per replica [n, V]
        done = sum(spec.advance(s, b, rows, prefill, stops, self.counters) if spec else
                   self._advance(s, b, rows, prefill, sampler, stops, None)
                   for s, b, rows in zip(schedulers, batches, logits) if b)
        self._count(sum(len(b) for b in batches), prefill, time.perf_counter() - start)
        return done

    def _advance(self, scheduler: Scheduler, batch: list[Request], logits: Tensor, prefill: bool,
                 sampler: Sampler, stops: frozenset[int], start: Optional[float]) -> int:
        """Sample each request's next token from its row of ``logits`` (``[n, V]``), append it,
        finish requests that stop, count the step begun at ``start`` (None: the caller counts it);
        returns the progress count as ``_step`` does."""
        tokens = sampler.sample(logits, [r.index for r in batch])
        if start is not None:
            self._count(len(batch), prefill, time.perf_counter() - start)
        return sum(append_token(scheduler, request, token, row, stops)
                   for request, token, row in zip(batch, tokens, logits))

    def _count(self, rows: int, prefill: bool, seconds: float) -> None:
        c = self.counters
        c.generated_tokens += rows
        if prefill:
            c.prefill_steps += 1
            c.prefill_seconds += seconds
        else:
            c.decode_steps += 1
            c.decode_tokens += rows
            c.decode_seconds += seconds
            c.decode_batch_sizes[rows] += 1

    # -- validation -------------------------------------------------------------------------

    def _require_tokenizer(self, purpose: str) -> Tokenizer:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError(f"{purpose} needs a tokenizer: pass Engine(tokenizer=...), use "
                             "Engine.from_pretrained on a checkpoint that has one, or give token ids")
        return tokenizer

    def _make_requests(self, prompts: Sequence[Prompt], max_new_tokens: int | Sequence[int],
                       keep_logits: bool) -> list[Request]:
        """Validated requests (all checks before any is queued)."""
        check_prompts(prompts)
        budgets, ahead = _budgets(max_new_tokens, len(prompts)), self.spec.k if self.spec else 0
        token_lists = [self._prompt_ids(i, p) for i, p in enumerate(prompts)]
        for i, (ids, budget) in enumerate(zip(token_lists, budgets)):
            check_request(i, ids, budget, vocab=self.model.config.vocab_size, max_model_len=self.max_model_len,
                          block_size=self.block_size, num_blocks=self.num_blocks, lookahead=ahead)
        return [Request(i, next(self._seq_ids), ids, budget, logits=[] if keep_logits else None, lookahead=ahead)
                for i, (ids, budget) in enumerate(zip(token_lists, budgets))]

    def _prompt_ids(self, i: int, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self._require_tokenizer(f"request {i} is a string prompt: it").encode(prompt))
        if not isinstance(prompt, Sequence):
            raise ValueError(f"request {i}: a prompt must be a list of token ids or a string, "
                             f"got {type(prompt).__name__}")
        return list(prompt)
