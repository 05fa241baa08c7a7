"""One vLLM run for tests/test_vllm_plugin.py, in the vLLM venv's python (no pytest there).

``python vllm_worker.py SPEC.json OUT.json``: builds ``vllm.LLM`` on ``spec["model"]`` with
``spec["llm"]`` as keyword arguments (``additional_config`` included), generates greedily for
``spec["prompts"]`` (token ids, ``ignore_eos``), and writes to OUT.json the new tokens, the
model class vLLM resolves (``hf_config.architectures``), ``ascend_graph.vllm.runner_stats(llm)``
where graph mode is on, and the error's type and message where ``LLM(...)`` or a step raised.
With ``spec["runs"]`` (a list of such specs) it runs each in turn and writes ``{"runs": [...]}``.
With ``spec["graph_ops"]`` it records each worker's parameter shapes (``shares``) and, per call
of a captured graph, the collectives it ran (``graph_ops``; at tensor_parallel_size > 1 vLLM
ships these probes only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``); with ``spec["per_worker"]``
also ``runner_stats(llm, per_worker=True)`` at start and end.
With ``spec["attempts"]`` (a list of keyword dicts, ``model`` among them or not) it only
constructs an ``LLM`` from each
and writes each one's error (``None`` where it was built). With ``spec["timing"]``
(``new_tokens``, ``rounds``) it also times decode steps (``ms_per_step``, one per round); with
``spec["count_backend_calls"]``, ``backend_calls`` counts the ``ascend_graph`` backend's compiles, and
``fused_moe_calls`` the calls of vLLM's ``cpu_fused_moe`` through ``vllm._custom_ops`` (where graph
mode's MoE runs vLLM's kernel, ``ascend_graph.vllm.moe``).
In graph mode ``stats_at_start`` is ``runner_stats`` right after ``LLM(...)``, before any request.
With ``spec["contract"]`` (graph mode, in-process engine) it first drives the model through
vLLM's own runner (``contract_probe``: a dummy run, a profile run, a forward without our layers'
metadata), then records every forward's and ``compute_logits``' output shape during the
generations (``shapes``); with ``spec["prompt_logprobs"]`` a last request asks for prompt
logprobs (``prompt_logprobs_error``). With ``spec["record_drafts"]`` (speculative decoding, in-process
engine) ``drafts`` holds each request's drafts, step by step, from vLLM's own drafter, and
``drafter_inputs`` what the drafter was given at each step (the target's token ids, positions and
hidden states, as lists).
Standard library, vLLM and ascend_graph only.
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
    backend_calls = fused_moe_calls = None
    if spec.get("count_backend_calls"):
        import ascend_graph.compile
        from vllm import _custom_ops

        backend_calls = count_calls(ascend_graph.compile, "ascend_graph_backend")
        fused_moe_calls = count_calls(_custom_ops, "cpu_fused_moe")
    start, llm = time.perf_counter(), None
    try:
        llm = vllm.LLM(model=spec["model"], **spec["llm"])
        out["init_s"] = time.perf_counter() - start
        out["model_class"] = llm.llm_engine.vllm_config.model_config.hf_config.architectures[0]
        graph = out["model_class"].startswith("AscendGraph")
        if graph:
            from ascend_graph.vllm import runner_stats

            out["stats_at_start"] = runner_stats(llm)
            if spec.get("per_worker"):
                out["worker_stats_at_start"] = runner_stats(llm, per_worker=True)
        if spec.get("graph_ops"):
            out["shares"] = llm.collective_rpc(profile_graphs)
        if spec.get("contract"):
            (out["contract"],) = llm.collective_rpc(contract_probe)
        if spec.get("record_drafts"):
            llm.collective_rpc(record_drafts)
        params = vllm.SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                                     detokenize=False)
        for _ in range(spec.get("repeats", 1)):
            outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
            out["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
        if spec.get("contract"):
            (out["shapes"],) = llm.collective_rpc(  # a copy: later calls append to the recorded lists
                lambda worker: json.loads(json.dumps(worker.model_runner.get_model().recorded_shapes)))
        if spec.get("record_drafts"):
            ((out["drafts"], out["drafter_inputs"]),) = llm.collective_rpc(
                lambda worker: (worker.model_runner.drafts_by_request, worker.model_runner.drafter_inputs))
        if "timing" in spec:
            out["ms_per_step"] = decode_ms(llm, vllm, spec)
        if graph:
            out["stats"] = runner_stats(llm)
            if spec.get("per_worker"):
                out["worker_stats"] = runner_stats(llm, per_worker=True)
        if spec.get("graph_ops"):
            out["graph_ops"] = llm.collective_rpc(lambda worker: worker.get_model().graph_ops)
        if spec.get("prompt_logprobs"):
            out["prompt_logprobs_error"] = prompt_logprobs_error(llm, vllm, spec)
    except Exception as e:  # the test reads the error; the traceback goes to stderr
        out["error"] = error_of(e)
    finally:
        if llm is not None:  # a multi-process engine's core and workers exit with it
            llm.llm_engine.engine_core.shutdown()
    out["seconds"] = time.perf_counter() - start
    if backend_calls is not None:
        out["backend_calls"], out["fused_moe_calls"] = len(backend_calls), len(fused_moe_calls)
    out["plugin_loaded"] = "ascend_graph.vllm.plugin" in sys.modules  # vLLM ran our entry point
    return out


def contract_probe(worker) -> dict:
    """In the worker: vLLM's own dummy run and profile run, and a forward under a context without
    our layers, each one's outcome; then record the model's output shapes (``recorded_shapes``)."""
    import torch
    from vllm.forward_context import set_forward_context

    runner, out = worker.model_runner, {}
    model = runner.get_model()
    before = model.runner_stats()
    hidden, _ = runner._dummy_run(3)  # what DP's execute_dummy_batch and the warm-ups run
    out["dummy_run"] = {"shape": list(hidden.shape), "rows": sorted(set(hidden[:, 0].tolist())),
                        "stats_unchanged": model.runner_stats() == before}
    out["profile_run_error"] = outcome(runner.profile_run)
    with set_forward_context({}, worker.vllm_config):
        out["no_metadata_error"] = outcome(lambda: model(input_ids=torch.tensor([1, 2]),
                                                         positions=torch.tensor([0, 1])))
    out["stats_unchanged"] = model.runner_stats() == before
    model.recorded_shapes = {"forward": [], "compute_logits": []}
    for name in ("forward", "compute_logits"):
        record(model, name)
    return out


def profile_graphs(worker) -> dict:
    """In the worker: from now on record, per call of a captured graph, the collectives it ran
    (``graph_ops``, torch profiler events); return the worker's parameter shapes (its share)."""
    import torch

    model = worker.get_model()
    model.graph_ops = []
    graphs = model.runner._graphs

    def profiled(graph):
        def call(*args):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                result = graph(*args)
            model.graph_ops.append([e.name for e in prof.events()
                                    if e.name.startswith(("c10d::", "_c10d_functional::", "_C::", "vllm::"))])
            return result
        return call

    for size in list(graphs):
        graphs[size] = profiled(graphs[size])
    return {name: list(t.shape) for name, t in model.model.state_dict().items()}


def record(model, name: str) -> None:
    """Record the output shape of each call of ``model.<name>``."""
    inner = getattr(model, name)

    def recorded(*args, **kwargs):
        result = inner(*args, **kwargs)
        model.recorded_shapes[name].append(list(result.shape))
        return result

    setattr(model, name, recorded)


def outcome(fn) -> dict | None:
    """``fn()``'s error (type and message), ``None`` where it returned."""
    try:
        fn()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return None


def prompt_logprobs_error(llm, vllm, spec: dict) -> dict | None:
    """Ask for prompt logprobs (logits at every prompt token); the error, if any."""
    params = vllm.SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    return outcome(lambda: llm.generate([{"prompt_token_ids": spec["prompts"][0]}], params, use_tqdm=False))


def count_calls(module, attr: str) -> list:
    """Record each call of ``module.attr`` made through the module attribute: the ``ascend_graph``
    torch.compile backend (looked up by its entry point at compile time), vLLM's
    ``_custom_ops.cpu_fused_moe`` (looked up by ``ascend_graph.vllm.moe`` at each call)."""
    calls, inner = [], getattr(module, attr)

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    setattr(module, attr, counted)
    return calls


def decode_ms(llm, vllm, spec: dict) -> list[float]:
    """Per round, ms per decode step: ``(t(n new tokens) - t(1 new token)) / (n - 1)``."""
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    n, rounds = spec["timing"]["new_tokens"], spec["timing"]["rounds"]
    out = []
    for _ in range(rounds):
        seconds = []
        for tokens in (1, n):
            params = vllm.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
        out.append((seconds[1] - seconds[0]) / (n - 1) * 1e3)
    return out


def error_of(e: Exception) -> dict:
    traceback.print_exception(e)
    return {"type": type(e).__name__, "message": str(e)}


def record_drafts(worker) -> None:
    """Keep each step's speculative drafts on the worker's model runner: ``drafts_by_request``,
    by the request's index (the id before vLLM's suffix), one list of draft tokens per step; and
    ``drafter_inputs``, per step the target's token ids, positions and hidden states it drafted from."""
    runner = worker.model_runner
    propose, runner.drafts_by_request, runner.drafter_inputs = runner.drafter.propose, {}, []

    def recording(*args, **kwargs):
        runner.drafter_inputs.append({key: kwargs[f"target_{key}"].tolist()
                                      for key in ("token_ids", "positions", "hidden_states")})
        drafts = propose(*args, **kwargs)  # [requests, k], the input batch's order
        for request, row in zip(list(runner.input_batch.req_ids), drafts.tolist()):
            runner.drafts_by_request.setdefault(request.split("-")[0], []).append(row)
        return drafts

    runner.drafter.propose = recording


def attempt(spec: dict) -> dict:
    """Construct an ``LLM`` from each of ``spec["attempts"]``; their errors, in order."""
    import vllm

    errors = []
    for kwargs in spec["attempts"]:
        try:
            vllm.LLM(**{"model": spec["model"], **kwargs})
            errors.append(None)
        except Exception as e:
            errors.append(error_of(e))
    return {"errors": errors}


if __name__ == "__main__":  # vLLM may spawn processes: the work must not run on import
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    if "runs" in spec:  # several LLMs one after another in this process (vLLM imported once)
        result = {"runs": [run(one) for one in spec["runs"]]}
    else:
        result = attempt(spec) if "attempts" in spec else run(spec)
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown
