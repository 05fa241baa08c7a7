"""The benchmark suite: ``python -m benchmarks [--quick] [--parts ...]``.

Measures decode steps (graph vs eager vs transformers) on the built-in small model and on a
DeepSeek-V2-Lite-shaped slice, the copy-bandwidth roofline, decode attention alone, start-up
(cold vs persistent compile cache) and memory; writes ``benchmarks/results/suite[_quick].json``,
PNG plots when matplotlib is installed, and ``benchmarks/results/PERFORMANCE.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from benchmarks import (attention, compute, decode_step, huge_pages, levers, memory, moe_forms, overhead, report,  # noqa: E402
                        roofline, startup, targets)
from benchmarks.common import conditions, set_malloc_keeps_freed_memory, write_json  # noqa: E402
from benchmarks.models import build, cases  # noqa: E402

PARTS = ("bandwidth", "decode_small", "overhead", "decode_v2", "compute", "moe_forms", "levers", "huge_pages",
         "attention", "startup", "memory")
NOTES = [
    "One torch thread (`--threads 1`): the 2 cores are shared with other jobs; with 2 threads every OpenMP "
    "region waits for a descheduled thread (a V2-Lite batch-1 graph step measured 0.40-0.54 s at 2 threads vs "
    "0.10 s at 1 thread, side by side in one session, kernels of a few microseconds taking 20 ms). On a quieter "
    "day (2026-11-30; `OMP_NUM_THREADS=1` or `2 python -m benchmarks.decode_step --model v2_lite_slice --sizes "
    "1,8,32 --rounds 5`, one run each) 2 threads ran: graph (eager) ms at batch 1, 23.4 (40.0) against 29.9 (68.2) "
    "at 1 thread, graph/eager 1.71 against 2.29; at batch 32, 84.9 (110.6) against 143.8 (193.0), 1.30 against "
    "1.34; decode attention alone (batch 32, context 2048) 14.3 against 19.3 ms, with copy bandwidth 25.5 against "
    "19.6 GB/s, 0.22 against 0.21 of it. A second thread speeds eager up more than the graph and lifts no missed "
    "target.",
    "glibc malloc keeps freed memory (mmap threshold 1 GiB, no trimming; `benchmarks/common.py`), for graph, "
    "eager and transformers alike: large temporaries are otherwise mapped fresh and page-faulted on every step. "
    "The attention table shows the compiled step under glibc's default as well.",
    "Eager is measured at its best: its MoE sorts rows by expert and reads each chosen expert once, with the "
    "same expert kernel as the compiled step (`expert_rows_mm`, `ascend_graph/kernels/ops.py`; "
    "`torch._grouped_mm` where it cannot run), no weight copies; before, it gathered T*K weight matrices "
    "(see `moe_forms`). Its MLA attention multiplies the gathered cache rows in float32 where aten has no native "
    "bfloat16 matmul (no AVX-512: a Zen 3), rounding each product once to bfloat16 as aten's own does: aten's "
    "bfloat16 product of the probabilities by the latent rows ran there at about 1 GFLOP/s "
    "(`ascend_graph/attention/mla.py`, `product_rows`; from 2026-12-01, eager V2-Lite steps 7 ms faster at batch 1).",
    "transformers: `DeepseekV2ForCausalLM` of the same configuration (random weights, sdpa attention, "
    "DynamicCache, logits of the last token only), same batch and context, cache cropped back after each step.",
    "Roofline bytes: every weight used once (routed experts: the distinct experts the batch chose), the batch's "
    "embedding rows, each row's latent + rope cache; copy bandwidth is timed in the same rounds as the steps.",
]
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def plan(quick: bool) -> dict:
    """Sizes and repetitions of every part."""
    if quick:
        return {"small_sizes": (1, 8, 32), "v2_sizes": (1,), "hf_sizes": (1, 8), "small_rounds": (7, 3),
                "v2_rounds": (3, 1), "attention_reps": 3, "attention_batch_1_context": 4096, "startup_sizes": (1,), "memory_model": "small",
                "memory_sizes": (1, 8), "moe_tokens": (1, 32), "levers": ("default", levers.NO_PASS),
                "lever_batches": (1,), "v2_frozen_sizes": (), "small_aot_sizes": ()}
    return {"small_sizes": (1, 2, 4, 8, 16, 32, 64), "v2_sizes": (1, 8, 32, 64), "hf_sizes": (1, 8, 32),
            "small_rounds": (15, 5), "v2_rounds": (7, 1), "attention_reps": 7, "attention_batch_1_context": 16384,
            "startup_sizes": (1, 2, 4, 8, 16, 32, 64), "memory_model": "v2_lite_slice", "memory_sizes": (1, 8),
            "moe_tokens": (1, 8, 16, 32), "levers": None, "lever_batches": (1, 8),
            "v2_frozen_sizes": (8, 32), "small_aot_sizes": (1, 8, 32, 64)}


def decode(case_name: str, sizes, hf_sizes, rounds: tuple[int, int], quick: bool, frozen_sizes=(),
           aot_sizes=()) -> dict:
    """Graph vs eager vs transformers for one model case; ``frozen_sizes`` also get a graph
    compiled with Inductor's freezing (``inductor_freezing_min_batch``), and ``aot_sizes`` one
    from AOTInductor packages (``aot_inductor``), each its own runner over the same weights,
    timed in the same rounds."""
    from benchmarks.transformers_decode import HFDecoder

    case = cases(quick)[case_name]
    model = build(case)
    hf = HFDecoder(case.config, case.dtype, case.context)
    extra = {"transformers": lambda n: hf.step_fn(n) if n in hf_sizes else None}
    frozen = None
    if frozen_sizes:
        frozen = decode_step.RunnerVariant(model, case, tuple(frozen_sizes),
                                           inductor_freezing_min_batch=min(frozen_sizes))
        extra["graph_frozen"] = lambda n: frozen.step_fn(n) if n in frozen_sizes else None
    packages = tempfile.TemporaryDirectory(prefix="ag-decode-aoti-") if aot_sizes else None
    if packages is not None:
        aot = decode_step.RunnerVariant(model, case, tuple(aot_sizes), aot_inductor=True,
                                        compile_cache_dir=packages.name)
        extra["graph_aot"] = lambda n: aot.step_fn(n) if n in aot_sizes else None
    probe = read = None
    if case_name != "small":  # copy bandwidth timed in the same rounds as the steps it bounds
        probe = roofline.CopyProbe()
        extra["copy"] = lambda n: probe
        read = roofline.ReadProbe()  # and one core's read ceiling, which bounds the batch-1 step
        extra["read"] = lambda n: read if n == 1 else None
    res = decode_step.measure(case, sizes, rounds[0], rounds[1], model=model, extra=extra, roofline=probe is not None,
                              matmul_floor=probe is not None)
    if frozen is not None:
        res["frozen"] = {"inductor_freezing_min_batch": min(frozen_sizes),
                         "capture": frozen.runner.stats.to_dict()["capture"]}
    if packages is not None:
        packages.cleanup()
    for row in res["rows"]:
        if probe is not None:
            row["copy_bytes_per_s"] = probe.bytes / row.pop("copy_s")
        if "read_s" in row:
            row["read_bytes_per_s"], row["read_how"] = read.bytes / row.pop("read_s"), read.how
    return res


def run_part(part: str, p: dict, quick: bool, out: dict) -> None:
    if part == "bandwidth":
        out["copy_bandwidth"] = roofline.copy_bandwidth()
        out["read_bandwidth"] = roofline.read_vs_copy(rounds=5 if quick else 9)
        print(f"  copy bandwidth {out['copy_bandwidth']['bytes_per_s'] / 1e9:.2f} GB/s (read + written)", flush=True)
    elif part == "decode_small":
        out["decode_small"] = decode("small", p["small_sizes"], p["hf_sizes"], p["small_rounds"], quick,
                                     aot_sizes=p["small_aot_sizes"])
    elif part == "decode_v2":
        out["decode_v2"] = decode("v2_lite_slice", p["v2_sizes"], p["hf_sizes"], p["v2_rounds"], quick,
                                  frozen_sizes=p["v2_frozen_sizes"])
    elif part == "overhead":
        out["overhead"] = overhead.measure()
    elif part == "compute":
        out["compute"] = compute.measure(batches=p["v2_sizes"], context=cases(quick)["v2_lite_slice"].context,
                                         rounds=3 if quick else 7)
    elif part == "moe_forms":
        out["moe_forms"] = moe_forms.measure(tokens=p["moe_tokens"], rounds=3 if quick else 5)
    elif part == "levers":
        out["levers"] = levers.measure(batches=p["lever_batches"], rounds=3 if quick else 5, quick=quick,
                                       names=p["levers"])
    elif part == "huge_pages":
        out["huge_pages"] = huge_pages.measure(rounds=3 if quick else 7, quick=quick)
    elif part == "attention":
        out["attention"] = attention.measure(reps=p["attention_reps"], malloc_keeps_freed=out["malloc_keeps_freed_memory"])
        out["attention"]["batch_1"] = attention.batch_one(context=p["attention_batch_1_context"],
                                                          reps=p["attention_reps"])
        out["attention"]["gqa"] = attention.gqa_decode(reps=p["attention_reps"])
    elif part == "startup":
        out["startup"] = startup.measure("small", p["startup_sizes"], quick, portable=not quick, aot=not quick)
    elif part == "memory":
        out["memory"] = memory.measure(p["memory_model"], p["memory_sizes"], 3, quick, frozen=not quick, aot=not quick)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (a few minutes)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--json", default=None, help="default: benchmarks/results/suite[_quick].json")
    ap.add_argument("--merge", action="store_true", help="keep parts of an existing JSON not run now")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared machine every OpenMP region of a 2-thread run "
                         "waits for a descheduled thread; measured 0.10 s vs 0.40-0.54 s per V2-Lite step)")
    ap.add_argument("--default-malloc", action="store_true",
                    help="leave glibc's malloc as it is (default: keep freed memory, see common.py)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the start-up and memory child processes
    keep = not args.default_malloc and set_malloc_keeps_freed_memory(True)
    path = args.json or os.path.join(RESULTS, "suite_quick.json" if args.quick else "suite.json")
    out = {}
    if args.merge and os.path.exists(path):
        with open(path) as f:
            out = json.load(f)
    out.update({"conditions": {**conditions(), "quick": args.quick}, "malloc_keeps_freed_memory": keep,
                "command": "python -m benchmarks" + (" --quick" if args.quick else ""), "notes": NOTES})
    p, started = plan(args.quick), time.strftime("%Y-%m-%d %H:%M:%S")
    for part in args.parts:
        start = time.perf_counter()
        print(f"[{part}]", flush=True)
        run_part(part, p, args.quick, out)
        out.setdefault("part_seconds", {})[part] = round(time.perf_counter() - start, 1)
        out.setdefault("part_run", {})[part] = started
        out["targets"] = targets.targets(out)
        write_json(path, out)
    report.write_outputs(out, path, RESULTS)
    return out


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
