"""Where a capture's time goes: exclusive wall and CPU seconds of each compile phase, per capture size.

``Phases().install()`` wraps the functions that do each phase (torch 2.13's names; a renamed one
fails the install, never counts silently as another phase). A phase's
seconds are its own, without the phases it calls; CPU seconds count this process and the
child processes it waited for (the C++ compiler, the probes that load test builds). What a
size's capture spends outside every phase is ``other``: the warm-up runs and the runner's own
work. The compile stack's modules are imported by the first compile (``imports``), inside the
first size's capture, as in any process that captures.
"""

from __future__ import annotations

import functools
import resource
import time
from collections import defaultdict
from typing import Any, Callable, Optional

# phase -> what it is (the order of the report)
PHASES = {
    "dynamo": "dynamo's trace of the step: bytecode, fake tensors, the FX graph",
    "guards": "dynamo's guards",
    "imports": "the compile stack's modules (torch._inductor), imported by the first compile",
    "aot_autograd": "AOTAutograd: functionalisation, the joint graph, its cache lookup",
    "cache_key": "AOTAutograd's cache key (hashing the graph)",
    "joint_passes": "Inductor's joint-graph passes",
    "post_grad_passes": "Inductor's post-grad passes",
    "our_passes": "decode_matmul and inline_writes (ascend_graph/compile/passes)",
    "lowering": "Inductor's lowering of the graph",
    "codegen": "Inductor's scheduling and code generation (C++ kernels, the C++ wrapper)",
    "cxx": "the C++ compiler: the step's module, precompiled headers, ISA test builds",
    "isa_check": "Inductor's ISA check (the probe processes that load its test builds)",
    "load_module": "loading the compiled module",
    "other": "the rest of the size's capture: warm-up runs, the runner's own work",
}


def _clock() -> tuple[float, float]:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


class Phases:
    """Exclusive (wall, CPU) seconds per (capture size, phase), from wrapped functions."""

    def __init__(self) -> None:
        self._stack: list[list[float]] = []  # [wall0, cpu0, nested wall, nested cpu]
        self._seconds: dict[tuple[Optional[int], str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        self._size: Optional[int] = None
        self._lazy_done = False

    def install(self) -> None:
        """Wrap the runner's capture, dynamo and our Inductor backend now; the rest of the
        compile stack at the backend's first call, timing its import as ``imports``."""
        import torch._dynamo.convert_frame
        import torch._dynamo.guards

        from ascend_graph.compile import inductor
        from ascend_graph.runner import graph_runner

        self._wrap(torch._dynamo.convert_frame, "_compile", "dynamo")
        self._wrap(torch._dynamo.guards.CheckFunctionManager, "__init__", "guards")
        self._wrap(graph_runner.GraphRunner, "_capture_size", "other", size_arg=True)
        call = inductor.InductorBackend.__call__

        def first_call(backend, *args: Any, **kwargs: Any) -> Any:
            if not self._lazy_done:
                self._lazy_done = True
                self._timed("imports", self._install_compile_stack)
            return call(backend, *args, **kwargs)

        inductor.InductorBackend.__call__ = first_call

    def _install_compile_stack(self) -> None:
        import torch._dynamo.backends.common
        import torch._inductor.codecache
        import torch._inductor.compile_fx
        import torch._inductor.cpp_builder
        import torch._inductor.cpu_vec_isa
        import torch._inductor.graph
        from torch._functorch._aot_autograd import autograd_cache

        from ascend_graph.compile import inductor
        from ascend_graph.compile.passes import decode_matmul

        for owner, name, phase in (
                (torch._dynamo.backends.common, "aot_module_simplified", "aot_autograd"),
                (autograd_cache, "autograd_cache_key", "cache_key"),
                (torch._inductor.compile_fx, "_recursive_joint_graph_passes", "joint_passes"),
                (torch._inductor.compile_fx, "_recursive_post_grad_passes", "post_grad_passes"),
                (decode_matmul.DecodeMatmulPass, "__call__", "our_passes"),
                (inductor, "inline_cache_writes", "our_passes"),
                (torch._inductor.graph.GraphLowering, "run", "lowering"),
                (torch._inductor.graph.GraphLowering, "codegen", "codegen"),
                (torch._inductor.codecache.PyCodeCache, "load_by_key_path", "load_module"),
                (torch._inductor.cpp_builder.CppBuilder, "build", "cxx"),
                (torch._inductor.cpu_vec_isa.VecISA, "check_build", "isa_check")):
            self._wrap(owner, name, phase)

    def _wrap(self, owner: Any, name: str, phase: str, size_arg: bool = False) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if size_arg:
                self._size = args[1]
            try:
                return self._timed(phase, fn, *args, **kwargs)
            finally:
                if size_arg:
                    self._size = None
        setattr(owner, name, timed)

    def _timed(self, phase: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        self._stack.append([*_clock(), 0.0, 0.0])
        try:
            return fn(*args, **kwargs)
        finally:
            wall0, cpu0, nested_wall, nested_cpu = self._stack.pop()
            wall, cpu = _clock()
            mine = self._seconds[(self._size, phase)]
            mine[0] += wall - wall0 - nested_wall
            mine[1] += cpu - cpu0 - nested_cpu
            if self._stack:
                self._stack[-1][2] += wall - wall0
                self._stack[-1][3] += cpu - cpu0

    def by_size(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{size: {phase: {"wall_s", "cpu_s"}}}``, phases in ``PHASES`` order (``"none"``: work
        outside any capture size, e.g. a compile triggered outside ``capture()``)."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (size, phase), (wall, cpu) in sorted(self._seconds.items(), key=lambda kv: list(PHASES).index(kv[0][1])):
            out.setdefault("none" if size is None else str(size), {})[phase] = {"wall_s": round(wall, 3),
                                                                                "cpu_s": round(cpu, 3)}
        return out


def totals(by_size: dict) -> dict[str, dict[str, float]]:
    """The phases summed over the sizes."""
    out: dict[str, dict[str, float]] = {}
    for phases in by_size.values():
        for phase, v in phases.items():
            t = out.setdefault(phase, {"wall_s": 0.0, "cpu_s": 0.0})
            t["wall_s"] = round(t["wall_s"] + v["wall_s"], 3)
            t["cpu_s"] = round(t["cpu_s"] + v["cpu_s"], 3)
    return {p: out[p] for p in PHASES if p in out}

