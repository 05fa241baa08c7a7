"""Fake ``torch_npu`` / ``torchair`` / npugraph_ex for the compile contract tests (no NPU here).

They record what the package hands them. Where a backend is asked to compile, the fake does
what torchair GE and npugraph_ex do first: AOTAutograd (``aot_module_simplified`` with
``keep_inference_input_mutations=True``, torchair's ``npu_fx_compiler``), which functionalizes
the graph and drops every operator whose declared outputs are unused and that declares no
mutation. It then runs that functionalized graph as it is, so a runner step runs end to end on
the CPU and can be compared with the eager runner. Nothing here imitates what GE or the ACL
graph capture do after that.
"""

from __future__ import annotations

import sys
import types

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

# torchair's experimental options the fake CompilerConfig has (and their torchair defaults)
EXPERIMENTAL = {"frozen_parameter": False, "enable_view_optimize": False, "tiling_schedule_optimize": False}


class StrictOptions:
    """Like torchair's config objects: setting an option they do not have raises."""

    def __init__(self, **options):
        object.__setattr__(self, "_known", set(options))
        for key, value in options.items():
            object.__setattr__(self, key, value)

    def __setattr__(self, key, value):
        if key not in self._known:
            raise ValueError(f"has no option {key}")
        object.__setattr__(self, key, value)


def through_aot_autograd(gm, example_inputs, graphs: list, restarts: list):
    """``gm`` compiled as torchair compiles it up to its own compiler: AOTAutograd, inference
    graph with input mutations kept in it; the functionalized graph is appended to ``graphs``
    and run as it is. Where AOTAutograd makes dynamo restart its analysis (a Python float it
    specializes, with ``dynamic=True``), the restart is appended to ``restarts``: dynamo then
    calls the backend again for the same step."""
    def run(fx_graph, inputs):
        graphs.append(fx_graph)
        return make_boxed_func(fx_graph.forward)

    try:
        return aot_autograd(fw_compiler=run, inference_compiler=run, keep_inference_input_mutations=True)(
            gm, example_inputs)
    except torch._dynamo.exc.RestartAnalysis as e:
        restarts.append(e)
        raise


def install_fake_npu(monkeypatch, *, npugraph_ex: bool = True) -> types.SimpleNamespace:
    """Fake torch_npu + torchair in ``sys.modules`` and a fake ``torch.npu``; with ``npugraph_ex``
    also the ``"npugraph_ex"`` torch.compile backend torch_npu registers. Returns the recorder:
    ``calls[...]`` lists, ``torchair`` (its ``experimental_options`` may be changed before use),
    ``ge_backend`` (what ``get_npu_backend`` returns), ``npugraph_ex`` and ``pool``. ``*_graphs``
    hold dynamo's graphs, ``aot_graphs`` the functionalized ones that ran, ``restarts`` dynamo's
    restarts from inside AOTAutograd."""
    calls = {"backend": [], "cache_compile": [], "set_compile_mode": [], "ge_graphs": [], "npugraph_ex": [],
             "npugraph_ex_graphs": [], "aot_graphs": [], "restarts": []}
    torchair = types.ModuleType("torchair")
    torchair.experimental_options = dict(EXPERIMENTAL)
    torchair.CompilerConfig = lambda: StrictOptions(
        mode="max-autotune", experimental_config=StrictOptions(**torchair.experimental_options))

    def ge_backend(gm, example_inputs, **kwargs):
        calls["ge_graphs"].append(gm)
        return through_aot_autograd(gm, example_inputs, calls["aot_graphs"], calls["restarts"])

    def get_npu_backend(*, compiler_config):
        calls["backend"].append(compiler_config)
        return ge_backend

    def cache_compile(func, **kwargs):  # compiles on first call through torchair's backend, as torchair does
        calls["cache_compile"].append((func, kwargs))
        return torch.compile(func, backend=get_npu_backend(compiler_config=kwargs["config"]),
                             dynamic=kwargs["dynamic"])

    def npugraph_ex_backend(gm, example_inputs, *, options):
        calls["npugraph_ex"].append(options)
        calls["npugraph_ex_graphs"].append(gm)
        return through_aot_autograd(gm, example_inputs, calls["aot_graphs"], calls["restarts"])

    torchair.get_npu_backend = get_npu_backend
    torchair.inference = types.SimpleNamespace(cache_compile=cache_compile)
    pool = object()  # what torch.npu.graph_pool_handle() returns
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setitem(sys.modules, "torchair", torchair)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(
        set_compile_mode=lambda **kw: calls["set_compile_mode"].append(kw), graph_pool_handle=lambda: pool),
        raising=False)
    if npugraph_ex:
        lookup = torch._dynamo.lookup_backend
        monkeypatch.setattr(torch._dynamo, "lookup_backend",
                            lambda name: npugraph_ex_backend if name == "npugraph_ex" else lookup(name))
    return types.SimpleNamespace(calls=calls, torchair=torchair, ge_backend=ge_backend,
                                 npugraph_ex=npugraph_ex_backend, pool=pool)
