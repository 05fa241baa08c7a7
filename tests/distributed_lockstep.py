"""Rank functions of tests/test_lockstep.py: two data-parallel ranks drive graph runners through
steps that disagree (different row counts, a prefill on one rank, an idle rank) and compile
failures on one rank; each rank records what it ran and its logits for the test's oracle."""

from __future__ import annotations

import time

import torch

from ascend_graph.config import GraphConfig
from ascend_graph.distributed import ParallelConfig, destroy_parallel, init_parallel
from ascend_graph.runner import GraphCompileError, SequenceStep

SIZES = (2, 4)
# per step, per rank: "prefill k" (k new prompts, one step), "decode" (every running sequence),
# "idle" (no sequences: ``execute([])``)
SCRIPT = [("prefill 3", "prefill 1"), ("decode", "decode"), ("decode", "prefill 1"),
          ("decode", "decode"), ("decode", "idle"), ("idle", "decode")]


def graph_config(**kwargs) -> GraphConfig:
    return GraphConfig(enabled=True, backend="inductor", capture_sizes=SIZES, max_batch_size=max(SIZES), **kwargs)


def failing_backend(rank: int, fail_rank: int, fail_size: int):
    """Inductor, but compiling a graph of ``fail_size`` rows raises on rank ``fail_rank``."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        rows = {x.shape[0] for x in example_inputs  # input ids, positions, slots: int64 [s]
                if isinstance(x, torch.Tensor) and x.dim() == 1 and x.dtype == torch.int64}
        if rank == fail_rank and fail_size in rows:
            raise RuntimeError(f"injected compile failure of size {fail_size} on rank {rank}")
        return compile_fx(gm, example_inputs)
    return backend


def lockstep_checks(rank: int, world_size: int, init_file: str) -> dict:
    """DP=2 with expert parallel (tiny DeepSeek V3: every MoE layer all-reduces across the ranks,
    so ranks that disagree on a step would wait for each other): the scripted steps, then the
    compile failures."""
    from distributed_ep import sharded
    from runner_helpers import Schedule, make_runner

    state = init_parallel(ParallelConfig(data_parallel_size=2, enable_expert_parallel=True), rank=rank,
                          world_size=world_size, init_method=f"file://{init_file}", timeout_s=120)
    try:
        model = sharded(state, "v3")
        runner = make_runner(model, graph_config())
        out = {"steps": _scripted(runner, Schedule(seed=rank), model.config.vocab_size, rank),
               "stats": runner.stats.to_dict()}
        out["dropped"] = _dropped_size(rank, model)
        out["raised"] = _failed_capture(rank, model)
        return out
    finally:
        destroy_parallel()


def _scripted(runner, sched, vocab: int, rank: int) -> list[dict]:
    """Run ``SCRIPT``'s steps for ``rank``: each step's entries (as lists) and logits."""
    steps, next_id = [], 0
    for actions in SCRIPT:
        action = actions[rank]
        if action.startswith("prefill"):
            ids = list(range(next_id, next_id + int(action.split()[1])))
            next_id += len(ids)
            entries = [sched.add(s, sched.random_prompt(vocab), new_tokens=100) for s in ids]
        elif action == "decode":
            ids, entries = sorted(sched.next_token), sched.decode_entries()
        else:
            ids, entries = [], []
        logits = runner.execute(entries)
        if ids:
            sched.advance(ids, entries, logits)
        steps.append({"action": action, "logits": logits.tolist(),
                      "entries": [[list(e.token_ids), e.num_cached, list(e.block_table)] for e in entries]})
    return steps


def _dropped_size(rank: int, model) -> dict:
    """Size 4 fails to compile on rank 1 only (fallback on): both ranks keep size 2 alone and run
    3 rows eagerly."""
    from runner_helpers import make_runner

    runner = make_runner(model, graph_config(), backend=failing_backend(rank, 1, 4))
    start = time.monotonic()
    runner.capture(show_progress=False)
    steps = []
    for entries in ([SequenceStep([3 + i, 4], 0, [1 + i]) for i in range(3)],  # a prefill: eager
                    [SequenceStep([5 + i], 2, [1 + i]) for i in range(3)]):  # 3 rows: size 4, no graph
        logits = runner.execute(entries)
        steps.append({"logits": logits.tolist(),
                      "entries": [[list(e.token_ids), e.num_cached, list(e.block_table)] for e in entries]})
    return {"graph_sizes": list(runner.graph_sizes), "seconds": time.monotonic() - start,
            "stats": runner.stats.to_dict(), "steps": steps}


def _failed_capture(rank: int, model) -> dict:
    """Size 4 fails on rank 0 only, with fallback off: capture raises on both ranks, in time."""
    from runner_helpers import make_runner

    runner = make_runner(model, graph_config(fallback_on_compile_error=False), backend=failing_backend(rank, 0, 4))
    start = time.monotonic()
    try:
        runner.capture(show_progress=False)
    except GraphCompileError as e:
        return {"raised": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"raised": None, "seconds": time.monotonic() - start}


def eager_oracle(model, steps: list[dict]) -> list[torch.Tensor]:
    """Each step's logits from a single-process eager runner replaying one rank's entries."""
    from runner_helpers import make_runner

    runner = make_runner(model, GraphConfig(enabled=False))
    out = []
    for step in steps:
        entries = [SequenceStep(ids, cached, table) for ids, cached, table in step["entries"]]
        out.append(runner.execute(entries) if entries else None)
    return out
