"""Where a decode step's time goes inside vLLM: stock vLLM against vLLM with our graph mode.

``python -m benchmarks.vllm_step_profile --vllm-python VENV/bin/python [--model tiny|v2lite]
[--dtypes float32,bfloat16] [--batch 1] [--json PATH]`` writes one of ``benchmarks.vllm_peer``'s
checkpoints (default tiny), then for each dtype
and side runs one vLLM in a subprocess of the vLLM venv's python (this file as a script, graph
mode's side with this checkout's plugin on ``PYTHONPATH``; with ``--graph-before ROOT`` also one
with ROOT's). There every call of the functions in
``PROBES`` is timed with ``time.perf_counter`` around it (wrapped class attributes) over several
greedy generations of ``--new-tokens`` tokens after warm-up ones; the JSON keeps each probe's
call count and median milliseconds. vLLM's own per-step work (``engine_core.step`` minus
``model forward``: scheduling, input preparation, sampling, output handling) is the same code on
both sides; ``model forward`` is vLLM's compiled model on one, ``AscendGraphDeepseekV2ForCausalLM
.forward`` (decode-only steps ``GraphRunner.execute_decode``; others ``sequence_steps``,
``GraphRunner.execute``; ``select_logits`` in ``compute_logits``) on the other.
Wrapping adds a few microseconds per probe.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

# (module, class or None, attribute, probe name); the graph side's names apply to its side only
PROBES = [("vllm.v1.engine.core", "EngineCore", "step", "engine_core.step"),
          ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "runner.execute_model"),
          ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward", "model forward"),
          ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens", "runner.sample_tokens")]
GRAPH_PROBES = [("ascend_graph.vllm.model", None, "sequence_steps", "sequence_steps"),
                ("ascend_graph.vllm.model", None, "select_logits", "select_logits"),
                ("ascend_graph.runner", "GraphRunner", "execute", "GraphRunner.execute"),
                ("ascend_graph.runner", "GraphRunner", "execute_decode", "GraphRunner.execute_decode"),
                ("ascend_graph.runner", "GraphRunner", "prepare", "GraphRunner.prepare"),
                ("ascend_graph.runner", "GraphRunner", "_run_graph", "GraphRunner._run_graph")]
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vllm_step_profile.json")


def wrap(times: dict, module: str, owner: str | None, attr: str, name: str) -> None:
    """Time every call of ``module.owner.attr`` (or ``module.attr``) into ``times[name]``; nothing
    where it does not exist (a probe the ``--graph-before`` checkout lacks)."""
    import importlib

    target = importlib.import_module(module)
    target = getattr(target, owner) if owner else target
    inner = getattr(target, attr, None)
    if inner is None:
        return

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times.setdefault(name, []).append(time.perf_counter() - start)

    setattr(target, attr, timed)


def worker(spec: dict) -> dict:
    """In the vLLM venv: build the LLM, warm up, time the probes over ``spec["generations"]``."""
    import torch
    import vllm

    torch.set_num_threads(spec["threads"])
    times: dict = {}
    for probe in PROBES + (GRAPH_PROBES if spec["graph"] else []):
        wrap(times, *probe)
    extra = {"additional_config": {"torchair_graph_config": {"enabled": True, "graph_batch_sizes": [spec["batch"]]},
                                   "ascend_graph": {"fallback_on_compile_error": False}}} if spec["graph"] else {}
    llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=256, block_size=16,
                   max_num_seqs=spec["batch"], skip_tokenizer_init=True, seed=0, kv_cache_memory_bytes=128 << 20,
                   **extra)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True, detokenize=False)
    for _ in range(2):
        llm.generate(prompts, params, use_tqdm=False)
    times.clear()
    for _ in range(spec["generations"]):
        llm.generate(prompts, params, use_tqdm=False)
    return {name: {"calls": len(v), "median_ms": statistics.median(v) * 1e3,
                   "p25_ms": (statistics.quantiles(v, n=4)[0] if len(v) > 1 else v[0]) * 1e3}
            for name, v in times.items()}


def main(argv: list[str] | None = None) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.common import conditions, write_json
    from benchmarks.vllm_peer import MODELS, prompts, write_checkpoint
    from benchmarks.vllm_peer_sides import run_worker_script, vllm_env
    from benchmarks.vllm_plugin_env import ROOT, pythonpath

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--model", default="tiny", choices=MODELS)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--generations", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--graph-before", default=None, metavar="ROOT", help="also graph mode of the checkout at ROOT")
    p.add_argument("--json", default=DEFAULT_JSON)
    args = p.parse_args(argv)
    sides = {"vllm": None, "vllm_graph": ROOT, **({"vllm_graph_before": args.graph_before} if args.graph_before else {})}
    out = {"benchmark": "vllm_step_profile", "conditions": conditions(),
           "command": "python -m benchmarks.vllm_step_profile " + " ".join(sys.argv[1:]),
           "settings": {k: v for k, v in vars(args).items() if k not in ("json", "vllm_python")}, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="ag-vllm-profile-") as work:
        model = os.path.join(work, args.model)
        config = write_checkpoint(args.model, model)
        for dtype in args.dtypes.split(","):
            for side, root in sides.items():
                graph = root is not None
                spec = {"model": model, "dtype": dtype, "graph": graph, "batch": args.batch,
                        "prompts": prompts(args.batch, config.vocab_size), "new_tokens": args.new_tokens,
                        "generations": args.generations, "threads": args.threads}
                env = vllm_env(os.path.join(work, "cache"), args.threads,
                               pythonpath(os.path.join(work, "plugin"), root) if graph else None)
                key = f"{dtype}/{side}"
                out["runs"][key] = run_worker_script(args.vllm_python, __file__, spec, work, env)
                print(key, {k: round(v["median_ms"], 3) for k, v in out["runs"][key].items()}, flush=True)
    write_json(args.json, out)
    return out


if __name__ == "__main__":  # vLLM may spawn processes: the work must not run on import
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":  # in the vLLM venv, this file's directory on the path
        from vllm_peer_worker import answer_in_file
        answer_in_file(worker, *sys.argv[2:])
    main()
