"""vLLM with our graph mode, started cold and warm on one compile cache, with and without
precompiled steps (``inductor.precompile``): what a restarted server pays before its first token.

``python -m benchmarks.vllm_startup --vllm-python VENV/bin/python [--model tiny|v2lite]
[--dtype float32] [--batches 1,8,32] [--repeats 1] [--json PATH]`` writes one of
``benchmarks.vllm_peer``'s checkpoints, then per repeat and per setting (precompile on, its
default, and off) starts vLLM+graph twice in fresh worker processes on one new compile cache
directory (``additional_config={"ascend_graph": {"compile_cache_dir": ...}}``): cold, then warm.
Each start records ``LLM(...)``'s seconds, the first ``generate`` for the largest batch (two
tokens: its decode step captures the graphs), and the runner's counters (capture seconds,
compiles, steps loaded). The vLLM venv is ``benchmarks.vllm_peer``'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import conditions, write_json  # noqa: E402
from benchmarks.vllm_peer import MODELS, prompts, write_checkpoint  # noqa: E402
from benchmarks.vllm_peer_sides import WorkerSide, check_vllm_python, graph_config  # noqa: E402
from benchmarks.vllm_plugin_env import ROOT  # noqa: E402

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vllm_startup.json")
SETTINGS = {"precompile": True, "no_precompile": False}


def start(python: str, spec: dict, workdir: str, name: str) -> dict:
    """One vLLM+graph start: ``LLM(...)`` seconds, the first generate's seconds, the counters."""
    side = WorkerSide(python, spec, workdir, name=name, root=ROOT)
    try:
        about = side.ready()
        first_s, _ = side(max(spec["batches"]), 2)  # a prefill, then a decode step: capture
    finally:
        side.close()
    stats = side.about["runner_stats"]
    return {"init_s": round(about["init_s"], 2), "first_generate_s": round(first_s, 2),
            "capture_s": stats["capture_seconds"], "compiles": stats["compiles"],
            "loaded": stats["packages_loaded"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--model", default="tiny", choices=MODELS)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", default=DEFAULT_JSON)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    out = {"benchmark": "vllm_startup", "conditions": conditions(), "vllm": check_vllm_python(args.vllm_python),
           "command": "python -m benchmarks.vllm_startup " + " ".join(argv if argv is not None else sys.argv[1:]),
           "settings": {k: v for k, v in vars(args).items() if k not in ("json", "vllm_python")}, "runs": []}
    with tempfile.TemporaryDirectory(prefix="ag-vllm-startup-") as work:
        model = os.path.join(work, args.model)
        config = write_checkpoint(args.model, model)
        for r in range(args.repeats):
            run = {}
            for name, precompile in SETTINGS.items():
                additional = graph_config(batches)
                additional["ascend_graph"].update(compile_cache_dir=os.path.join(work, f"cache_{name}_{r}"),
                                                  inductor={"precompile": precompile})
                spec = {"model": model, "dtype": args.dtype, "batches": batches, "max_model_len": 256,
                        "kv_cache_memory_bytes": 128 << 20, "threads": args.threads,
                        "prompts": prompts(max(batches), config.vocab_size), "additional_config": additional}
                run[name] = {s: start(args.vllm_python, spec, work, f"{name}_{s}") for s in ("cold", "warm")}
                print(name, run[name], flush=True)
            out["runs"].append(run)
    out["medians"] = {name: {s: {k: statistics.median(run[name][s][k] for run in out["runs"])
                                 for k in ("init_s", "first_generate_s", "capture_s")}
                             for s in ("cold", "warm")} for name in SETTINGS}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
