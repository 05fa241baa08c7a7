"""Graph mode's decode steps inside vLLM: vLLM's step tensors as they are, against SequenceSteps.

``python -m benchmarks.vllm_decode_inputs --vllm-python VENV/bin/python [--models tiny,v2lite]
[--dtypes float32,bfloat16] [--batches 1,8] [--rounds 8] [--json PATH]`` writes
``benchmarks.vllm_peer``'s checkpoints, then per model, dtype and batch starts one vLLM with our
graph mode (a subprocess of the vLLM venv's python, this checkout's plugin on ``PYTHONPATH``,
in-process engine core) and times two forms of the plugin's decode step in it, interleaved
(``vllm_peer_sides.interleaved_decode``: per round a 1-token and a ``--new-tokens`` generation,
decode ms per step from their difference): ``tensors`` (``GraphRunner.execute_decode`` over
vLLM's input ids, sequence lengths, block table and slots; the default) and ``sequence_steps``
(the form before: one ``SequenceStep`` per request, ``GraphRunner.execute``), switched by the
model class's ``decode_as_tensors``. One process, so both forms draw the same memory regime and
the same compiled graphs; their tokens must be equal. The JSON keeps every round's times.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

FORMS = {"tensors": True, "sequence_steps": False}  # form -> decode_as_tensors
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vllm_decode_inputs.json")


def worker(spec: dict) -> dict:
    """In the vLLM venv: one LLM, the two forms interleaved; their rows and tokens."""
    import vllm

    from ascend_graph.vllm.model import AscendGraphForCausalLM
    from benchmarks.vllm_peer_sides import graph_config, interleaved_decode

    batch = spec["batch"]
    llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=256, block_size=16, max_num_seqs=batch,
                   skip_tokenizer_init=True, seed=0, kv_cache_memory_bytes=128 << 20,
                   additional_config=graph_config([batch]))
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]

    def side(as_tensors: bool):
        def run(b: int, new_tokens: int):
            AscendGraphForCausalLM.decode_as_tensors = as_tensors
            params = vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
            start = time.perf_counter()
            out = llm.generate(prompts[:b], params, use_tqdm=False)
            return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in out]
        return run

    return interleaved_decode({form: side(flag) for form, flag in FORMS.items()}, batch, spec["new_tokens"],
                              spec["rounds"])


def main(argv: list[str] | None = None) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.common import conditions, write_json
    from benchmarks.vllm_peer import MODELS, prompts, write_checkpoint
    from benchmarks.vllm_peer_sides import check_vllm_python, run_worker_script, vllm_env
    from benchmarks.vllm_plugin_env import pythonpath

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--models", default="tiny,v2lite")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=DEFAULT_JSON)
    args = p.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    version = check_vllm_python(args.vllm_python)
    out = {"benchmark": "vllm_decode_inputs", "conditions": {**conditions(), "vllm": version},
           "command": "python -m benchmarks.vllm_decode_inputs " + " ".join(sys.argv[1:] if argv is None else argv),
           "settings": {k: v for k, v in vars(args).items() if k not in ("json", "vllm_python")}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="ag-vllm-decode-inputs-") as work:
        for model in models:
            path = os.path.join(work, model)
            config = write_checkpoint(model, path)
            for dtype in args.dtypes.split(","):
                for batch in (int(b) for b in args.batches.split(",")):
                    spec = {"model": path, "dtype": dtype, "batch": batch, "new_tokens": args.new_tokens,
                            "rounds": args.rounds, "prompts": prompts(batch, config.vocab_size)}
                    env = vllm_env(os.path.join(work, "cache"), args.threads, pythonpath(os.path.join(work, "plugin")))
                    sides = run_worker_script(args.vllm_python, __file__, spec, work, env)
                    new, old = sides["tensors"], sides["sequence_steps"]
                    row = {"model": model, "dtype": dtype, "batch": batch, "tensors_ms": new["ms_per_step"],
                           "sequence_steps_ms": old["ms_per_step"],
                           "tensors_over_sequence_steps": new["ms_per_step"] / old["ms_per_step"],
                           "round_ratios": [a / b for a, b in zip(new["round_ms"], old["round_ms"])],
                           "tokens_equal": new["tokens"] == old["tokens"] and new["tokens_stable"] and old["tokens_stable"],
                           "sides": {form: {k: v for k, v in side.items() if k != "tokens"}
                                     for form, side in sides.items()}}
                    out["rows"].append(row)
                    print(f"{model} {dtype} batch {batch}: tensors {row['tensors_ms']:.3f} ms, sequence steps "
                          f"{row['sequence_steps_ms']:.3f} ms, tensors / sequence steps "
                          f"{row['tensors_over_sequence_steps']:.3f} (rounds {min(row['round_ratios']):.3f}-"
                          f"{max(row['round_ratios']):.3f}), tokens equal: {row['tokens_equal']}", flush=True)
    write_json(args.json, out)
    return out


if __name__ == "__main__":  # vLLM may spawn processes: the work must not run on import
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":  # in the vLLM venv, this file's directory on the path
        from vllm_peer_worker import answer_in_file
        answer_in_file(worker, *sys.argv[2:])
    main()
