"""One vLLM run for tests/test_vllm_plugin.py, in the vLLM venv's python (no pytest there).

``python vllm_worker.py SPEC.json OUT.json``: builds ``vllm.LLM`` on ``spec["model"]`` with
``spec["llm"]`` as keyword arguments (``additional_config`` included), generates greedily for
``spec["prompts"]`` (token ids, ``ignore_eos``), and writes to OUT.json the new tokens, the
resolved model class, ``ascend_graph.vllm.runner_stats(llm)`` where graph mode is on, and the
error's type and message where ``LLM(...)`` or a step raised. Standard library, vLLM and
ascend_graph only.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def run(spec: dict) -> dict:
    import vllm

    out: dict = {"tokens": None, "model_class": None, "stats": None, "error": None}
    start = time.perf_counter()
    try:
        llm = vllm.LLM(model=spec["model"], **spec["llm"])
        out["init_s"] = time.perf_counter() - start
        out["model_class"] = llm.apply_model(lambda model: type(model).__name__)[0]
        params = vllm.SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                                     detokenize=False)
        for _ in range(spec.get("repeats", 1)):
            outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
            out["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
        if out["model_class"].startswith("AscendGraph"):
            from ascend_graph.vllm import runner_stats

            out["stats"] = runner_stats(llm)
    except Exception as e:  # the test reads the error; the traceback goes to stderr
        traceback.print_exc()
        out["error"] = {"type": type(e).__name__, "message": str(e)}
    out["seconds"] = time.perf_counter() - start
    return out


if __name__ == "__main__":  # vLLM may spawn processes: the work must not run on import
    with open(sys.argv[1], encoding="utf-8") as f:
        result = run(json.load(f))
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown
