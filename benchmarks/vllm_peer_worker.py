"""The stock vLLM side of ``benchmarks.vllm_peer``: a script the vLLM venv's python runs.

``python vllm_peer_worker.py SPEC.json`` builds one ``vllm.LLM`` on the spec's checkpoint and
dtype with vLLM's defaults (the compiled path; CPU MLA), says it is ready, then serves requests
until its stdin closes: each stdin line ``{"batch": b, "new_tokens": n}`` generates greedily
(``ignore_eos``) for the spec's first ``b`` prompts and answers with the seconds
``LLM.generate`` took and the new tokens of each prompt; ``{"stats": true}`` answers with the
graph runner's counters. A spec's ``additional_config`` goes to ``vllm.LLM``: with our graph
mode's flag in it, the parent has put a checkout and its plugin's entry point on
``PYTHONPATH`` (``vllm_plugin_env``). Answers are stdout lines that start with ``REPLY``
(anything else on stdout is a log line). Standard library and vLLM only: the counters are
read through the worker method the plugin adds, by name.
"""

from __future__ import annotations

import json
import os
import sys
import time

REPLY = "@@vllm_peer "  # marks this worker's answers among other lines on stdout


def reply(message: dict) -> None:
    """One answer line to the parent."""
    sys.stdout.write(REPLY + json.dumps(message) + "\n")
    sys.stdout.flush()


def build(spec: dict):
    """The ``vllm.LLM`` of ``spec``, and what the parent records about it."""
    import torch
    import transformers
    import vllm

    torch.set_num_threads(spec["threads"])  # before vLLM's CPU worker disables set_num_threads
    start = time.perf_counter()
    llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                   block_size=16, max_num_seqs=max(spec["batches"]), skip_tokenizer_init=True, seed=0,
                   kv_cache_memory_bytes=spec["kv_cache_memory_bytes"],
                   **({"additional_config": spec["additional_config"]} if "additional_config" in spec else {}))
    about = {"init_s": time.perf_counter() - start, "torch_threads": torch.get_num_threads(),
             "versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                          "transformers": transformers.__version__}}
    return llm, about


def serve(spec: dict) -> None:
    """Build the LLM, then answer generation requests from stdin until it closes."""
    import vllm

    llm, about = build(spec)
    reply({"ready": True, **about})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("stats"):
            (stats,) = llm.collective_rpc("ascend_graph_runner_stats")  # the plugin's worker method
            reply({"stats": stats})
            continue
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"][:request["batch"]]]
        params = vllm.SamplingParams(temperature=0.0, max_tokens=request["new_tokens"], ignore_eos=True,
                                     detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        reply({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outputs]})


if __name__ == "__main__":  # vLLM may spawn processes: the work must not run on import
    with open(sys.argv[1], encoding="utf-8") as f:
        serve(json.load(f))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown; every answer is sent
