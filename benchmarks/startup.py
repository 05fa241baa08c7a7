"""Start-up: time to warm up and capture every size, cold vs with the persistent compile cache.

Each measurement is a fresh process (``python -m benchmarks.startup --child ...``) that builds
the model and runs ``GraphRunner.capture()`` with ``GraphConfig.compile_cache_dir`` set: cold
with an empty directory, warm with the directory a cold run filled (Inductor's FX graph cache
and AOTAutograd cache live there). A third variant packs the cold run's caches with
``torch.compiler.save_cache_artifacts()`` and a fresh process loads them into an empty
directory with ``load_cache_artifacts`` first (the portable form, for shipping to another node).

Each child also counts the C++ compiler runs Inductor makes and their seconds: on CPU the
portable artifacts hold the generated source, not the compiled kernels, so a run that loads
them still rebuilds every kernel and the C++ wrapper with the compiler.

``aot_cold`` / ``aot_warm``: the same with ``GraphConfig.inductor.aot`` (each size exported and
compiled by AOTInductor into a package in the cache directory; warm, the packages are loaded).

Every child reports each size's capture seconds and compile cache outcome (``RunnerStats``).
``measure_demo`` runs the demo's own capture (``ascend-graph demo``: its model, sizes and cache
geometry) cold and warm, ``repeats`` times, against the goals ``DEMO_GOALS``, by default and
with ``--no-precompile`` (``inductor.precompile`` off: the kernels built one by one as the first
call needs them):

    python -m benchmarks --parts startup
    TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.startup --demo --repeats 3 [--no-precompile]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import statistics
import time

# The demo's capture of its default sizes (1, 2, 4, 8), seconds: the goals
DEMO_GOALS = {"cold_capture_s": 30.0, "warm_capture_s": 5.0}
DEMO_SIZES = (1, 2, 4, 8)


def count_cpp_compiles() -> dict:
    """Wrap Inductor's C++ build step; the returned dict counts its runs and their seconds."""
    from torch._inductor import cpp_builder

    seen = {"runs": 0, "seconds": 0.0}
    build = cpp_builder.CppBuilder.build

    def timed_build(self) -> None:
        t = time.perf_counter()
        try:
            build(self)
        finally:
            seen["runs"] += 1
            seen["seconds"] += time.perf_counter() - t

    cpp_builder.CppBuilder.build = timed_build
    return seen


def child(args: argparse.Namespace) -> dict:
    """Build the model, capture every size; report where the seconds went."""
    t0 = time.perf_counter()
    import torch

    cpp = count_cpp_compiles()

    from ascend_graph.compile.inductor import cache_dir_for_compile

    t_import = time.perf_counter()
    runner = demo_runner(args) if args.model == "demo" else suite_runner(args)
    t_build = time.perf_counter()
    if args.load_artifacts:
        with open(args.load_artifacts, "rb") as f, cache_dir_for_compile(args.cache_dir):
            torch.compiler.load_cache_artifacts(f.read())
    t_load = time.perf_counter()
    cpu0 = process_cpu_s()
    runner.capture(show_progress=False)
    t_capture = time.perf_counter()
    stats = runner.stats.to_dict()
    out = {"import_s": t_import - t0, "build_s": t_build - t_import, "load_artifacts_s": t_load - t_build,
           "capture_s": t_capture - t_load, "capture_cpu_s": round(process_cpu_s() - cpu0, 3),
           "total_s": t_capture - t0, "compiles": runner.stats.compiles,
           "cpp_compiler_runs": cpp["runs"], "cpp_compiler_s": cpp["seconds"],
           "packages_loaded": runner.stats.packages_loaded, "per_size": stats["capture"]}
    if args.save_artifacts:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            with open(args.save_artifacts, "wb") as f:
                f.write(saved[0])
            out["artifact_bytes"] = len(saved[0])
    return out


def process_cpu_s() -> float:
    """CPU seconds of this process and the children it waited for (the C++ compiler)."""
    import resource

    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def suite_runner(args: argparse.Namespace):
    """A runner over a suite model (``benchmarks.models``) with Inductor at ``--sizes``."""
    from ascend_graph.config import GraphConfig, InductorOptions
    from benchmarks.models import build, cases, make_runner

    case = cases(args.quick)[args.model]
    sizes = tuple(int(s) for s in args.sizes.split(","))
    config = GraphConfig(enabled=True, backend="inductor", capture_sizes=sizes, max_batch_size=max(sizes),
                         compile_cache_dir=args.cache_dir, inductor=InductorOptions(aot=args.aot))
    return make_runner(build(case), config, sizes, case.context)


def demo_runner(args: argparse.Namespace):
    """The runner ``ascend-graph demo --capture-sizes <sizes> --compile-cache-dir <dir>`` captures,
    on the threads the command uses."""
    import torch

    from ascend_graph.cli import build_parser
    from ascend_graph.cli.commands import load_model, make_engine

    cli = build_parser().parse_args(["demo", "--capture-sizes", args.sizes, "--compile-cache-dir", args.cache_dir]
                                    + (["--aot-inductor"] if args.aot else [])
                                    + (["--graph-config", args.graph_config] if args.graph_config else []))
    torch.set_num_threads(1)  # the command's default for its built-in models (cli.main)
    return make_engine(load_model(cli)[0], cli, graph=True).runner


def run_child(model: str, sizes: str, cache_dir: str, quick: bool, **flags) -> dict:
    """One fresh process; its JSON line."""
    cmd = [sys.executable, "-m", "benchmarks.startup", "--child", "--model", model, "--sizes", sizes,
           "--cache-dir", cache_dir] + (["--quick"] if quick else [])
    for k, v in flags.items():
        cmd += [f"--{k.replace('_', '-')}"] + ([] if v is True else [v])
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(model: str, sizes: tuple[int, ...], quick: bool, portable: bool = True, aot: bool = True) -> dict:
    """Cold, warm (same cache directory), (``portable``) portable-artifact and (``aot``) AOTInductor
    cold and warm start-up of ``model``."""
    s = ",".join(map(str, sizes))
    with tempfile.TemporaryDirectory(prefix="ag-startup-") as tmp:
        art = os.path.join(tmp, "artifacts.bin")
        cold = run_child(model, s, os.path.join(tmp, "cache"), quick, **({"save_artifacts": art} if portable else {}))
        warm = run_child(model, s, os.path.join(tmp, "cache"), quick)
        res = {"model": model, "sizes": list(sizes), "cold": cold, "warm": warm,
               "warm_speedup_capture": cold["capture_s"] / warm["capture_s"]}
        if portable:
            p = res["portable_artifacts"] = run_child(model, s, os.path.join(tmp, "fresh"), quick, load_artifacts=art)
            res["portable_speedup_capture"] = cold["capture_s"] / (p["capture_s"] + p["load_artifacts_s"])
        if aot:
            res["aot_cold"] = run_child(model, s, os.path.join(tmp, "aot"), quick, aot=True)
            res["aot_warm"] = run_child(model, s, os.path.join(tmp, "aot"), quick, aot=True)
    print(f"  start-up {model}: capture cold {cold['capture_s']:.1f} s, warm {warm['capture_s']:.1f} s "
          f"({res['warm_speedup_capture']:.1f}x)", flush=True)
    return res


def spread(values: list[float]) -> dict:
    """Median, min and max, rounded."""
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2),
            "n": len(values)}


def demo_pair(sizes: str, graph_config: str | None = None) -> dict:
    """One cold capture of the demo (an empty cache directory) and one warm (the directory the
    cold run filled), each a fresh process."""
    flags = {"graph_config": graph_config} if graph_config else {}
    with tempfile.TemporaryDirectory(prefix="ag-startup-demo-") as tmp:
        cache = os.path.join(tmp, "cache")
        return {start: run_child("demo", sizes, cache, False, **flags) for start in ("cold", "warm")}


# Where the demo's start-up lies in the startup part's JSON, and how that demo ran (a CLI flag)
DEMO_VARIANTS = (("demo", ""), ("demo_no_precompile", " with --no-precompile"))
NO_PRECOMPILE = '{"inductor": {"precompile": false}}'  # the demo's --graph-config for --no-precompile


def measure_demo(repeats: int = 1, sizes: tuple[int, ...] = DEMO_SIZES, graph_config: str | None = None) -> dict:
    """The demo's capture cold (empty cache directory) and warm (the directory the cold run
    filled), each in a fresh process, ``repeats`` times: per size and in total;
    ``graph_config``: the demo's ``--graph-config`` (``NO_PRECOMPILE``: its ``--no-precompile``)."""
    runs = [demo_pair(",".join(map(str, sizes)), graph_config=graph_config) for _ in range(repeats)]
    return summarise_demo(runs, sizes)


def summarise_demo(runs: list[dict], sizes: tuple[int, ...]) -> dict:
    """Medians (and ranges) of ``demo_pair`` results: capture seconds, CPU seconds, per size."""
    s, repeats = ",".join(map(str, sizes)), len(runs)
    res = {"sizes": list(sizes), "repeats": repeats, "goals": DEMO_GOALS,
           "compiles": {start: sorted({r[start]["compiles"] for r in runs}) for start in ("cold", "warm")}}
    for start in ("cold", "warm"):
        res[f"{start}_capture_s"] = spread([r[start]["capture_s"] for r in runs])
        res[f"{start}_capture_cpu_s"] = spread([r[start]["capture_cpu_s"] for r in runs])
        res[f"{start}_per_size_s"] = {str(n): spread([r[start]["per_size"][str(n)]["seconds"] for r in runs])
                                      for n in sizes}
    print(f"  start-up demo {s}: capture cold {res['cold_capture_s']['median']:.1f} s "
          f"(goal {DEMO_GOALS['cold_capture_s']:.0f}), warm {res['warm_capture_s']['median']:.1f} s "
          f"(goal {DEMO_GOALS['warm_capture_s']:.0f})", flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", action="store_true")
    p.add_argument("--model", default="small", help="a suite model (benchmarks.models), or 'demo'")
    p.add_argument("--sizes", default=None, help="default: 1,2,4,8,16,32,64; with --demo the demo's 1,2,4,8")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--save-artifacts", default=None)
    p.add_argument("--load-artifacts", default=None)
    p.add_argument("--aot", action="store_true", help="GraphConfig.inductor.aot")
    p.add_argument("--graph-config", default=None, help="with --model demo: the demo's --graph-config (JSON)")
    p.add_argument("--demo", action="store_true", help="the demo's capture cold and warm (measure_demo)")
    p.add_argument("--repeats", type=int, default=1, help="with --demo: cold and warm pairs")
    p.add_argument("--json", default=None, help="also write the result to this file")
    p.add_argument("--no-precompile", action="store_true", help="with --demo: the demo with --no-precompile")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
    elif args.demo:
        sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else DEMO_SIZES
        res = measure_demo(args.repeats, sizes, NO_PRECOMPILE if args.no_precompile else None)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
        print(json.dumps(res, indent=2))
    else:
        sizes = tuple(int(s) for s in (args.sizes or "1,2,4,8,16,32,64").split(","))
        print(json.dumps(measure(args.model, sizes, args.quick), indent=2))


if __name__ == "__main__":
    main()
