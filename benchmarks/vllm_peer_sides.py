"""The two sides ``benchmarks.vllm_peer`` times, and how: decode ms per step, rounds interleaved.

A side is a callable ``(batch, new_tokens) -> (seconds, tokens)``: one greedy generation of
``new_tokens`` new tokens for the first ``batch`` prompts, the seconds its generate call took
and the new tokens of each prompt. ``WorkerSide`` asks a worker subprocess
(``vllm_peer_worker.py``): vLLM under the vLLM venv's python, or the project's Engine under this
python (``engine_side``). Every side runs in a process of its own, so that each can be started
again (a process keeps one draw of a shared host's speed for its life) and none spins threads in
the process that times the others.

How a decode step is timed (``interleaved_decode``): after one warm-up generation per side, each
round times, per side, a generation of 1 new token (prefill only) and then one of ``new_tokens``
new tokens on the same prompts; ``(t_new - t_one) / (new_tokens - 1)`` is that round's time per
decode step (host scheduling, sampling and output handling included; prefill excluded). The
sides take turns within every round, in alternating order, so that the load of a shared machine
falls on both alike; each turn starts with a 1-token generation that pays the switch from the
other process, then times another; the faster of the two is the round's 1-token time (a host
stall in one, which would make the round's step time short or negative, is not counted). Each
side's figure is its median over the rounds.
A side that also tells how much of its last generation was the model's forward (a
``forward_seconds`` attribute, not ``None``: the vLLM sides) gets the same difference of those
(``forward_round_ms``): the rest of its step is vLLM's own work.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

from benchmarks.vllm_peer_worker import REPLY
from benchmarks.vllm_plugin_env import pythonpath

Side = Callable[[int, int], tuple[float, list[list[int]]]]  # (batch, new tokens) -> (seconds, tokens)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer_worker.py")


def decode_ms_per_step(t_new: float, t_one: float, new_tokens: int) -> float:
    """Milliseconds per decode step from the seconds of a ``new_tokens`` generation and a 1-token one."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 to time a decode step, got {new_tokens}")
    return (t_new - t_one) / (new_tokens - 1) * 1e3


def interleaved_decode(sides: dict[str, Side], batch: int, new_tokens: int, rounds: int,
                       probe: Callable[[], None] | None = None, probe_s: list | None = None,
                       probe_pause_s: float = 0.5) -> dict[str, dict]:
    """Per side: the median decode ms per step at ``batch`` (``ms_per_step``), each round's
    (``round_ms``) and its two timed generations' seconds (``round_s``: 1 token, ``new_tokens``),
    the warm-up's tokens and whether every round made the same (``tokens_stable``); for a side
    with ``forward_seconds``, each round's forward ms per step (``forward_round_ms``). With
    ``probe``, each round also appends to ``probe_s`` the fastest of 3 calls of it, made after the
    sides and a pause of ``probe_pause_s`` (a side's OpenMP threads spin on for a while after it)."""
    out = {}
    for name, side in sides.items():  # warm-up: compiles, allocates, fills caches
        out[name] = {"round_ms": [], "round_s": [], "tokens": side(batch, new_tokens)[1], "tokens_stable": True}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t_switch, _ = sides[name](batch, 1)  # the switch from the other process is paid here
            f_switch = getattr(sides[name], "forward_seconds", None)
            t_one, _ = sides[name](batch, 1)
            f_one = getattr(sides[name], "forward_seconds", None)
            t_new, tokens = sides[name](batch, new_tokens)
            f_new = getattr(sides[name], "forward_seconds", None)
            if t_switch < t_one:  # the same work: a stall of the host in one of them is not the prefill's
                t_one, f_one = t_switch, f_switch
            out[name]["round_s"].append([t_one, t_new])
            out[name]["round_ms"].append(decode_ms_per_step(t_new, t_one, new_tokens))
            if f_one is not None and f_new is not None:
                out[name].setdefault("forward_round_ms", []).append(decode_ms_per_step(f_new, f_one, new_tokens))
            out[name]["tokens_stable"] &= tokens == out[name]["tokens"]
        if probe is not None:
            time.sleep(probe_pause_s)
            probe_s.append(min(_seconds(probe) for _ in range(3)))
    for row in out.values():
        row["ms_per_step"] = statistics.median(row["round_ms"])
    return out


def _seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def vllm_env(cache_root: str, threads: int, path: str | None = None) -> dict:
    """The environment of the vLLM subprocess: in-process engine core, no thread binding, logs
    on stderr, and on the path only ``path`` (``vllm_plugin_env.pythonpath``: a checkout and its
    plugin's entry point), by default nothing of this project."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_CACHE_ROOT=cache_root, OMP_NUM_THREADS=str(threads), VLLM_LOGGING_STREAM="ext://sys.stderr")
    if path is not None:
        env["PYTHONPATH"] = path
    return env


def run_worker_script(python: str, script: str, spec: dict, work: str, env: dict) -> dict:
    """``python script --worker SPEC OUT`` in ``env`` (the script ends in
    ``vllm_peer_worker.answer_in_file``): ``spec`` in, the worker's answer back."""
    spec_path, out_path = os.path.join(work, "spec.json"), os.path.join(work, "out.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    subprocess.run([python, os.path.abspath(script), "--worker", spec_path, out_path], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    with open(out_path, encoding="utf-8") as f:
        return json.load(f)


def graph_config(batches: list[int]) -> dict:
    """vLLM's ``additional_config`` for our graph mode: every measured batch captured, a failed
    compile raising (never timed as eager)."""
    return {"torchair_graph_config": {"enabled": True, "graph_batch_sizes": sorted(batches)},
            "ascend_graph": {"fallback_on_compile_error": False}}


def check_graph_steps(stats: dict) -> None:
    """``RuntimeError`` where a runner ran anything but prefills eagerly (a decode step out of graph)."""
    eager = {k: v for k, v in stats["eager_steps"].items() if k != "prefill"}
    if eager or not stats["graph_steps"]:
        raise RuntimeError(f"a graph-mode side ran decode steps eagerly: {stats}")


def check_vllm_python(python: str) -> str:
    """vLLM's version under ``python``; ``SystemExit`` saying why where it cannot run vLLM."""
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise SystemExit(f"--vllm-python {python!r}: no such executable (make the venv as "
                         "benchmarks/vllm_peer.py's docstring says)")
    done = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                          env=vllm_env(tempfile.gettempdir(), 1))
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"--vllm-python {python!r} cannot import vllm: {tail}")
    return done.stdout.strip().splitlines()[-1]


class WorkerSide:
    """A worker subprocess of ``python`` on ``spec``: vLLM (with its ``additional_config``, if
    any; the plugin of the checkout at ``root`` visible where given), or the Engine of the checkout
    at ``root`` where ``spec["engine"]``; its log goes to ``log_path`` (``tag`` tells a restarted
    side's log from the first one's)."""

    def __init__(self, python: str, spec: dict, workdir: str, name: str = "vllm", root: str | None = None,
                 tag: str = "") -> None:
        spec_path = os.path.join(workdir, f"spec_{name}.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        self.log_path = os.path.join(workdir, f"{name}_{spec['dtype']}{tag}.log")
        self.log = open(self.log_path, "w", encoding="utf-8")
        path = root if root is None or spec.get("engine") else pythonpath(os.path.join(workdir, "plugin"), root)
        self.proc = subprocess.Popen([python, WORKER, spec_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True,
                                     env=vllm_env(os.path.join(workdir, f"{name}_cache"), spec["threads"], path))
        self.graph = "additional_config" in spec or bool(spec.get("engine"))
        self.about: dict | None = None
        self.forward_seconds: float | None = None  # of the last generation (vLLM sides)

    def ready(self) -> dict:
        """Wait for the worker's LLM; what it reported (start-up seconds, threads, versions)."""
        if self.about is None:
            self.about = self._answer()
        return self.about

    def __call__(self, batch: int, new_tokens: int) -> tuple[float, list[list[int]]]:
        self.ready()
        self.proc.stdin.write(json.dumps({"batch": batch, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        self.forward_seconds = answer.get("forward_seconds")
        return answer["seconds"], answer["tokens"]

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
        """With graph mode: read the runner's counters into ``about`` and check every decode step
        ran as a graph. End the worker (its stdin closes) and wait for it."""
        stats = None
        try:
            if self.graph and self.about is not None and self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"stats": True}) + "\n")
                self.proc.stdin.flush()
                stats = self.about["runner_stats"] = self._answer()["stats"]
        finally:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
            self.log.close()
        if stats is not None:
            check_graph_steps(stats)


def engine_side(spec: dict, workdir: str, root: str, tag: str = "") -> WorkerSide:
    """The project's Engine of the checkout at ``root`` on ``spec`` in a worker subprocess of this python."""
    return WorkerSide(sys.executable, {**spec, "engine": True}, workdir, name="engine", root=root, tag=tag)
