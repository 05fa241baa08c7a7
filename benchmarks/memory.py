"""Memory: peak resident memory of a graph-mode run vs an eager run of the same requests, and
per-step allocations at two cache capacities.

Peak RSS is measured in fresh processes (``python -m benchmarks.memory --child graph|eager``),
each building the model, allocating the runner's caches (once), prefilling the same prompts and
decoding the same steps (``graph_frozen``: graph mode with sizes from 2 rows frozen,
``GraphConfig.inductor.freezing_min_batch=2``; ``graph_aot``: graph mode from AOTInductor packages,
``GraphConfig.inductor.aot``, compiled in that process into a temporary directory). The kernel's peak mark is reset after the model is built (its float32
init temporaries would otherwise set the peak for both); ``VmHWM`` is read at the end. Per-step allocations are the bytes the
CPU allocator hands out during one decode step (``torch.profiler`` memory events), graph and
eager, with the cache at two capacities: they must not grow with the capacity.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile


def child(mode: str, model_name: str, sizes: tuple[int, ...], steps: int, quick: bool) -> dict:
    """Run ``steps`` decode steps of each batch size in ``mode``; peak RSS and what it was before."""
    from ascend_graph.engine.block_manager import BlockManager
    from ascend_graph.config import GraphConfig, InductorOptions
    from benchmarks.models import build, cases, decode_batch, make_runner

    case = cases(quick)[model_name]
    model = build(case)
    gc.collect()
    rss_model = _reset_peak_rss()  # building the model (float32 temporaries) must not set the peak
    packages = tempfile.TemporaryDirectory(prefix="ag-memory-aoti-") if mode == "graph_aot" else None
    config = GraphConfig(enabled=mode != "eager", backend="inductor", capture_sizes=sizes, max_batch_size=max(sizes),
                         inductor=InductorOptions(freezing_min_batch=2 if mode == "graph_frozen" else None,
                                                  aot=packages is not None),
                         compile_cache_dir=packages and packages.name)
    runner = make_runner(model, config, sizes, case.context)
    ptrs = [t.data_ptr() for c in runner.kv_caches for t in c]
    runner.capture(show_progress=False)
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    for n in sizes:
        entries = decode_batch(runner, blocks, n, case.context)
        for _ in range(steps):
            runner.execute(entries, mode="eager" if mode == "eager" else "graph")
    same = ptrs == [t.data_ptr() for c in runner.kv_caches for t in c]
    if packages is not None:
        packages.cleanup()
    return {"mode": mode, "peak_rss_bytes": _status_bytes("VmHWM"), "peak_rss_whole_process_bytes":
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss_after_build_bytes": rss_model, "cache_addresses_unchanged": same,
            "graph_steps": runner.stats.graph_steps}


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (``clear_refs`` 5); the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def step_allocations(model_name: str, batch: int, capacities: tuple[int, int], quick: bool) -> list[dict]:
    """Bytes allocated during one decode step, graph and eager, at each cache capacity."""
    from torch.profiler import ProfilerActivity, profile

    from ascend_graph.engine.block_manager import BlockManager
    from ascend_graph.config import GraphConfig
    from benchmarks.models import build, cases, decode_batch, make_runner

    case = cases(quick)[model_name]
    model, rows = build(case), []
    for num_blocks in capacities:
        config = GraphConfig(enabled=True, backend="inductor", capture_sizes=(batch,), max_batch_size=batch)
        runner = make_runner(model, config, (batch,), case.context, num_blocks=num_blocks)
        runner.capture(show_progress=False)
        entries = decode_batch(runner, BlockManager(num_blocks, runner.block_size), batch, case.context)
        for mode in ("graph", "eager"):
            runner.execute(entries, mode=mode)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                runner.execute(entries, mode=mode)
            allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
            rows.append({"mode": mode, "num_blocks": num_blocks, "allocated_bytes": allocated})
    return rows


def run_child(mode: str, model: str, sizes: tuple[int, ...], steps: int, quick: bool) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.memory", "--child", mode, "--model", model,
           "--sizes", ",".join(map(str, sizes)), "--steps", str(steps)] + (["--quick"] if quick else [])
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(model: str, sizes: tuple[int, ...], steps: int, quick: bool, frozen: bool = False,
            aot: bool = False) -> dict:
    """Peak RSS of graph and eager runs of the same requests (and of runs with freezing and
    from AOTInductor packages), and per-step allocations."""
    graph, eager = (run_child(m, model, sizes, steps, quick) for m in ("graph", "eager"))
    res = {"model": model, "sizes": list(sizes), "steps_per_size": steps, "graph": graph, "eager": eager,
           "peak_ratio": graph["peak_rss_bytes"] / eager["peak_rss_bytes"],
           "step_allocations": step_allocations("small", 8, (64, 8192), quick)}
    if frozen:
        res["graph_frozen"] = run_child("graph_frozen", model, sizes, steps, quick)
        res["frozen_peak_ratio"] = res["graph_frozen"]["peak_rss_bytes"] / eager["peak_rss_bytes"]
    if aot:
        res["graph_aot"] = run_child("graph_aot", model, sizes, steps, quick)
        res["aot_peak_ratio"] = res["graph_aot"]["peak_rss_bytes"] / eager["peak_rss_bytes"]
    print(f"  memory {model}: peak RSS graph {graph['peak_rss_bytes'] / 2**20:.0f} MiB, eager "
          f"{eager['peak_rss_bytes'] / 2**20:.0f} MiB ({res['peak_ratio']:.2f}x)", flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", choices=["graph", "graph_frozen", "graph_aot", "eager"])
    p.add_argument("--model", default="small")
    p.add_argument("--sizes", default="1,8")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    if args.child:
        print(json.dumps(child(args.child, args.model, sizes, args.steps, args.quick)))
    else:
        print(json.dumps(measure(args.model, sizes, args.steps, args.quick), indent=2))


if __name__ == "__main__":
    main()
