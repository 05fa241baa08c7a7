"""Shared helpers of the runner tests: small models and a continuous-batching schedule."""

from __future__ import annotations

import random

import torch

from ascend_graph.engine.block_manager import BlockManager
from ascend_graph.models.llama import LlamaConfig, LlamaForCausalLM
from ascend_graph.runner import GraphRunner, SequenceStep

NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN = 96, 4, 64


def small_model(kind: str, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """A seeded small model of ``layers`` layers: ``"llama"`` (paged GQA attention), ``"mla"``
    (DeepSeek MLA: the first layer dense, then MoE), or ``"mla_long_rows"`` (the same with a dense
    MLP of 8200, whose down projection is a chunk-major ``ChunkedLinear``).

    Two layers by default, one of each kind: a third (a second MoE layer) adds no code path to a
    compiled step, only compile time (about 7 s per capture size, cold, on a 2-core Zen 3)."""
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers))
    else:
        from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
        sizes = {"intermediate_size": 8200} if kind == "mla_long_rows" else {}
        model = DeepseekForCausalLM(DeepseekConfig.small(num_hidden_layers=layers, **sizes))
    return model.to(dtype).eval()


def make_runner(model, config, **kwargs) -> GraphRunner:
    """A runner with the tests' cache geometry."""
    return GraphRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                       max_model_len=MAX_MODEL_LEN, **kwargs)


class Schedule:
    """Continuous batching in miniature: prompts prefill, then decode until they finish."""

    def __init__(self, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE, seed: int = 0):
        self.blocks = BlockManager(num_blocks, block_size)
        self.rng = random.Random(seed)
        self.lens: dict[int, int] = {}
        self.remaining: dict[int, int] = {}
        self.next_token: dict[int, int] = {}

    def add(self, seq_id: int, prompt: list[int], new_tokens: int) -> SequenceStep:
        """A prefill step entry for a new sequence."""
        self.lens[seq_id] = 0
        self.remaining[seq_id] = new_tokens
        return SequenceStep(prompt, 0, self.blocks.ensure(seq_id, len(prompt)))

    def decode_entries(self) -> list[SequenceStep]:
        """One decode entry for every running sequence."""
        return [SequenceStep([self.next_token[s]], self.lens[s], self.blocks.ensure(s, self.lens[s] + 1))
                for s in sorted(self.next_token)]

    def advance(self, seq_ids: list[int], entries: list[SequenceStep], logits: torch.Tensor) -> None:
        """Record a step's greedy tokens; finished sequences free their blocks."""
        for s, e, tok in zip(seq_ids, entries, logits.argmax(-1).tolist()):
            self.lens[s] = e.num_cached + len(e.token_ids)
            self.remaining[s] -= 1
            self.next_token[s] = tok
            if self.remaining[s] == 0:
                del self.next_token[s]
                self.blocks.free(s)

    def random_prompt(self, vocab: int) -> list[int]:
        """A prompt of 2..9 random tokens."""
        return [self.rng.randrange(vocab) for _ in range(self.rng.randint(2, 9))]


def prefilled(runner, schedule: Schedule, n: int, vocab: int) -> None:
    """Prefill ``n`` sequences (eagerly) so that a decode batch of ``n`` is ready."""
    for s in range(n):
        entry = schedule.add(s, schedule.random_prompt(vocab), new_tokens=100)
        schedule.advance([s], [entry], runner.execute([entry]))


def assert_graph_outputs_are_fresh(runner, sched: Schedule, seq_ids: list[int]) -> None:
    """Two graph steps in a row: the first step's logits are its own, not a buffer the second
    overwrites (the runner returns CPU graph outputs without copying them)."""
    entries = sched.decode_entries()
    first = runner.execute(entries, mode="graph")
    saved = first.clone()
    sched.advance(seq_ids, entries, first)
    second = runner.execute(sched.decode_entries(), mode="graph")
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert torch.equal(first, saved) and not torch.equal(first, second)


class KernelCalls:
    """Within ``with KernelCalls() as calls:``, every call of an ``ascend_graph::*`` kernel op,
    eager or from a compiled step's C++ wrapper (the dispatcher reports both to the profiler), as
    ``(op name, its tensor arguments' shapes)`` in ``calls.found`` once the block ends."""

    OPS = ("rows_mm", "rows_bmm", "expert_rows_mm", "decode_attention")

    def __enter__(self) -> "KernelCalls":
        self.found: list[tuple[str, list[tuple[int, ...]]]] = []
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        names = {f"ascend_graph::{op}": op for op in self.OPS}
        self.found = [(names[e.name], [tuple(s) for s in e.input_shapes])
                      for e in self._profile.events() if e.name in names]

    def shapes(self, op: str, arg: int) -> list[tuple[int, ...]]:
        """The shape of argument ``arg`` (its place in the schema; ``()`` for None or a number) at
        each call of ``op``."""
        return [shapes[arg] for name, shapes in self.found if name == op]
