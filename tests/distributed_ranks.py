"""Ranks of the distributed tests: spawn them on 127.0.0.1 (gloo), run one function on each, and
collect each rank's result or its traceback, every wait bounded; and the functions they run."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch

from ascend_graph.distributed import (AgreementTimeout, ParallelConfig, agree, all_gather, all_or_none,
                                      all_reduce, all_to_all, destroy_parallel, init_parallel,
                                      reduce_scatter)

INPUT_SHAPE = (4, 3)
STEPS = 3


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports of 127.0.0.1 (held together while chosen)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_ranks(target: Callable[..., Any], world_size: int, timeout_s: float, *args: Any) -> list[Any]:
    """``target(rank, world_size, *args)`` in ``world_size`` spawned processes; each rank's return
    value, or an ``AssertionError`` carrying every failed rank's traceback (or its exit code)."""
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(target, rank, world_size, results, args), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    reports: dict[int, tuple[str, Any]] = {}
    while len(reports) < world_size and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        reports[rank] = (status, payload)
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    problems = [f"rank {r}: no result within {timeout_s:g} s (exit code {procs[r].exitcode})"
                for r in range(world_size) if r not in reports]
    problems += [f"rank {r} raised:\n{payload}" for r, (status, payload) in sorted(reports.items())
                 if status == "error"]
    assert not problems, "\n".join(problems)
    return [reports[r][1] for r in range(world_size)]


def _rank_main(target, rank: int, world_size: int, results, args) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets on loopback too
    torch.set_num_threads(1)
    try:
        results.put((rank, "ok", target(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001  (reported to the test with its traceback)
        results.put((rank, "error", traceback.format_exc()))


def rank_input(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s float32 input at ``step`` (the test process makes the same for its oracle)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(INPUT_SHAPE, generator=g)


def collective_step(x: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
    """One function holding each collective over ``group``."""
    summed = all_reduce(x * 2, group)  # [N, 3]
    gathered = all_gather(x, group)  # [W*N, 3]
    scattered = reduce_scatter(gathered * 3, group)  # [N, 3]
    exchanged = all_to_all(x + 1, group)  # [N, 3]
    return summed, gathered, scattered, exchanged


def recording_backend(graphs: list, inner: str = "inductor"):
    """A torch.compile backend that keeps each FX graph it is given, then hands it to ``inner``."""
    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        if inner == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        return gm.forward
    return backend


def collective_checks(rank: int, world_size: int, ports: list[int], deadline_s: float) -> dict:
    """Every multi-process check, on one pair of ranks. TP=2: each collective compiled fullgraph
    and run eagerly over ``STEPS`` steps, then the tensor-parallel Llama, DeepSeek V2 and V3; then DP=2 with EP,
    initialised from torchrun's environment variables: the groups, ``agree``, ``all_or_none`` with
    a failure on rank 1, and last (it leaves the group out of step) an agreement that rank 1
    never joins (rank 0 must give up within ``deadline_s``)."""
    state = init_parallel(ParallelConfig(tensor_parallel_size=2), rank=rank, world_size=world_size,
                          init_method=f"tcp://127.0.0.1:{ports[0]}", timeout_s=240)
    out: dict = {"tp_groups": _groups(state)}
    out.update(_compiled_collectives(rank, state))
    out["llama"] = tensor_parallel_llama(state)
    out["deepseek"] = {version: tensor_parallel_deepseek(state, version) for version in ("v2", "v3")}
    destroy_parallel()
    # the second time as torchrun would start it: everything from the environment
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[1]), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    state = init_parallel(ParallelConfig(data_parallel_size=2, enable_expert_parallel=True), timeout_s=240)
    out["dp_groups"] = _groups(state)
    out["max"] = agree([rank, 10 - rank], "max", state)
    out["min"] = agree([rank, 10 - rank], "min", state)
    out["failure"] = _guarded_failure(rank, state, deadline_s)
    out["absent"] = _absent_rank(rank, state, deadline_s)
    return out


def _compiled_collectives(rank: int, state) -> dict:
    graphs: list = []
    compiled = torch.compile(collective_step, backend=recording_backend(graphs), fullgraph=True)
    steps = []
    for step in range(STEPS):
        x = rank_input(step, rank)
        eager, graph = collective_step(x, state.tp), compiled(x, state.tp)
        steps.append({"eager": [t.tolist() for t in eager], "graph": [t.tolist() for t in graph]})
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    return {"steps": steps, "compiles": len(graphs), "targets": targets}


def _groups(state) -> dict:
    return {name: getattr(state, name).ranks for name in ("world", "tp", "dp", "ep", "host")}


def _guarded_failure(rank: int, state, deadline_s: float) -> dict:
    start = time.monotonic()
    try:
        with all_or_none("the injected step", state, timeout_s=deadline_s):
            if rank == 1:
                raise ValueError("injected on rank 1")
    except Exception as e:  # noqa: BLE001  (what each rank raised is the result)
        return {"raised": type(e).__name__, "message": str(e),
                "failed_ranks": getattr(e, "failed_ranks", None), "seconds": time.monotonic() - start}
    return {"raised": None, "seconds": time.monotonic() - start}


def _absent_rank(rank: int, state, deadline_s: float) -> dict:
    """Rank 1 never joins the agreement (it waits past the deadline, then leaves)."""
    if rank == 1:
        time.sleep(deadline_s + 1.0)
        return {}
    start = time.monotonic()
    try:
        agree([1], "max", state, timeout_s=deadline_s, what="the absent rank's agreement")
    except AgreementTimeout as e:
        return {"raised": "AgreementTimeout", "message": str(e), "seconds": time.monotonic() - start}
    return {"raised": None, "seconds": time.monotonic() - start}


# ---- tensor-parallel Llama ----

PROMPTS = ([1, 5, 9, 3], [7, 2, 8])
DECODE_STEPS = 4


def greedy_decode(runners, sched=None) -> tuple[list[list[int]], list[list]]:
    """Prefill ``PROMPTS`` one by one, then ``DECODE_STEPS`` steps decoding both rows, through every
    runner on the same entries (each on its own caches); the first runner's greedy tokens drive.
    Returns the decode steps' tokens and, per runner, its decode steps' logits (lists)."""
    from runner_helpers import Schedule

    sched = Schedule() if sched is None else sched
    for s, prompt in enumerate(PROMPTS):
        entry = sched.add(s, list(prompt), new_tokens=100)
        outs = [r.execute([entry]) for r in runners]
        sched.advance([s], [entry], outs[0])
    tokens, logits = [], [[] for _ in runners]
    for _ in range(DECODE_STEPS):
        entries = sched.decode_entries()
        outs = [r.execute(entries) for r in runners]
        for log, out in zip(logits, outs):
            log.append(out.tolist())
        tokens.append(outs[0].argmax(-1).tolist())
        sched.advance(list(range(len(PROMPTS))), entries, outs[0])
    return tokens, logits


def tensor_parallel_llama(state) -> dict:
    """This rank's TP share of the seeded tiny Llama, cut from its full weights, decoded greedily by
    a graph runner (Inductor, capture size 2) and an eager runner side by side."""
    from runner_helpers import small_model

    from ascend_graph.models.llama import LlamaForCausalLM

    full = small_model("llama")
    model = LlamaForCausalLM(full.config, tp=state.tp).eval()
    model.load_state_dict({name: model.tp_shard(name, t) for name, t in full.state_dict().items()})
    return {**_graph_and_eager_decode(model), "kv_heads": [spec.num_kv_heads for spec in model.kv_cache_specs()]}


def small_deepseek(version: str):
    """The seeded tiny DeepSeek ``"v2"`` (a dense layer, then a MoE layer) or ``"v3"`` (one MoE
    layer: V2 covers the dense MLP; a layer less to compile), float32."""
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM

    if version == "v2":
        return DeepseekForCausalLM(DeepseekConfig.small(num_hidden_layers=2)).eval()
    return DeepseekForCausalLM(DeepseekConfig.small_v3(num_hidden_layers=1, first_k_dense_replace=0)).eval()


def tensor_parallel_deepseek(state, version: str) -> dict:
    """This rank's TP share of the tiny DeepSeek ``version``, cut from its full weights, decoded
    like the Llama; with the shapes of its share."""
    from ascend_graph.models import DeepseekForCausalLM

    full = small_deepseek(version)
    model = DeepseekForCausalLM(full.config, init_weights=False, tp=state.tp).eval()
    model.load_state_dict({name: model.tp_shard(name, t) for name, t in full.state_dict().items()})
    shapes = {"heads": model.model.layers[0].self_attn.num_heads,
              "expert_gate_up": list(model.model.layers[-1].mlp.experts.gate_up_proj.shape),
              "latent_cache": [[spec.kv_lora_rank, spec.qk_rope_head_dim] for spec in model.kv_cache_specs()]}
    return {**_graph_and_eager_decode(model), "shapes": shapes}


def _graph_and_eager_decode(model) -> dict:
    """``model`` decoded greedily by a graph runner (Inductor, capture size 2) and an eager runner
    side by side, then one more graph step under the profiler (its collectives)."""
    from runner_helpers import Schedule, make_runner

    from ascend_graph.config import GraphConfig

    graph_config = GraphConfig(enabled=True, backend="inductor", capture_sizes=(2,), max_batch_size=2)
    graph, eager = make_runner(model, graph_config), make_runner(model, GraphConfig(enabled=False))
    sched = Schedule()
    tokens, (graph_logits, eager_logits) = greedy_decode([graph, eager], sched)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        graph.execute(sched.decode_entries(), mode="graph")  # one more graph step, on every rank
    ops = [e.name for e in prof.events() if e.name.startswith(("c10d::", "_c10d_functional::"))]
    return {"tokens": tokens, "graph_logits": graph_logits, "eager_logits": eager_logits, "graph_step_ops": ops,
            "stats": {k: graph.stats.to_dict()[k]
                      for k in ("compiles", "recompiles", "compile_failures", "graph_steps")}}
