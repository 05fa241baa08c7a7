"""The benchmark suite: every comparison timed side by side in one process, written as JSON.

Parts (``--parts``), in the order they run:
    bandwidth     one core's copy and read-only bandwidth (``roofline``)
    decode_small  the small model's decode step: graph vs eager vs transformers (``decode_step``)
    overhead      where the small model's graph step spends its time (``decode_step``)
    decode_v2     the V2-Lite slice's step, with the bytes it must read (``decode_step``)
    compute       bf16 matmul rates, step FLOPs, the core's peak (``roofline``)
    moe           one MoE layer, graph vs eager (``moe``)
    attention     decode attention alone: MLA at two cache capacities, the op alone, GQA (``attention``)
    live_context  the decode step against max_model_len and against live context (``attention``)
    startup       cold vs warm compile cache, fresh processes; the demo's capture (``startup``)
    memory        peak RSS graph vs eager, per-step allocations (``memory``)
    pd            prefill/decode in two processes: KV transfer vs a local copy, TTFT and decode
                  step vs one process (``pd``; Mooncake where it imports, gloo)
    multi_device  TP=2 (two processes, gloo) vs TP=1 on the same cores, graph mode; the step's
                  all_reduces and gloo's cost per call (``multi_device``)
    speculative   MTP drafting (num_speculative_tokens=1 and 3) vs none, its own and forced-right
                  drafts (``speculative``)

    python -m benchmarks                          # all parts -> benchmarks/results/<machine>.json
    python -m benchmarks --quick --parts moe      # fewer sizes and repetitions, one part
    python -m benchmarks --parts attention memory # some parts, kept beside the others in the file

``<machine>`` is ``common.machine_key`` of this machine; a ``--quick`` run writes
``<machine>-quick.json`` under the system's temporary directory unless ``--json`` says where.
Then ``python -m benchmarks.report`` regenerates docs/performance.md from the results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from benchmarks import (attention, decode_step, memory, moe, multi_device, pd, report, roofline,  # noqa: E402
                        speculative, startup)
from benchmarks.common import conditions, machine_key, results_path, set_malloc_keeps_freed_memory, write_json  # noqa: E402
from benchmarks.models import cases  # noqa: E402

PARTS = ("bandwidth", "decode_small", "overhead", "decode_v2", "compute", "moe", "attention", "live_context",
         "startup", "memory", "pd", "multi_device", "speculative")


def plan(quick: bool) -> dict:
    """Sizes and repetitions of every part."""
    if quick:
        return {"small_sizes": (1, 8, 32), "v2_sizes": (1,), "hf_sizes": (1, 8), "small_rounds": (7, 3),
                "v2_rounds": (3, 1), "attention_reps": 3, "startup_sizes": (1,), "startup_demo_repeats": 1,
                "memory_model": "small", "memory_sizes": (1, 8), "moe_tokens": (1, 32), "v2_frozen_sizes": (),
                "small_aot_sizes": (), "live": {"names": ("small_float32",), "contexts": (64, 256, 1024), "rounds": 5}}
    return {"small_sizes": (1, 2, 4, 8, 16, 32, 64), "v2_sizes": (1, 8, 32, 64), "hf_sizes": (1, 8, 32),
            "small_rounds": (15, 5), "v2_rounds": (7, 1), "attention_reps": 7, "startup_sizes": (1, 2, 4, 8, 16, 32, 64),
            "startup_demo_repeats": 3, "memory_model": "v2_lite_slice", "memory_sizes": (1, 8),
            "moe_tokens": (1, 8, 16, 32), "v2_frozen_sizes": (8, 32), "small_aot_sizes": (1, 8, 32, 64),
            "live": {"rounds": 9}}


def run_part(part: str, p: dict, quick: bool, out: dict) -> None:
    if part == "bandwidth":
        out["copy_bandwidth"] = roofline.copy_bandwidth()
        out["read_bandwidth"] = roofline.read_vs_copy(rounds=5 if quick else 9)
        print(f"  copy bandwidth {out['copy_bandwidth']['bytes_per_s'] / 1e9:.2f} GB/s (read + written)", flush=True)
    elif part == "decode_small":
        out["decode_small"] = decode_step.compare("small", p["small_sizes"], p["hf_sizes"], p["small_rounds"], quick,
                                                 aot_sizes=p["small_aot_sizes"])
    elif part == "decode_v2":
        out["decode_v2"] = decode_step.compare("v2_lite_slice", p["v2_sizes"], p["hf_sizes"], p["v2_rounds"], quick,
                                              frozen_sizes=p["v2_frozen_sizes"])
    elif part == "overhead":
        out["overhead"] = decode_step.overhead()
    elif part == "compute":
        out["compute"] = roofline.compute(batches=p["v2_sizes"], context=cases(quick)["v2_lite_slice"].context,
                                         rounds=3 if quick else 7)
    elif part == "moe":
        out["moe"] = moe.measure(tokens=p["moe_tokens"], rounds=3 if quick else 5)
    elif part == "attention":
        out["attention"] = attention.mla(reps=p["attention_reps"])
        out["attention"]["gqa"] = attention.gqa(reps=p["attention_reps"])
    elif part == "live_context":
        out["live_context"] = attention.live_context(quick=quick, **p["live"])
    elif part == "startup":
        out["startup"] = startup.measure("small", p["startup_sizes"], quick, portable=not quick, aot=not quick)
        out["startup"]["demo"] = startup.measure_demo(repeats=p["startup_demo_repeats"])
        out["startup"]["demo_no_precompile"] = startup.measure_demo(repeats=p["startup_demo_repeats"],
                                                                    graph_config=startup.NO_PRECOMPILE)
    elif part == "pd":
        from ascend_graph.pd.select import mooncake_available
        transports = ["mooncake", "gloo"] if mooncake_available() else ["gloo"]
        out["pd"] = pd.run(transports, quick)
    elif part == "multi_device":
        out["multi_device"] = multi_device.measure("small" if quick else "v2_lite_slice", (1, 8), 3 if quick else 7, 3,
                                                   quick, gloo_rounds=3 if quick else 5, gloo_calls=5 if quick else 20)
    elif part == "speculative":
        out["speculative"] = speculative.measure((1, 8) if quick else (1, 8, 32), (1, 3), 16, 12 if quick else 32,
                                                 2 if quick else 5)
    elif part == "memory":
        out["memory"] = memory.measure(p["memory_model"], p["memory_sizes"], 3, quick, frozen=not quick, aot=not quick)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (a few minutes)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--json", default=None, help="default: benchmarks/results/<machine>.json")
    ap.add_argument("--fresh", action="store_true", help="drop the parts of an existing JSON not run now")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared machine every OpenMP region of a 2-thread run "
                         "waits for a descheduled thread)")
    ap.add_argument("--default-malloc", action="store_true",
                    help="leave glibc's malloc as it is (default: keep freed memory, see common.py)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the start-up and memory child processes
    keep = not args.default_malloc and set_malloc_keeps_freed_memory(True)
    found = conditions()
    path = args.json or results_path(found, args.quick)
    out = {}
    if not args.fresh and os.path.exists(path):
        with open(path) as f:
            out = json.load(f)
    out.update({"conditions": {**found, "quick": args.quick}, "machine": machine_key(found),
                "malloc_keeps_freed_memory": keep,
                "command": " ".join(["python -m benchmarks", *(argv if argv is not None else sys.argv[1:])])})
    p, started = plan(args.quick), time.strftime("%Y-%m-%d %H:%M:%S")
    for part in args.parts:
        start = time.perf_counter()
        print(f"[{part}]", flush=True)
        run_part(part, p, args.quick, out)
        out.setdefault("part_seconds", {})[part] = round(time.perf_counter() - start, 1)
        out.setdefault("part_run", {})[part] = started
        write_json(path, out)
    if not args.quick and not args.json:
        report.write_all()
    return out


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
