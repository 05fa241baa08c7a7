"""Tensor parallelism on one host: a TP=2 graph decode step against TP=1 on the same cores.

TP=2 is two processes (gloo over 127.0.0.1, one torch thread each), TP=1 one process with two
threads; both run graph mode (Inductor, captured) on the same seeded model, the TP ranks on the
shares ``DeepseekForCausalLM.tp_shard`` cuts from the full model. The two worlds take turns,
round by round (``common.ratio_of_rounds``: medians, the rounds' range); the greedy tokens of a
few decode steps are compared. Then, on the TP ranks: the collectives of one graph step (count,
time, share of the step; ``torch.profiler``), and gloo's all_reduce alone at the step's sizes and
at DeepSeek-V3's hidden size (bytes, ms per call). gloo over loopback is the correctness path on
CPU, not a fast one: these figures say what sharding costs there, not what a device would pay.

    TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.multi_device            # V2-Lite slice
    TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.multi_device --quick    # small model

The results go under ``multi_device`` in ``benchmarks/results/<machine>.json`` (``--quick``: a
temporary file), beside the suite's other parts.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterable

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import conditions, merge_part, ratio_of_rounds, write_json  # noqa: E402

V3_HIDDEN, V3_LAYERS = 7168, 61  # DeepSeek-V3: every layer all-reduces twice under TP (attention, MLP/MoE)
COLLECTIVE_PREFIXES = ("c10d::", "_c10d_functional::", "gloo:")


class Side:
    """One process of a world: its share of the model, a graph runner captured at ``sizes``, a
    prefilled decode batch per size and the greedy tokens of ``greedy_steps`` steps from it."""

    def __init__(self, case_name: str, quick: bool, weights: str, sizes: tuple[int, ...], tp_size: int, rank: int,
                 threads: int, init_file: str | None, backend: str, greedy_steps: int, timeout_s: float) -> None:
        from ascend_graph.config import GraphConfig
        from ascend_graph.distributed import ParallelConfig, init_parallel
        from ascend_graph.engine.block_manager import BlockManager
        from benchmarks.common import set_malloc_keeps_freed_memory
        from benchmarks.models import cases, decode_batch, make_runner

        torch.set_num_threads(threads)
        self.group = None
        if tp_size > 1:
            state = init_parallel(ParallelConfig(tensor_parallel_size=tp_size), rank=rank, world_size=tp_size,
                                  init_method=f"file://{init_file}", timeout_s=timeout_s)
            self.group = state.tp
        case = cases(quick)[case_name]
        self.model = _share(case, weights, self.group)
        set_malloc_keeps_freed_memory(True)  # as the suite's steps run; after the build, whose copies it would keep
        context = case.context + greedy_steps
        config = GraphConfig(enabled=True, backend=backend, capture_sizes=sizes, max_batch_size=max(sizes))
        self.runner = make_runner(self.model, config, sizes, context, max_model_len=context)
        start = time.perf_counter()
        self.runner.capture(show_progress=False)
        capture_s = time.perf_counter() - start
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_size)
        self.entries = {n: decode_batch(self.runner, self.blocks, n, case.context) for n in sizes}
        for n in sizes:  # room for the greedy steps
            for i in range(n):
                self.blocks.ensure((n, i), context)
        greedy = {n: self._greedy(n, greedy_steps) for n in sizes}
        stats = self.runner.stats.to_dict()
        self.info = {"greedy": greedy, "capture_s": capture_s, "threads": threads,
                     "stats": {k: stats[k] for k in ("compiles", "recompiles", "compile_failures")},
                     "case": {"name": case.name, "dtype": case.dtype_name, "context": case.context,
                              "layers": case.config.num_hidden_layers, "hidden": case.config.hidden_size}}

    def _greedy(self, n: int, steps: int) -> dict:
        """Greedy graph steps from the prefilled batch: each step's tokens and float32 logits."""
        from ascend_graph.runner import SequenceStep

        seqs, tokens, logits = list(self.entries[n]), [], []
        for _ in range(steps):
            logits.append(self.runner.execute(seqs, mode="graph").clone())  # [n, V]
            tokens.append(logits[-1].argmax(-1).tolist())
            seqs = [SequenceStep([t], s.num_cached + 1, s.block_table) for s, t in zip(seqs, tokens[-1])]
        return {"tokens": tokens, "logits": logits}

    def time_steps(self, n: int, calls: int) -> float:
        """Seconds per graph step of the batch of ``n`` (ranks start together: a barrier first)."""
        if self.group is not None:
            torch.distributed.barrier(group=self.group.pg)
        start = time.perf_counter()
        for _ in range(calls):
            self.runner.execute(self.entries[n], mode="graph")
        return (time.perf_counter() - start) / calls

    def profile(self, n: int, steps: int) -> dict:
        """The collectives of ``steps`` graph steps under the profiler: calls and ms per step by op
        and input shape, and the profiled step's own ms."""
        from torch.profiler import ProfilerActivity, profile

        self.time_steps(n, 1)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step_s = self.time_steps(n, steps)
        averages = prof.key_averages(group_by_input_shape=True)
        ops = [{"op": e.key, "calls_per_step": e.count / steps, "ms_per_step": e.cpu_time_total / steps / 1e3,
                "shapes": [list(s) for s in e.input_shapes if s]}
               for e in averages if e.key.startswith(COLLECTIVE_PREFIXES)]
        top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
        return {"step_ms": step_s * 1e3, "ops": ops,  # and where the step's own thread spends its time
                "top_self_ms_per_step": {e.key: round(e.self_cpu_time_total / steps / 1e3, 3) for e in top}}

    def gloo_all_reduce(self, shape: tuple[int, ...], dtype_name: str, rounds: int, calls: int) -> float:
        """Median seconds per blocking gloo all_reduce of a ``shape`` tensor, over ``rounds`` loops."""
        x = torch.ones(shape, dtype=getattr(torch, dtype_name))
        pg = self.group.pg
        for _ in range(3):
            torch.distributed.all_reduce(x, group=pg)
        samples = []
        for _ in range(rounds):
            torch.distributed.barrier(group=pg)
            start = time.perf_counter()
            for _ in range(calls):
                torch.distributed.all_reduce(x, group=pg)
            samples.append((time.perf_counter() - start) / calls)
        return statistics.median(samples)

    def close(self) -> None:
        if self.group is not None:
            from ascend_graph.distributed import destroy_parallel
            destroy_parallel()


def _share(case, weights: str, group):
    """This rank's share (the whole model without ``group``) of ``case``'s weights saved in
    ``weights``, read through a memory map (the ranks hold no full copy), on huge pages."""
    from ascend_graph.distributed import Group
    from ascend_graph.models import DeepseekForCausalLM
    from ascend_graph.runtime import weights_on_huge_pages

    model = DeepseekForCausalLM(case.config, dtype=case.dtype, init_weights=False, tp=group or Group.single()).eval()
    full = torch.load(weights, mmap=True, weights_only=True)
    model.load_state_dict({name: model.tp_shard(name, t) for name, t in full.items()})
    del full
    weights_on_huge_pages(model)
    return model


def _save_weights(case_name: str, quick: bool, path: str) -> None:
    """The seeded full model of the case, its state dict saved to ``path`` (built once, here)."""
    from benchmarks.models import build, cases

    torch.save(build(cases(quick)[case_name], huge_pages=False).state_dict(), path)


TP1, TP1_ONE, RANKS = ("tp1",), ("tp1_1thread",), ("rank0", "rank1")


def measure(case_name: str, sizes: tuple[int, ...], rounds: int, calls: int, quick: bool,
            backend: str = "inductor", greedy_steps: int = 4, gloo_rounds: int = 5, gloo_calls: int = 20,
            one_thread: bool = True, timeout_s: float = 1800.0) -> dict:
    """TP=2 vs TP=1 per batch size in ``sizes`` (and TP=1 on one thread, with ``one_thread``), the
    collectives of a TP=2 step, gloo's cost."""
    with tempfile.TemporaryDirectory(prefix="ag-multi-device-") as tmp:
        init_file, weights = os.path.join(tmp, "init"), os.path.join(tmp, "weights.pt")
        _save_weights(case_name, quick, weights)
        common = (case_name, quick, weights, tuple(sizes))
        tail = (backend, greedy_steps, timeout_s)
        specs = {"tp1": (Side, (*common, 1, 0, 2, None, *tail)),
                 **({"tp1_1thread": (Side, (*common, 1, 0, 1, None, *tail))} if one_thread else {}),
                 **{f"rank{r}": (Side, (*common, 2, r, 1, init_file, *tail)) for r in range(2)}}
        start = time.perf_counter()
        with Workers(specs, idle_s=timeout_s) as workers:
            info = workers.ready(timeout_s)
            setup_s = time.perf_counter() - start
            rows = [_row(workers, info, n, rounds, calls, gloo_rounds, gloo_calls) for n in sizes]
    case = info["tp1"]["case"]
    reduces = 2 * case["layers"]
    return {"model": case["name"], "dtype": case["dtype"], "context": case["context"], "layers": case["layers"],
            "hidden": case["hidden"], "backend": backend, "all_reduces_per_step": reduces, "rounds": rounds,
            "calls_per_round": calls, "greedy_steps": greedy_steps, "setup_s": round(setup_s, 1),
            "threads": {name: i["threads"] for name, i in info.items()},
            "capture_s": {name: round(i["capture_s"], 1) for name, i in info.items()},
            "stats": {name: i["stats"] for name, i in info.items()},
            "tokens_equal": all(r["tokens"]["equal"] for r in rows),
            "tokens_equal_or_near_ties": all(r["tokens"]["equal"] or r["tokens"]["first_difference"]["near_tie"]
                                             for r in rows), "rows": rows,
            "v3": {"layers": V3_LAYERS, "hidden": V3_HIDDEN, "all_reduces_per_step": 2 * V3_LAYERS}}


def _row(workers: Workers, info: dict, n: int, rounds: int, calls: int, gloo_rounds: int, gloo_calls: int) -> dict:
    """Batch ``n``: the worlds' steps in turns, their tokens, a TP=2 step's collectives, gloo's cost."""
    case = info["tp1"]["case"]
    worlds = {"tp1": TP1, **({"tp1_1thread": TP1_ONE} if "tp1_1thread" in info else {}), "tp2": RANKS}
    for names in worlds.values():  # warm-up
        workers.ask(names, "time_steps", n, 2)
    samples, load = {name: [] for name in worlds}, [os.getloadavg()[0]]
    for _ in range(rounds):  # the worlds take turns; a TP=2 step lasts as long as its slower rank
        for name, names in worlds.items():
            samples[name].append(max(workers.ask(names, "time_steps", n, calls).values()))
    t, load = {k: statistics.median(v) for k, v in samples.items()}, load + [os.getloadavg()[0]]
    prof = workers.ask(RANKS, "profile", n, max(calls, 3))["rank0"]
    tp1_prof = workers.ask(worlds["tp1_1thread" if "tp1_1thread" in worlds else "tp1"], "profile", n, max(calls, 3))
    gloo = {what: _gloo(workers, n, hidden, dtype, gloo_rounds, gloo_calls)
            for what, hidden, dtype in (("step", case["hidden"], case["dtype"]), ("v3", V3_HIDDEN, "bfloat16"))}
    row = {"batch": n, **{f"{k}_ms": v * 1e3 for k, v in t.items()},
           **{f"tp2_over_{k}": ratio_of_rounds(samples, "tp2", k) for k in worlds if k != "tp2"},
           "tokens": _tokens(info, n),
           "collectives": _collectives(prof, t["tp2"], gloo["step"]["ms_per_call"], 2 * case["layers"]),
           "gloo": gloo, "v3_gloo_ms_per_step": 2 * V3_LAYERS * gloo["v3"]["ms_per_call"],
           "load_1m": load,  # the host's load average before and after the rounds
           "top_self_ms_per_step": {"tp2_rank0": prof["top_self_ms_per_step"],
                                    **{k: v["top_self_ms_per_step"] for k, v in tp1_prof.items()}}}
    r = row["tp2_over_tp1"]
    print(f"  {case['name']} batch {n:>2}: TP1 {row['tp1_ms']:8.2f} ms (one thread {row.get('tp1_1thread_ms', 0):.2f})"
          f"  TP2 {row['tp2_ms']:8.2f} ms  TP2/TP1 {r['ratio']:.2f} ({r['min']:.2f}-{r['max']:.2f})  tokens equal: "
          f"{row['tokens']['equal']}  all_reduce {row['collectives']['profiled_share']:.0%} of the step, gloo "
          f"{gloo['step']['ms_per_call']:.3f} ms per call ({gloo['step']['bytes']} B)", flush=True)
    return row


def _gloo(workers: Workers, n: int, hidden: int, dtype: str, rounds: int, calls: int) -> dict:
    """gloo's all_reduce of an ``[n, hidden]`` tensor alone on the TP ranks: its bytes, ms per call."""
    s = max(workers.ask(RANKS, "gloo_all_reduce", (n, hidden), dtype, rounds, calls).values())
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return {"shape": [n, hidden], "dtype": dtype, "bytes": n * hidden * size, "ms_per_call": s * 1e3}


def _tokens(info: dict, n: int) -> dict:
    """Whether both worlds (and both ranks) decoded the same greedy tokens; where they first differ,
    whether it is a near-tie: both tokens' logits, in each world, within that step's largest
    difference between the worlds' logits (their inputs were the same up to that step)."""
    g = {name: i["greedy"][n] for name, i in info.items()}
    one, two = g["tp1"], g["rank0"]
    out = {"equal": one["tokens"] == two["tokens"], "ranks_equal": two["tokens"] == g["rank1"]["tokens"],
           "tp1_threads_equal": one["tokens"] == g.get("tp1_1thread", one)["tokens"],
           "first_step_max_abs_diff": (one["logits"][0] - two["logits"][0]).abs().max().item(),
           "tp1": one["tokens"], "tp2": two["tokens"]}
    differ = [(s, r) for s, (a, b) in enumerate(zip(one["tokens"], two["tokens"])) for r in range(n) if a[r] != b[r]]
    if differ:
        s, r = differ[0]
        a, b = one["tokens"][s][r], two["tokens"][s][r]
        diff = (one["logits"][s] - two["logits"][s]).abs().max().item()
        gaps = [(x[s][r, a] - x[s][r, b]).abs().item() for x in (one["logits"], two["logits"])]
        out["first_difference"] = {"step": s, "row": r, "max_abs_diff": diff, "gaps": gaps,
                                   "near_tie": max(gaps) <= diff}
    return out


def _collectives(prof: dict, tp2_s: float, gloo_ms: float, expected: int) -> dict:
    """The all-reduces of one TP=2 graph step: how many the profiler saw called (``c10d::`` ops on
    the step's thread), gloo's time on them (``gloo:`` events, on gloo's thread, from each one's
    start to the peer's answer: the step waits for every one, the next op needs its sum), their
    share of the profiled step, and the loop's estimate (the expected calls x gloo's ms per call
    alone, over the unprofiled step)."""
    ops = [o for o in prof["ops"] if "barrier" not in o["op"]]  # the barrier before the timed steps
    calls = max((o["calls_per_step"] for o in ops if not o["op"].startswith("gloo:")), default=0.0)
    ms = sum(o["ms_per_step"] for o in ops if o["op"].startswith("gloo:"))
    return {"all_reduces_profiled": calls, "all_reduces_expected": expected, "ms_per_step": ms,
            "profiled_step_ms": prof["step_ms"], "profiled_share": ms / prof["step_ms"],
            "loop_estimate_share": expected * gloo_ms / (tp2_s * 1e3), "ops": prof["ops"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the small model, batches 1 and 8, few rounds")
    p.add_argument("--model", choices=("small", "v2_lite_slice", "v2_lite_fp32"), default=None,
                   help="default: v2_lite_slice (small with --quick)")
    p.add_argument("--sizes", default="1,8")
    p.add_argument("--rounds", type=int, default=None, help="default 7 (3 with --quick)")
    p.add_argument("--calls", type=int, default=None, help="graph steps per round, default 3")
    p.add_argument("--backend", default="inductor", help="the graph backend of both worlds")
    p.add_argument("--no-one-thread", action="store_true",
                   help="leave out TP=1 on one thread (a fourth process, as large as TP=1's)")
    p.add_argument("--json", default=None, help="default: under multi_device in benchmarks/results/<machine>.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the coordinator only sends commands; the worlds set their own threads
    model = args.model or ("small" if args.quick else "v2_lite_slice")
    res = measure(model, tuple(int(s) for s in args.sizes.split(",")), args.rounds or (3 if args.quick else 7),
                  args.calls or 3, args.quick, args.backend,
                  gloo_rounds=3 if args.quick else 5, gloo_calls=5 if args.quick else 20,
                  one_thread=not args.no_one_thread)
    command = " ".join(["python -m benchmarks.multi_device", *(argv if argv is not None else sys.argv[1:])])
    res.update(conditions={**conditions(), "quick": args.quick}, command=command)
    if args.json:
        write_json(args.json, res)
    else:
        merge_part("multi_device", res, quick=args.quick)
    return res


# -- the worker processes: each builds one object, then runs the methods asked of it --------


class WorkerError(RuntimeError):
    """A worker raised, died, or did not answer in time; the message carries what is known."""


class Workers:
    """Named worker processes (``specs``: name -> (factory, args)), each serving one object."""

    def __init__(self, specs: dict[str, tuple[Callable[..., Any], tuple]], idle_s: float = 900.0) -> None:
        ctx = mp.get_context("spawn")
        self.replies: mp.Queue = ctx.Queue()
        self.commands = {name: ctx.Queue() for name in specs}
        self.procs = {name: ctx.Process(target=_serve, args=(name, factory, args, self.commands[name],
                                                               self.replies, idle_s), daemon=True)
                      for name, (factory, args) in specs.items()}
        for p in self.procs.values():
            p.start()

    def ready(self, timeout_s: float) -> dict[str, Any]:
        """Wait until every worker has built its object; what each factory's object reported."""
        return self._collect(list(self.procs), timeout_s, "start")

    def ask(self, names: Iterable[str], method: str, *args: Any, timeout_s: float = 300.0) -> dict[str, Any]:
        """``method(*args)`` on the objects of ``names`` (sent to all, then awaited); their results by name."""
        names = list(names)
        for name in names:
            self.commands[name].put((method, args))
        return self._collect(names, timeout_s, method)

    def _collect(self, names: list[str], timeout_s: float, what: str) -> dict[str, Any]:
        deadline, got = time.monotonic() + timeout_s, {}
        while len(got) < len(names):
            try:
                name, status, payload = self.replies.get(timeout=0.5)
            except queue.Empty:
                dead = [n for n in names if n not in got and not self.procs[n].is_alive()]
                if dead or time.monotonic() > deadline:
                    why = (f"{', '.join(dead)} exited (codes {[self.procs[n].exitcode for n in dead]})" if dead
                           else f"no answer within {timeout_s:g} s from {[n for n in names if n not in got]}")
                    raise WorkerError(f"{what}: {why}") from None
                continue
            if status == "error":
                raise WorkerError(f"{what}: worker {name} raised:\n{payload}")
            got[name] = payload
        return got

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask every worker to leave, wait up to ``timeout_s`` in all, then kill the ones left."""
        for name, p in self.procs.items():
            if p.is_alive():
                self.commands[name].put(None)
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(name: str, factory, args: tuple, commands, replies, idle_s: float) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        obj = factory(*args)
        replies.put((name, "ok", getattr(obj, "info", None)))
    except BaseException:  # noqa: BLE001  (reported to the coordinator with its traceback)
        replies.put((name, "error", traceback.format_exc()))
        return
    while True:
        try:
            command = commands.get(timeout=idle_s)
        except queue.Empty:
            command = None
        if command is None:
            break
        method, margs = command
        try:
            replies.put((name, "ok", getattr(obj, method)(*margs)))
        except BaseException:  # noqa: BLE001
            replies.put((name, "error", traceback.format_exc()))
    if hasattr(obj, "close"):
        obj.close()


if __name__ == "__main__":
    main()
