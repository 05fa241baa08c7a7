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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


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
    """Build the model, capture every size; report the phases' seconds."""
    t0 = time.perf_counter()
    import torch

    cpp = count_cpp_compiles()

    from ascend_graph.compile.inductor import cache_dir_for_compile
    from ascend_graph.config import GraphConfig, InductorOptions
    from benchmarks.models import build, cases, make_runner

    t_import = time.perf_counter()
    case = cases(args.quick)[args.model]
    model = build(case)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    t_build = time.perf_counter()
    if args.load_artifacts:
        with open(args.load_artifacts, "rb") as f, cache_dir_for_compile(args.cache_dir):
            torch.compiler.load_cache_artifacts(f.read())
    t_load = time.perf_counter()
    config = GraphConfig(enabled=True, backend="inductor", capture_sizes=sizes, max_batch_size=max(sizes),
                         compile_cache_dir=args.cache_dir, inductor=InductorOptions(aot=args.aot))
    runner = make_runner(model, config, sizes, case.context)
    runner.capture(show_progress=False)
    t_capture = time.perf_counter()
    out = {"import_s": t_import - t0, "build_s": t_build - t_import, "load_artifacts_s": t_load - t_build,
           "capture_s": t_capture - t_load, "total_s": t_capture - t0, "compiles": runner.stats.compiles,
           "cpp_compiler_runs": cpp["runs"], "cpp_compiler_s": cpp["seconds"],
           "packages_loaded": runner.stats.packages_loaded}
    if args.save_artifacts:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            with open(args.save_artifacts, "wb") as f:
                f.write(saved[0])
            out["artifact_bytes"] = len(saved[0])
    return out


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", action="store_true")
    p.add_argument("--model", default="small")
    p.add_argument("--sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--save-artifacts", default=None)
    p.add_argument("--load-artifacts", default=None)
    p.add_argument("--aot", action="store_true", help="GraphConfig.inductor.aot")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
    else:
        print(json.dumps(measure(args.model, tuple(int(s) for s in args.sizes.split(",")), args.quick), indent=2))


if __name__ == "__main__":
    main()
