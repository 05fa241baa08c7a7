"""A side of ``benchmarks.vllm_peer`` in a process of its own: ``python vllm_worker.py SPEC.json``.

It builds one ``vllm.LLM`` on the spec's checkpoint and dtype with vLLM's defaults (with the
spec's ``additional_config``, if any: our graph mode's flag), or, where the spec says ``"engine":
true``, the project's Engine (graph mode on, every batch of the spec captured, a failed compile
raising). It says it is ready, then serves stdin lines until stdin closes: ``{"batch": b,
"new_tokens": n}`` generates greedily (``ignore_eos``) for the spec's first ``b`` prompts and
answers with the seconds of the generate call and the new tokens (a vLLM side also with
``forward_seconds``, the part spent in vLLM's calls of the model's forward); ``{"stats": true}``
answers with the graph runner's counters. Answers are stdout lines starting with ``REPLY``
(anything else is a log line). Standard library and vLLM only (the Engine: torch and the checkout).

The parent's end (``WorkerSide``) starts such a process with the environment vLLM needs, asks it,
reads its answers among its log lines, and on closing checks that a graph side ran every decode
step as a graph; a worker that dies is an error carrying its log, never a figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

REPLY = "@@vllm_peer "  # marks this worker's answers among other lines on stdout
WORKER = os.path.abspath(__file__)


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
    tp = spec.get("tensor_parallel_size", 1)
    extra = {"additional_config": spec["additional_config"]} if "additional_config" in spec else {}
    if tp > 1:  # the workers are processes of their own: they time themselves (TimedWorker)
        extra.update(tensor_parallel_size=tp, worker_extension_cls="benchmarks.vllm_worker.TimedWorker")
    start = time.perf_counter()
    llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                   block_size=16, max_num_seqs=max(spec["batches"]), skip_tokenizer_init=True, seed=0,
                   kv_cache_memory_bytes=spec["kv_cache_memory_bytes"], **extra)
    about = {"init_s": time.perf_counter() - start, "torch_threads": torch.get_num_threads(),
             "versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                          "transformers": transformers.__version__}}
    return llm, about


def time_model_forward(counter) -> None:
    """Add the seconds of every ``GPUModelRunner._model_forward`` call to ``counter.forward_seconds``
    (the engine core runs in this process): the model's share of a step, stock vLLM's or ours."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    inner = GPUModelRunner._model_forward

    def timed(runner, *args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(runner, *args, **kwargs)
        finally:
            counter.forward_seconds += time.perf_counter() - start

    GPUModelRunner._model_forward = timed


class TimedWorker:
    """Mixed into each vLLM worker at tensor_parallel_size > 1 (vLLM's ``worker_extension_cls``),
    called by name through ``collective_rpc``: the seconds of this worker's model forwards, and
    vLLM's own TP all-reduce timed alone (every worker calls it at once)."""

    def bench_forward_seconds(self) -> float:
        """Seconds in this worker's ``_model_forward`` since the first call (which starts the timer)."""
        if not hasattr(self, "_bench_forward_s"):
            self._bench_forward_s, inner = 0.0, self.model_runner._model_forward

            def timed(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    self._bench_forward_s += time.perf_counter() - start

            self.model_runner._model_forward = timed
        return self._bench_forward_s

    def bench_all_reduce_ms(self, rows: int, hidden: int, dtype: str, calls: int) -> float:
        """Median ms of ``get_tp_group().all_reduce`` of a ``[rows, hidden]`` tensor (what a
        layer's all-reduce sends), over ``calls`` calls after one warm-up."""
        import statistics

        import torch
        from vllm.distributed.parallel_state import get_tp_group

        group, x = get_tp_group(), torch.ones(rows, hidden, dtype=getattr(torch, dtype))
        group.all_reduce(x.clone())
        times = []
        for _ in range(calls):
            y = x.clone()
            start = time.perf_counter()
            group.all_reduce(y)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3


class VllmServed:
    """``build``'s LLM: greedy generations, the time of their model forwards, the plugin's counters."""

    def __init__(self, spec: dict) -> None:
        self.forward_seconds = 0.0
        self.tp = spec.get("tensor_parallel_size", 1)
        time_model_forward(self)
        self.llm, self.about = build(spec)
        if self.tp > 1:
            self.llm.collective_rpc("bench_forward_seconds")  # starts each worker's timer

    def _forward_seconds(self) -> float:
        """The model's forward seconds so far: this process's (TP=1), else the first worker's."""
        return self.llm.collective_rpc("bench_forward_seconds")[0] if self.tp > 1 else self.forward_seconds

    def all_reduce_ms(self, rows: int, hidden: int, dtype: str, calls: int) -> float:
        """vLLM's TP all-reduce of ``[rows, hidden]`` alone: the slowest worker's median ms per call."""
        return max(self.llm.collective_rpc("bench_all_reduce_ms", args=(rows, hidden, dtype, calls)))

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], float]:
        """The seconds ``LLM.generate`` took (the request built beforehand), the new tokens, and the
        seconds of it spent in the model's forward."""
        import vllm

        params = vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        requests = [{"prompt_token_ids": p} for p in prompts]
        forward_before = self._forward_seconds()
        start = time.perf_counter()
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, [list(o.outputs[0].token_ids) for o in outputs], self._forward_seconds() - forward_before

    def stats(self) -> dict:
        stats = self.llm.collective_rpc("ascend_graph_runner_stats")  # the plugin's worker method
        return stats[0]  # the TP workers run the same steps


class EngineServed:
    """The project's Engine on the spec's checkpoint: graph mode on, every batch of the spec
    captured (a failed compile raising: never timed as eager), the same block size, length and
    KV cache bytes as the vLLM sides."""

    def __init__(self, spec: dict) -> None:
        import torch

        from ascend_graph.config import GraphConfig
        from ascend_graph.engine import Engine

        torch.set_num_threads(spec["threads"])
        batches = spec["batches"]
        config = GraphConfig(enabled=True, capture_sizes=tuple(batches), max_batch_size=max(batches),
                             fallback_on_compile_error=False)
        start = time.perf_counter()
        self.engine = Engine.from_pretrained(spec["model"], graph_config=config, dtype=getattr(torch, spec["dtype"]),
                                             block_size=16, max_model_len=spec["max_model_len"],
                                             cache_memory_bytes=spec["kv_cache_memory_bytes"])
        self.engine.capture(show_progress=False)
        self.about = {"init_s": time.perf_counter() - start, "torch_threads": torch.get_num_threads(),
                      "versions": {"torch": torch.__version__}}

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], None]:
        """The seconds ``Engine.generate`` took and the new tokens (no forward split: the Engine's
        whole step is ours)."""
        start = time.perf_counter()
        tokens = self.engine.generate(prompts, new_tokens, ignore_eos=True)
        return time.perf_counter() - start, tokens, None

    def stats(self) -> dict:
        return self.engine.stats


def serve(spec: dict) -> None:
    """Build the side, then answer generation requests from stdin until it closes."""
    served = EngineServed(spec) if spec.get("engine") else VllmServed(spec)
    reply({"ready": True, **served.about})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("stats"):
            reply({"stats": served.stats()})
            continue
        if "all_reduce" in request:
            reply({"ms": served.all_reduce_ms(*request["all_reduce"])})
            continue
        seconds, tokens, forward = served.generate(spec["prompts"][:request["batch"]], request["new_tokens"])
        reply({"seconds": seconds, "tokens": tokens, **({} if forward is None else {"forward_seconds": forward})})


# ---- the parent's end ------------------------------------------------------------------------

def plugin_path(directory: str) -> str:
    """A ``dist-info`` under ``directory`` declaring the plugin's entry point (as pyproject.toml
    does): with it and a checkout on ``PYTHONPATH``, any vLLM python runs that checkout's plugin."""
    dist = os.path.join(directory, "ascend_graph-0.1.0.dist-info")
    os.makedirs(dist, exist_ok=True)
    with open(os.path.join(dist, "METADATA"), "w", encoding="utf-8") as f:
        f.write("Metadata-Version: 2.1\nName: ascend-graph\nVersion: 0.1.0\n")
    with open(os.path.join(dist, "entry_points.txt"), "w", encoding="utf-8") as f:
        f.write("[vllm.general_plugins]\nascend_graph = ascend_graph.vllm:register\n")
    return directory


def vllm_env(cache_root: str, threads: int, path: str | None = None) -> dict:
    """A worker's environment: vLLM's engine core in process, no thread binding, logs on stderr
    (stdout carries the answers), and on ``PYTHONPATH`` only ``path``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_CACHE_ROOT=cache_root, OMP_NUM_THREADS=str(threads), VLLM_LOGGING_STREAM="ext://sys.stderr")
    if path is not None:
        env["PYTHONPATH"] = path
    return env


def check_vllm_python(python: str) -> str:
    """vLLM's version under ``python``; ``SystemExit`` saying why where it cannot run vLLM."""
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise SystemExit(f"--vllm-python {python!r}: no such executable")
    done = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                          env=vllm_env(tempfile.gettempdir(), 1))
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"--vllm-python {python!r} cannot import vllm: {tail}")
    return done.stdout.strip().splitlines()[-1]


def check_graph_steps(stats: dict) -> None:
    """``RuntimeError`` where a graph side ran anything but prefills eagerly: never timed as a graph."""
    eager = {k: v for k, v in stats["eager_steps"].items() if k != "prefill"}
    if eager or not stats["graph_steps"]:
        raise RuntimeError(f"a graph-mode side ran decode steps eagerly: {stats}")


class WorkerSide:
    """A ``vllm_worker.py`` subprocess of ``python`` on ``spec`` (a ``vllm_peer.Side``): vLLM, with our graph
    mode where ``spec`` has ``additional_config`` (the checkout at ``root`` and its plugin on the
    path), or the Engine of ``root`` where ``spec["engine"]``; its log in ``workdir``."""

    def __init__(self, python: str, spec: dict, workdir: str, name: str = "vllm", root: str | None = None,
                 tag: str = "") -> None:
        spec_path = os.path.join(workdir, f"spec_{name}.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        self.log_path = os.path.join(workdir, f"{name}_{spec['dtype']}{tag}.log")
        self.log = open(self.log_path, "w", encoding="utf-8")
        path = root if root is None or spec.get("engine") else os.pathsep.join(
            [root, plugin_path(os.path.join(workdir, "plugin"))])
        tp = spec.get("tensor_parallel_size", 1)
        if tp > 1 and path is None:  # the workers import TimedWorker from this checkout
            path = os.path.dirname(os.path.dirname(WORKER))
        threads = max(1, spec["threads"] // tp)  # per worker process: the side's threads shared out
        self.proc = subprocess.Popen([python, WORKER, spec_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True,
                                     env=vllm_env(os.path.join(workdir, f"{name}_cache"), threads, path))
        self.graph = "additional_config" in spec or bool(spec.get("engine"))
        self.about: dict | None = None
        self.forward_seconds: float | None = None  # of the last generation (vLLM sides)

    def ready(self) -> dict:
        """Wait for the worker's model; what it reported (start-up seconds, threads, versions)."""
        if self.about is None:
            self.about = self._answer()
        return self.about

    def __call__(self, batch: int, new_tokens: int) -> tuple[float, list[list[int]]]:
        answer = self._ask({"batch": batch, "new_tokens": new_tokens})
        self.forward_seconds = answer.get("forward_seconds")
        return answer["seconds"], answer["tokens"]

    def all_reduce_ms(self, rows: int, hidden: int, dtype: str, calls: int = 20) -> float:
        """vLLM's own TP all-reduce of ``[rows, hidden]`` alone, ms per call (a vLLM side at TP > 1)."""
        return self._ask({"all_reduce": [rows, hidden, dtype, calls]})["ms"]

    def _ask(self, request: dict) -> dict:
        self.ready()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
            self.log.write(line)
        self.log.flush()
        with open(self.log_path, encoding="utf-8") as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"the {os.path.basename(self.log_path)} worker stopped (exit {self.proc.wait()}); "
                           f"its log ends:\n{tail}")

    def close(self) -> None:
        """End the worker; a graph side's counters go into ``about`` and must show no eager decode step."""
        stats = None
        try:
            if self.graph and self.about is not None and self.proc.poll() is None:
                stats = self.about["runner_stats"] = self._ask({"stats": True})["stats"]
        finally:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
            self.log.close()
        if stats is not None:
            check_graph_steps(stats)


if __name__ == "__main__":  # vLLM may spawn processes: the work must not run on import
    with open(sys.argv[1], encoding="utf-8") as f:
        serve(json.load(f))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown; every answer is sent
