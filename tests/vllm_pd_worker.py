"""One side of a prefill/decode pair for tests/test_vllm_pd.py, in the vLLM venv's python.

``python vllm_pd_worker.py SPEC.json OUT.json``; ``spec["role"]`` is

- ``"producer"``: ``LLM(model, **spec["llm"])``; prefills ``spec["prompts"]`` with
  ``max_tokens=1`` and ``kv_transfer_params {"do_remote_decode": True}``, writes each output's
  token and ``kv_transfer_params``, and its pid, to ``spec["handoff"]`` (atomically); then, as the
  single-instance oracle, generates the same prompts with ``spec["max_tokens"]`` and no transfer; waits for
  ``spec["release"]`` (the consumer has finished) and runs one more request, so that the steps
  after the consumer's ``done`` free the held blocks;
- ``"consumer"``: ``LLM(...)``; waits for the handoff, then generates each prompt with its
  ``kv_transfer_params`` (the blocks are pulled, the prompt not recomputed); with
  ``spec["dead_port"]``, then the first prompt once more with its producer's address changed to
  that port (the pull fails: ``after_failure``); writes ``release``; with ``spec["producer_gone"]``,
  waits for the producer process to end, then generates the second prompt with its (now dead)
  producer's parameters: the pull fails with reads in flight (``after_producer_died``).

OUT.json: tokens, ``num_cached_tokens`` per request, the runner's counters, the connector's
counters (``transfer_stats``), seconds, and the error (type, message) where one was raised.
Every wait is bounded by ``spec["timeout_s"]``. Standard library, vLLM and ascend_graph only.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
import traceback


def wait_for(path: pathlib.Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


def wait_gone(pid: int, timeout_s: float) -> None:
    """Until process ``pid`` has exited (gone, or a zombie its parent has yet to reap)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return
        except FileNotFoundError:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} still runs after {timeout_s} s")
        time.sleep(0.05)


def run(spec: dict) -> dict:
    import vllm

    from ascend_graph.vllm import runner_stats
    from ascend_graph.vllm.kv_connector import transfer_stats

    out: dict = {"error": None}
    start, llm = time.perf_counter(), None
    handoff, release = pathlib.Path(spec["handoff"]), pathlib.Path(spec["release"])
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]

    def params(max_tokens: int, kv: dict | None = None):
        return vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                   extra_args={"kv_transfer_params": kv} if kv is not None else None)

    try:
        llm = vllm.LLM(model=spec["model"], **spec["llm"])
        out["init_s"] = time.perf_counter() - start
        if spec["role"] == "producer":
            t = time.perf_counter()
            first = llm.generate(prompts, params(1, {"do_remote_decode": True}), use_tqdm=False)
            out["prefill_s"] = time.perf_counter() - t
            out["first_tokens"] = [list(o.outputs[0].token_ids) for o in first]
            tmp = handoff.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "params": [o.kv_transfer_params for o in first]}))
            tmp.rename(handoff)
            single = llm.generate(prompts, params(spec["max_tokens"]), use_tqdm=False)
            out["tokens"] = [list(o.outputs[0].token_ids) for o in single]
            wait_for(release, spec["timeout_s"])
            llm.generate(prompts[:1], params(1), use_tqdm=False)  # steps after the consumer's "done"
        else:
            wait_for(handoff, spec["timeout_s"])
            handed = json.loads(handoff.read_text())
            kv = handed["params"]
            t = time.perf_counter()
            outputs = llm.generate(prompts, [params(spec["max_tokens"], p) for p in kv], use_tqdm=False)
            out["decode_s"] = time.perf_counter() - t
            out["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
            out["num_cached_tokens"] = [o.num_cached_tokens for o in outputs]
        out["stats"] = runner_stats(llm)
        out["transfer"] = transfer_stats(llm)
        if spec["role"] == "consumer" and spec.get("dead_port"):  # a pull that fails: nobody listens there
            dead = {**kv[0], "remote_request_id": "gone", "remote_port": spec["dead_port"]}
            failed = llm.generate(prompts[:1], params(spec["max_tokens"], dead), use_tqdm=False)
            out["after_failure"] = {"tokens": list(failed[0].outputs[0].token_ids), "stats": runner_stats(llm),
                                    "transfer": transfer_stats(llm)}
        if spec["role"] == "consumer" and spec.get("producer_gone"):  # the producer's engine gone mid-session
            release.write_text("done")
            wait_gone(handed["pid"], spec["timeout_s"])
            orphan = llm.generate(prompts[1:2], params(spec["max_tokens"], kv[1]), use_tqdm=False)
            out["after_producer_died"] = {"tokens": list(orphan[0].outputs[0].token_ids),
                                          "stats": runner_stats(llm), "transfer": transfer_stats(llm)}
    except Exception as e:  # the test reads the error; the traceback goes to stderr
        traceback.print_exception(e)
        out["error"] = {"type": type(e).__name__, "message": str(e)}
    finally:
        if spec["role"] == "consumer":
            release.write_text("done")  # even after an error: the producer must not wait it out
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
    out["seconds"] = time.perf_counter() - start
    return out


if __name__ == "__main__":  # vLLM may spawn processes: the work must not run on import
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    result = run(spec)
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown (and the transfer engine's)
