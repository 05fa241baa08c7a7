"""Ranks of the expert-parallel tests: the tiny DeepSeek V2 and V3 under TP=2 + EP and under
DP=2 + EP, each rank's share cut from the seeded full model, run by a graph runner (Inductor) with
eager steps among the graph steps; and what the test process needs to compute their oracles."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from distributed_ranks import _graph_and_eager_decode, greedy_decode, small_deepseek

from ascend_graph.distributed import ParallelConfig, destroy_parallel, dp_step, init_parallel
from ascend_graph.moe import MoE
from ascend_graph.moe.backend import MoEBackend

VERSIONS = ("v2", "v3")
DP_PROMPTS = (([1, 5, 9, 3], [7, 2, 8], [4, 4, 6, 1, 2]), ([9, 8, 7, 6, 5, 3],))  # per DP rank: 3 rows, 1 row
DP_CAPTURE = 4  # both ranks' graph steps pad to it: 1 and 3 padding rows
# each decode step's mode; "capacity:" steps run with every row routed to rank 0's experts;
# "mixed": rank 0 prefills MIXED_PROMPT while rank 1 decodes (eager on both, as a prefill makes it)
DP_MODES = ("graph", "graph", "eager", "capacity:graph", "capacity:eager", "mixed")
MIXED_PROMPT = [3, 1, 4, 1, 5]


def ep_checks(rank: int, world_size: int, ports: list[int]) -> dict:
    """TP=2 + EP, then DP=2 + EP, over tiny V2 and V3: what the test compares with its oracles."""
    out: dict = {}
    state = init_parallel(ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True), rank=rank,
                          world_size=world_size, init_method=f"tcp://127.0.0.1:{ports[0]}", timeout_s=240)
    out["tp"] = {version: _tp_ep(state, version) for version in VERSIONS}
    out["flips"] = {case: tp_flip(state, case) for case in FLIP_CASES}
    destroy_parallel()
    state = init_parallel(ParallelConfig(data_parallel_size=2, enable_expert_parallel=True), rank=rank,
                          world_size=world_size, init_method=f"tcp://127.0.0.1:{ports[1]}", timeout_s=240)
    out["dp"] = {version: _dp_ep(state, version) for version in VERSIONS}
    destroy_parallel()
    return out


def sharded(state, version: str):
    """This rank's share of the tiny DeepSeek ``version`` (TP, DP, EP from ``state``), cut from
    the full model's tensors."""
    from ascend_graph.models import DeepseekForCausalLM

    full = small_deepseek(version)
    model = DeepseekForCausalLM(full.config, init_weights=False, tp=state.tp, dp=state.dp, ep=state.ep).eval()
    model.load_state_dict({name: model.tp_shard(name, t) for name, t in full.state_dict().items()})
    return model


def _layout(model) -> dict:
    moe = model.model.layers[-1].mlp
    return {"layout": model.parallel_layout(), "repr": moe.extra_repr(),
            "expert_gate_up": list(moe.experts.gate_up_proj.shape),
            "shared_gate": list(moe.shared_experts.gate_proj.weight.shape)}


# under TP=2 + EP, V3 runs graph and eager, V2 eager only (its dense layer's TP graph is
# test_distributed's; a compile costs ~18 s of the module's budget)
TP_GRAPH_VERSIONS = ("v3",)


def _tp_ep(state, version: str) -> dict:
    from runner_helpers import make_runner

    from ascend_graph.config import GraphConfig

    model = sharded(state, version)
    if version in TP_GRAPH_VERSIONS:
        return {**_graph_and_eager_decode(model), **_layout(model)}
    tokens, (logits,) = greedy_decode([make_runner(model, GraphConfig(enabled=False))])
    return {"tokens": tokens, "eager_logits": logits, **_layout(model)}


# the stand-in graph of ``tp_flip``: token 0 took its next group at the flattened router; "apart":
# on rank 1 token 1's logits are also off (the ranks hold different tokens to explain)
FLIP_CASES = ("agreed", "apart")


def tp_flip(state, case: str) -> dict:
    """A parity check under TP=2 + EP (V3, its first router's scores within rounding of each other
    for every token) whose stand-in "graph" is the eager step with token 0's last group swapped for
    the next there: the report, and how many eager steps this rank ran (each all-reduces)."""
    from runner_helpers import Schedule, make_runner, prefilled

    from ascend_graph.config import GraphConfig
    from ascend_graph.runner import parity

    model = sharded(state, "v3")
    flat = parity._routers(model)[0][1].weight
    with torch.no_grad():  # replicated: the same on every rank
        flat.copy_(flat[:1] + 1e-6 * torch.randn(flat.shape, generator=torch.Generator().manual_seed(1)))
    runner = make_runner(model, GraphConfig(enabled=False))
    sched = Schedule()
    prefilled(runner, sched, 3, model.config.vocab_size)
    step, eager, runs = runner.prepare(sched.decode_entries()), runner.run_prepared, []

    def run_prepared(step, mode):
        if mode == "eager":
            runs.append(mode)
            return eager(step, mode)
        with parity._routing(parity._routers(model), 0.0, swap=(0, 0, "groups")):
            logits = eager(step, "eager").clone()
        if case == "apart" and state.rank == 1:
            logits[1] += 0.5
        return logits

    runner.run_prepared = run_prepared
    report = parity.compare_prepared(runner, step)
    return {"ok": report.ok, "flips": [[f["token"], f["router"], "groups" in f] for f in report.routing_flips],
            "eager_runs": len(runs)}


class CountingMoE(MoEBackend):
    """The model's own backend, counting first, per local expert, the (row, expert) pairs it is
    handed to compute (a sentinel pair is no expert's): into ``experts.rows_seen``, an in-place
    add that a compiled step keeps."""

    name = "counting"

    def __init__(self, inner: MoEBackend) -> None:
        self.inner = inner

    @staticmethod
    def _count(experts, ids: torch.Tensor) -> None:
        n = experts.num_experts
        per = torch.zeros(n + 1, dtype=torch.int64, device=ids.device)
        per.scatter_add_(0, ids.flatten(), torch.ones(ids.numel(), dtype=torch.int64, device=ids.device))
        experts.rows_seen.add_(per[:n])

    def decode_local(self, experts, x, weights, ids):
        self._count(experts, ids)
        return self.inner.decode_local(experts, x, weights, ids)

    def prefill_local(self, experts, x, weights, ids):
        self._count(experts, ids)
        return self.inner.prefill_local(experts, x, weights, ids)


def force_to_first_half(model) -> None:
    """Route every row to the experts of the first half (rank 0's under EP=2): the V3 router's
    correction bias steers the choice (group scores included), the weights stay the scores'."""
    for block in model.modules():
        if isinstance(block, MoE):
            bias = block.gate.e_score_correction_bias
            bias[bias.shape[0] // 2:] = -1e4


def dp_decode(execute: Callable, rank: int, modes, model, padded: Optional[Callable] = None) -> list:
    """Prefill DP rank ``rank``'s prompts in one step, then one decode step per mode (greedy,
    every row), through ``execute(entries, mode)``; each eager step inside ``padded(tokens)`` when
    given (the rows every DP rank pads to). Returns each decode step's logits, and the schedule."""
    from runner_helpers import Schedule

    padded, prompts = padded or (lambda tokens: contextlib.nullcontext()), DP_PROMPTS[rank]
    sched = Schedule()
    entries = [sched.add(s, list(p), new_tokens=100) for s, p in enumerate(prompts)]
    with padded(max(sum(map(len, rank)) for rank in DP_PROMPTS)):
        sched.advance(list(range(len(prompts))), entries, execute(entries, "eager"))
    logits, forced = [], False
    for mode in modes:
        if mode == "mixed":
            if rank == 0:
                entries, ids = [sched.add(len(prompts), MIXED_PROMPT, new_tokens=100)], [len(prompts)]
            else:
                entries, ids = sched.decode_entries(), list(range(len(prompts)))
            with padded(max(len(MIXED_PROMPT), len(DP_PROMPTS[1]))):
                out = execute(entries, "eager")
            logits.append(out.tolist())
            sched.advance(ids, entries, out)
            continue
        if mode.startswith("capacity:"):
            mode = mode.split(":")[1]
            if not forced:
                force_to_first_half(model)
                forced = True
        entries = sched.decode_entries()
        with padded(max(map(len, DP_PROMPTS))) if mode == "eager" else contextlib.nullcontext():
            out = execute(entries, mode)
        logits.append(out.tolist())
        sched.advance(list(range(len(prompts))), entries, out)
    return logits, sched


def modes_for(version: str) -> tuple[str, ...]:
    """V3 (a correction bias to steer with) also runs the capacity edge."""
    return DP_MODES if version == "v3" else tuple(m for m in DP_MODES if not m.startswith("capacity:"))


def _dp_ep(state, version: str) -> dict:
    from runner_helpers import make_runner

    from ascend_graph.config import GraphConfig

    model = sharded(state, version)
    runner = make_runner(model, GraphConfig(enabled=True, backend="inductor", capture_sizes=(DP_CAPTURE,),
                                            max_batch_size=DP_CAPTURE))
    for block in model.modules():
        if isinstance(block, MoE):
            block.experts.register_buffer("rows_seen", torch.zeros(block.experts.num_experts, dtype=torch.int64))
            block.backend = CountingMoE(block.backend)
    logits, sched = dp_decode(lambda entries, mode: runner.execute(entries, mode=mode), state.dp.rank,
                              modes_for(version), model, dp_step)
    seen = [block.experts.rows_seen.tolist() for block in model.modules() if isinstance(block, MoE)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.execute(sched.decode_entries(), mode="graph")  # one more graph step, on every rank
    ops = [e.name for e in prof.events() if e.name.startswith(("c10d::", "_c10d_functional::"))]
    return {"logits": logits, "graph_step_ops": ops, "rows_seen": seen, **_layout(model),
            "stats": {k: runner.stats.to_dict()[k] for k in ("compiles", "recompiles", "compile_failures",
                                                              "graph_steps")}}

