"""The serving engine: continuous batching of requests over one graph runner and its caches.

Prompts prefill eagerly (the runner runs any step with a prefill eagerly); decode steps run
through the runner, as captured graphs where graph mode is on and the batch fits a capture size.
Each loop iteration admits waiting requests (``scheduler.py``), prefills them in one step, then
runs one decode step for every running request; finished requests leave and free their blocks,
so the decode batch size changes as requests come and go.

Shape legend: n requests in a step, V vocabulary.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .block_manager import BlockManager
from ..attention import choose_block_size, model_attention_backends
from ..config import GraphConfig
from ..config_sources import from_env
from ..kv_cache import blocks_for_budget
from ..runner.parity import ParityReport, compare_step
from ..runner.graph_runner import GraphRunner, SequenceStep
from ..runtime import progress
from .sampling import Sampler, SamplingParams
from .scheduler import Request, Scheduler
from .tokenizer import Tokenizer, load_tokenizer

DEFAULT_MAX_MODEL_LEN = 4096  # used when the model allows more (DeepSeek's 163840 would be huge)
Prompt = Union[str, Sequence[int]]


@dataclass
class EngineStats:
    """Counters of an engine: requests, tokens, steps, decode batch sizes and step time."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_batch_sizes: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict:
        """A JSON-safe copy, with decode throughput."""
        rate = self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens, "prefill_steps": self.prefill_steps,
                "decode_steps": self.decode_steps, "decode_tokens": self.decode_tokens,
                "prefill_seconds": round(self.prefill_seconds, 4), "decode_seconds": round(self.decode_seconds, 4),
                "decode_tokens_per_s": round(rate, 2),
                "decode_batch_sizes": {str(k): v for k, v in sorted(self.decode_batch_sizes.items())}}


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
    """

    def __init__(self, model: nn.Module, *, graph_config: Optional[GraphConfig] = None, block_size: Optional[int] = None,
                 num_blocks: Optional[int] = None, cache_memory_bytes: Optional[int] = None,
                 max_model_len: Optional[int] = None, max_num_seqs: Optional[int] = None,
                 device: torch.device | str | None = None,
                 tokenizer: Union[Tokenizer, str, os.PathLike, None] = None,
                 backend: Optional[Callable] = None, cache_align_bytes: int = 0) -> None:
        self.model = model
        self.graph_config = graph_config if graph_config is not None else from_env()
        self.block_size = block_size = choose_block_size(model_attention_backends(model), block_size)
        self.max_model_len = self._resolve_max_model_len(max_model_len)
        seats = self.graph_config.max_batch_size if max_num_seqs is None else max_num_seqs
        self.max_num_seqs = _positive("max_num_seqs", seats)
        self.num_blocks = self._resolve_num_blocks(num_blocks, cache_memory_bytes)
        self.blocks = BlockManager(self.num_blocks, block_size)
        self.runner = GraphRunner(model, self.graph_config, num_blocks=self.num_blocks, block_size=block_size,
                                  max_model_len=self.max_model_len, device=device, backend=backend,
                                  cache_align_bytes=cache_align_bytes)
        self.counters = EngineStats()
        is_path = isinstance(tokenizer, (str, os.PathLike))
        self._tokenizer: Optional[Tokenizer] = None if is_path else tokenizer
        self._tokenizer_path: Optional[str] = os.fspath(tokenizer) if is_path else None
        self._seq_ids = itertools.count()

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, graph_config: Optional[GraphConfig] = None,
                        dtype: Optional[torch.dtype] = None, device: torch.device | str = "cpu",
                        **kwargs) -> "Engine":
        """An engine on the DeepSeek V2/V3 checkpoint in directory ``path`` (see ``load_deepseek``).

        Its tokenizer, if the directory has one, is loaded on first use (string prompts,
        ``decode``); ``kwargs`` go to ``Engine``.
        """
        from ..models import load_deepseek

        kwargs.setdefault("tokenizer", os.fspath(path))
        return cls(load_deepseek(path, dtype=dtype, device=device), graph_config=graph_config, device=device,
                   **kwargs)

    # -- configuration ----------------------------------------------------------------------

    def _resolve_max_model_len(self, max_model_len: Optional[int]) -> int:
        limit = getattr(self.model.config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
        if max_model_len is None:
            return min(limit, DEFAULT_MAX_MODEL_LEN)
        _positive("max_model_len", max_model_len)
        if max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
        return max_model_len

    def _resolve_num_blocks(self, num_blocks: Optional[int], cache_memory_bytes: Optional[int]) -> int:
        if num_blocks is not None and cache_memory_bytes is not None:
            raise ValueError("give num_blocks or cache_memory_bytes, not both")
        if cache_memory_bytes is not None:
            _positive("cache_memory_bytes", cache_memory_bytes)
            return blocks_for_budget(self.model.kv_cache_specs(), self.block_size, cache_memory_bytes)
        if num_blocks is None:
            return 1 + self.max_num_seqs * math.ceil(self.max_model_len / self.block_size)
        return _positive("num_blocks", num_blocks, minimum=2, why=" (block 0 is the reserved null block)")

    @property
    def tokenizer(self) -> Optional[Tokenizer]:
        """The tokenizer, loaded from the checkpoint on first use; ``None`` when there is none."""
        if self._tokenizer is None and self._tokenizer_path is not None:
            self._tokenizer = load_tokenizer(self._tokenizer_path)
        return self._tokenizer

    @property
    def stats(self) -> dict:
        """The runner's counters (graph/eager steps, compiles, capture) and the engine's."""
        return {**self.runner.stats.to_dict(), **self.counters.to_dict(),
                "free_blocks": self.blocks.num_free, "num_blocks": self.num_blocks}

    def capture(self, show_progress: bool = True) -> None:
        """Compile every capture size now instead of at the first decode step."""
        self.runner.capture(show_progress=show_progress)

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
        stops = self._stop_ids(stop_token_ids, ignore_eos)
        requests = self._make_requests(prompt_token_ids, max_new_tokens, keep_logits=return_logits)
        self._serve(requests, Sampler(params), stops, lambda entries, batch: self.runner.execute(entries),
                    show_progress)
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
        stops = self._stop_ids(kwargs.pop("stop_token_ids", None), kwargs.pop("ignore_eos", False))
        params = SamplingParams(**kwargs)
        requests = self._make_requests(prompt_token_ids, max_new_tokens, keep_logits=keep_logits)
        reports: list[ParityReport] = []

        produced: list[dict[int, int]] = []  # per step: request index -> position of the token it makes

        def step(entries: list[SequenceStep], batch: list[Request]) -> Tensor:
            produced.append({r.index: len(r.output) for r in batch})
            if self.runner.graph_size(entries) is None:
                return self.runner.execute(entries)
            reports.append(compare_step(self.runner, entries, check_untouched=check_untouched))
            for flip in reports[-1].routing_flips:  # decode-only steps: row t is entries[t]
                flip.update(request=batch[flip["token"]].index, step=len(produced) - 1)
            return reports[-1].graph_logits

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

    def _serve(self, requests: list[Request], sampler: Sampler, stops: frozenset[int],
               step: Callable[[list[SequenceStep], list[Request]], Tensor], show_progress: bool) -> None:
        scheduler = Scheduler(self.blocks, self.max_num_seqs)
        scheduler.add(requests)
        total, done = sum(r.max_new_tokens for r in requests), 0
        self.counters.requests += len(requests)
        self.counters.prompt_tokens += sum(len(r.prompt) for r in requests)
        try:
            while scheduler.has_work:
                admitted = scheduler.admit()
                if admitted:
                    done += self._step(scheduler, admitted, True, sampler, stops, step)
                batch = scheduler.decoding()
                if batch:
                    done += self._step(scheduler, batch, False, sampler, stops, step)
                if show_progress:
                    progress(min(done, total), total, "tokens generated")
        finally:
            scheduler.release_all()
        if show_progress and done < total:
            progress(total, total, "tokens generated (some requests stopped early)")

    def _step(self, scheduler: Scheduler, batch: list[Request], prefill: bool, sampler: Sampler,
              stops: frozenset[int], step: Callable) -> int:
        """Run one step for ``batch``, append each request's next token; returns the steps' token count
        towards the progress total (a request stopped early counts its remaining budget)."""
        entries = scheduler.prefill_entries(batch) if prefill else scheduler.decode_entries(batch)
        start = time.perf_counter()
        logits = step(entries, batch)  # [n, V]
        return self._advance(scheduler, batch, logits, prefill, sampler, stops, start)

    def _advance(self, scheduler: Scheduler, batch: list[Request], logits: Tensor, prefill: bool,
                 sampler: Sampler, stops: frozenset[int], start: float) -> int:
        """Sample each request's next token from its row of ``logits`` (``[n, V]``, the step begun at
        ``start``), append it, finish requests that stop; returns the progress count as ``_step`` does."""
        tokens = sampler.sample(logits, [r.index for r in batch])
        self._count(batch, prefill, time.perf_counter() - start)
        advanced = 0
        for request, token, row in zip(batch, tokens, logits):
            request.output.append(token)
            if request.logits is not None:
                request.logits.append(row.float().cpu())
            advanced += 1
            if token in stops or len(request.output) == request.max_new_tokens:
                advanced += request.max_new_tokens - len(request.output)
                scheduler.finish(request)
        return advanced

    def _count(self, batch: list[Request], prefill: bool, seconds: float) -> None:
        c = self.counters
        c.generated_tokens += len(batch)
        if prefill:
            c.prefill_steps += 1
            c.prefill_seconds += seconds
        else:
            c.decode_steps += 1
            c.decode_tokens += len(batch)
            c.decode_seconds += seconds
            c.decode_batch_sizes[len(batch)] += 1

    # -- validation -------------------------------------------------------------------------

    def _require_tokenizer(self, purpose: str) -> Tokenizer:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError(f"{purpose} needs a tokenizer: pass Engine(tokenizer=...), use "
                             "Engine.from_pretrained on a checkpoint that has one, or give token ids")
        return tokenizer

    def _stop_ids(self, stop_token_ids: Optional[Sequence[int]], ignore_eos: bool) -> frozenset[int]:
        ints = lambda ids: all(isinstance(t, int) and not isinstance(t, bool) for t in ids)  # noqa: E731
        if stop_token_ids is not None and (isinstance(stop_token_ids, str) or not isinstance(stop_token_ids, Sequence)
                                           or not ints(stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {stop_token_ids!r}")
        stops = list(stop_token_ids or ())
        eos = None if ignore_eos else getattr(self.model.config, "eos_token_id", None)
        if eos is not None:
            stops.extend([eos] if isinstance(eos, int) else eos)
        return frozenset(stops)

    def _make_requests(self, prompts: Sequence[Prompt], max_new_tokens: int | Sequence[int],
                       keep_logits: bool) -> list[Request]:
        """Validated requests (all checks before any is queued)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompt_token_ids must be a non-empty list of prompts (lists of token ids or "
                             f"strings), got {type(prompts).__name__}")
        if isinstance(prompts[0], int):
            raise ValueError("prompt_token_ids must be a list of prompts, got a flat list of ints; "
                             "wrap a single prompt as [ids]")
        budgets = _budgets(max_new_tokens, len(prompts))
        token_lists = [self._prompt_ids(i, p) for i, p in enumerate(prompts)]
        for i, (ids, budget) in enumerate(zip(token_lists, budgets)):
            self._check_request(i, ids, budget)
        return [Request(i, next(self._seq_ids), ids, budget, logits=[] if keep_logits else None)
                for i, (ids, budget) in enumerate(zip(token_lists, budgets))]

    def _prompt_ids(self, i: int, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self._require_tokenizer(f"request {i} is a string prompt: it").encode(prompt))
        if not isinstance(prompt, Sequence):
            raise ValueError(f"request {i}: a prompt must be a list of token ids or a string, "
                             f"got {type(prompt).__name__}")
        return list(prompt)

    def _check_request(self, i: int, ids: list[int], budget: int) -> None:
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError(f"request {i}: the prompt is empty; every request needs at least one token")
        for pos, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"request {i}: token id {t!r} at position {pos} is outside the vocabulary "
                                 f"[0, {vocab})")
        total = len(ids) + budget
        if total > self.max_model_len:
            raise ValueError(f"request {i}: prompt of {len(ids)} tokens + max_new_tokens={budget} = {total} "
                             f"exceeds max_model_len={self.max_model_len}")
        need, usable = math.ceil(total / self.block_size), self.num_blocks - 1
        if need > usable:
            raise ValueError(f"request {i}: {total} tokens need {need} blocks of {self.block_size}, more than "
                             f"the whole cache's {usable} usable blocks (num_blocks={self.num_blocks}, "
                             "one is the null block)")


def _budgets(max_new_tokens: int | Sequence[int], n: int) -> list[int]:
    budgets = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != n:
        raise ValueError(f"max_new_tokens has {len(budgets)} entries for {n} prompts")
    for i, b in enumerate(budgets):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"request {i}: max_new_tokens must be an int >= 1, got {b!r}")
    return budgets


def _positive(name: str, value, minimum: int = 1, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{why}, got {value!r}")
    return value
