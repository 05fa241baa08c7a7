"""Precompiled decode steps: dynamo's trace and Inductor's code of a capture size (or compile
group) saved to disk, loaded by a later process without tracing (``InductorOptions.precompile``).

A step is compiled through ``torch.compile(...).aot_compile`` and saved with
``save_compiled_function``; a later process loads it with ``torch.compiler.
load_compiled_function``, whose guards are checked on every call as a dynamo graph's are. The
file holds code and guards only: weights and caches are the step's inputs, read at each call (a
weight changed in place, or a different checkpoint of the same shapes, is what the loaded step
computes with). It is compiled, and called, in the mode its inputs were made in (``step_mode``):
inference mode where the runner's caches are inference tensors (a runner built under
``torch.inference_mode``, as vLLM's worker builds it), else grad mode off outside inference
mode, whatever mode the caller is in; the mode is part of the file's key.

A file is found by ``aot_inductor.package_key`` (torch's version, the CPU's vector capability
and thread count, this package's sources, the model's class, config, code (its module classes'
methods and files) and parameter shapes, the step's input shapes, the backend's options) plus
the compile group, so it is only ever loaded for what it was compiled for. Any failure to save
or load is logged and the step compiles as a plain ``torch.compile`` graph: precompiling never
decides whether a step runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..config import GraphConfig
from .aot_inductor import package_dir, package_key
from .inductor import cache_dir_for_compile

log = logging.getLogger(__name__)

SUBDIR = "ascend_graph_precompiled"


def precompiled_path(step: nn.Module, name: str, inputs: Sequence[Any], config: GraphConfig,
                     backend: Callable) -> str:
    """Where the precompiled ``name`` (``decode_step_<size or group>``) of these inputs lives, for
    the compile cache of ``config`` and the options of ``backend`` (an ``InductorBackend``)."""
    options = {**getattr(backend, "config_patches", {}), "inline_writes": getattr(backend, "inline_writes", None),
               "precompiled": name, "inference": made_in_inference_mode(inputs)}
    key = package_key(step, inputs, options)
    return os.path.join(os.path.dirname(package_dir(config)), SUBDIR, f"{name}-{key[:32]}.bin")


# The attributes ``torch._dynamo.mark_dynamic`` and its kind set on a tensor; a loaded step's
# guards require them absent (its guards are rebuilt from tensors that carry none).
DIM_MARKS = ("_dynamo_dynamic_indices", "_dynamo_dynamic_range", "_dynamo_weak_dynamic_indices",
             "_dynamo_unbacked_indices", "_dynamo_strict_unbacked_indices", "_dynamo_static_indices",
             "_has_dynamo_dim_marking")


class PrecompiledStep:
    """A loaded or just compiled step, called like the step's method (the module bound first).
    Its guards are checked on each call; where they fail (e.g. a guarded attribute of the model
    changed) the call goes to ``fallback``, the method's plain ``torch.compile``, which compiles it
    again as any graph's guard failure does (the runner counts that as a recompile). A loaded one
    takes its inputs' dynamic-dimension marks off at their first call (the runner's views of a
    compile group carry them for the cold compile)."""

    def __init__(self, fn: Any, step: nn.Module, loaded: bool, fallback: Callable, inference: bool) -> None:
        fn.disable_guard_check()  # checked here instead, where a failure can compile again
        self.fn, self.step, self.loaded, self.fallback, self.inference = fn, step, loaded, fallback, inference
        self._unmarked: set[int] = set()

    def __call__(self, *args: Any) -> Any:
        if self.loaded and id(args[0]) not in self._unmarked:
            for t in pytree.tree_leaves(args):
                for name in DIM_MARKS:
                    if isinstance(t, torch.Tensor) and hasattr(t, name):
                        delattr(t, name)
            self._unmarked.add(id(args[0]))  # the runner's views live as long as the runner
        with step_mode(self.inference):
            if self.fn.guard_check(self.step, *args):
                return self.fn(self.step, *args)
            log.warning("a precompiled step's guards failed; the step compiles again")
            return self.fallback(*args)


def made_in_inference_mode(inputs: Sequence[Any]) -> bool:
    """Whether the step's inputs (the runner's caches and buffers among them) are inference tensors."""
    return any(isinstance(t, torch.Tensor) and t.is_inference() for t in pytree.tree_leaves(list(inputs)))


def step_mode(inference: bool):
    """The mode a step is compiled and called in: inference mode for inference-tensor inputs
    (only there can it write them), else grad mode off outside inference mode. The dispatch keys
    a saved step's guards expect are those of tensors seen in that mode."""
    if inference:
        return torch.inference_mode(True)
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


@contextlib.contextmanager
def loading(config: GraphConfig, inductor: Callable):
    """What loading a step's compiled code needs: the Inductor options it was compiled with (the
    kernels' compile flags are part of their cache keys) and the compile cache it went to."""
    from torch._inductor import config as inductor_config

    patches = {k: v for k, v in getattr(inductor, "config_patches", {}).items() if k != "post_grad_custom_post_pass"}
    with inductor_config.patch(patches), cache_dir_for_compile(config.compile_cache_dir):
        yield


def aot_compile(compiled: Callable, inputs: Sequence[Any], inference: bool) -> Any:
    """``compiled`` (a ``torch.compile`` function) traced and compiled now for ``inputs``, in
    ``step_mode(inference)``."""
    with step_mode(inference):
        return compiled.aot_compile((tuple(inputs), {}))


def load_or_precompile(method: Callable, step: nn.Module, inputs: Sequence[Any], config: GraphConfig,
                       inductor: Callable, backend: Callable) -> tuple[Callable, bool]:
    """``method`` (``step``'s, named for its size or group) loaded from its file, else compiled
    through ``backend`` (``inductor``, the ``InductorBackend`` inside it, keys the file) on
    ``inputs`` and saved; and whether it was loaded. Where aot_compile fails,
    ``torch.compile(method)`` (compiled at its first call) is returned."""
    path, inference = precompiled_path(step, method.__name__, inputs, config, inductor), made_in_inference_mode(inputs)
    compiled = torch.compile(method, backend=backend, fullgraph=True, dynamic=False)  # compiles at first call
    if os.path.exists(path):
        try:
            with open(path, "rb") as f, loading(config, inductor):
                return PrecompiledStep(torch.compiler.load_compiled_function(f), step, True, compiled, inference), True
        except Exception as e:  # noqa: BLE001 - a stale or damaged file is compiled again
            log.warning("loading the precompiled step %s failed, compiling it again: %s", path, e)
    try:
        aot = aot_compile(compiled, inputs, inference)
    except Exception as e:  # noqa: BLE001 - what dynamo cannot save still compiles as a graph
        log.warning("precompiling %s failed, it compiles as a plain graph: %s", os.path.basename(path), e)
        return compiled, False
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.partial{os.getpid()}"
        aot.save_compiled_function(partial)
        os.replace(partial, path)  # never a partial file under the final name
    except Exception as e:  # noqa: BLE001 - the compiled step still runs in this process
        log.warning("saving the precompiled step %s failed: %s", path, e)
    return PrecompiledStep(aot, step, False, compiled, inference), False
