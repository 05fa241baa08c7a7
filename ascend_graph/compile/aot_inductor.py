"""Ahead-of-time packages of the decode step: torch.export + AOTInductor, on CPU.

Opt-in with ``GraphConfig.inductor.aot``. Each capture size's step is exported and compiled
into one ``.pt2`` package under the compile cache directory; a later process with the same
model, shapes, options and code loads the package instead of compiling: no dynamo trace, no
C++ compiler run, and no dynamo guard check on each replay.

As in the Inductor backend, the cache write is generated code (``inductor.inline_cache_writes``
on the exported program), not a call of the custom op through AOTInductor's proxy executor.
Also as there, a step of 2 or more rows calls the project's CPU kernel for its few-row matmuls
(``ascend_graph::rows_mm``, ``ascend_graph::expert_rows_mm``, ``ascend_graph/kernels/``) where
it runs: the loading process builds it at first use with the system C compiler, and the key
below includes whether it runs, so a package is never loaded where it cannot (docs/cpu-kernels.md).

The package holds code only. The weights stay the model's own tensors: at load they are handed
to the package as user-managed constants, so nothing is copied and an in-place weight update is
seen by the next step. Replacing a parameter by a new tensor after capture is not seen (a
dynamo graph would recompile instead); the parity check reports it.

A package is found by a key over everything that shapes the compiled code: torch's version,
the CPU's vector capability and the thread count the kernels are generated for, this package's
version and source files (C included), whether the project's CPU kernel runs here (part of the
decode-matmul pass's key), the model's class, config and code (``model_code_digest``: every
module class's methods and defining file, so an edited model of the same name never loads an
old package), its parameter and buffer shapes, dtypes and strides, the step's input shapes
(capture size, caches, block table), and the Inductor options. Anything else that differs makes
a new package; nothing is ever loaded for inputs it was not compiled for.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import types
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..config import GraphConfig

PACKAGE_SUBDIR = "ascend_graph_aoti"
# Inductor options that AOTInductor sets itself or that do not apply to it.
_NOT_FOR_AOT = ("cpp_wrapper", "cpp_wrapper_build_separate", "triton.cudagraphs")


@functools.cache
def register_step_types() -> None:
    """Give the step's named tuples (caches, attention metadata) the serialized names that
    torch.export needs to save and load a package's input spec."""
    from ..attention import metadata
    from ..kv_cache import KVCache, MLACache

    for cls in (KVCache, MLACache, metadata.AttentionMetadata, metadata.DecodeMetadata, metadata.PrefillMetadata):
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            pytree._register_namedtuple(cls, serialized_type_name=name)


def package_dir(config: GraphConfig) -> str:
    """Where the packages of ``config`` live: ``compile_cache_dir`` (else Inductor's cache
    directory), subdirectory ``ascend_graph_aoti``."""
    if config.compile_cache_dir is not None:
        root = config.compile_cache_dir
    else:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        root = cache_dir()
    return os.path.join(os.path.abspath(root), PACKAGE_SUBDIR)


def inductor_options(config: GraphConfig, platform: str) -> dict[str, Any]:
    """The Inductor options of the ``inductor`` backend that apply to AOTInductor, weights kept
    out of the package."""
    from .inductor import config_patches

    options = {k: v for k, v in config_patches(config, platform).items() if k not in _NOT_FOR_AOT}
    options["aot_inductor.package_constants_in_so"] = False
    return options


def package_key(step: nn.Module, inputs: Sequence[Any], options: dict[str, Any]) -> str:
    """A hex digest over everything the compiled code depends on (see the module docstring)."""
    h = hashlib.sha256()
    add = lambda *parts: h.update(repr(parts).encode())  # noqa: E731
    # Inductor's C++ kernels are generated for the thread count they are compiled under.
    from torch._inductor.utils import parallel_num_threads

    add(torch.__version__, torch.backends.cpu.get_cpu_capability(), parallel_num_threads(), _source_digest())
    from ..distributed import get_parallel_state

    state = get_parallel_state()  # a rank's step holds its share's shapes and its groups' collectives
    add(state.config, state.rank, state.collectives)
    model = getattr(step, "model", step)
    add(type(model).__module__, type(model).__qualname__, repr(getattr(model, "config", None)), model_code_digest(step))
    for name, t in _constants(step).items():
        add(name, tuple(t.shape), t.dtype, t.stride(), t.device.type)
    leaves, spec = pytree.tree_flatten(tuple(inputs))
    add(str(spec))
    for t in leaves:
        add(tuple(t.shape), t.dtype, t.stride(), t.device.type) if isinstance(t, torch.Tensor) else add(t)
    for k in sorted(options):
        v = options[k]
        add(k, v.uuid() if hasattr(v, "uuid") else v)
    return h.hexdigest()


@functools.cache
def _source_digest() -> str:
    """This package's version and a digest of its Python and C sources (read once per process)."""
    import ascend_graph

    h = hashlib.sha256(ascend_graph.__version__.encode())
    root = os.path.dirname(os.path.abspath(ascend_graph.__file__))
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(f for f in files if f.endswith((".py", ".c"))):
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                h.update(os.path.relpath(path, root).encode() + hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def model_code_digest(model: nn.Module) -> str:
    """A hex digest of the code of every module class in ``model.modules()`` and their bases
    (torch's own left out: its version is keyed): per class its module and name, the code of each
    method (bytecode, names and constants, nested functions included) and the text of the file
    that defines it (the helpers beside the class). An edited method or model file gives another
    digest; the same code in another directory gives the same."""
    classes = {c for m in model.modules() for c in type(m).__mro__
               if c is not object and not (c.__module__ or "").split(".")[0] == "torch"}
    h = hashlib.sha256()
    for cls in sorted(classes, key=lambda c: (c.__module__ or "", c.__qualname__)):
        h.update(repr((cls.__module__, cls.__qualname__)).encode())
        for name in sorted(vars(cls)):
            code = _method_code(vars(cls)[name])
            if code is not None:
                h.update(name.encode() + _code_bytes(code))
        path = _defining_file(cls)
        if path is not None:
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _defining_file(cls: type) -> Optional[str]:
    """The file ``cls``'s methods were compiled from, else its module's file; None where neither exists."""
    for value in vars(cls).values():
        code = _method_code(value)
        if code is not None and os.path.isfile(code.co_filename):
            return code.co_filename
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return path if path and os.path.isfile(path) else None


def _method_code(value: Any) -> Optional[types.CodeType]:
    """The code object of a class attribute that is a function, static or class method, or property."""
    value = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
    return getattr(value, "__code__", None)


def _code_bytes(code: types.CodeType) -> bytes:
    """What a code object computes, independent of its file's path and of the hash seed: bytecode,
    names and constants (a set's members sorted), nested code objects alike."""
    def const(c: Any) -> bytes:
        if isinstance(c, types.CodeType):
            return _code_bytes(c)
        if isinstance(c, (frozenset, set)):
            return repr(sorted(repr(x) for x in c)).encode()
        if isinstance(c, tuple):
            return b"(" + b",".join(const(x) for x in c) + b")"
        return repr(c).encode()

    return b"\0".join([code.co_code, repr((code.co_names, code.co_varnames)).encode(), const(code.co_consts)])


def load_or_compile(step: nn.Module, name: str, inputs: Sequence[Any], config: GraphConfig,
                    platform: str, on_compile: Optional[Callable[[], None]] = None) -> tuple["PackagedStep", bool]:
    """The AOTInductor model of ``step(*inputs)``, loaded from its package or compiled into one
    first (then ``on_compile()`` is called); and whether it was compiled now.

    ``name`` names the package file (the runner uses ``decode_step_<size>``). A package is
    written under a temporary name and renamed, so a process that is stopped mid-compile, or
    another process compiling the same step, never leaves a partial package to be loaded.
    """
    register_step_types()
    options = inductor_options(config, platform)
    folder = package_dir(config)
    path = os.path.join(folder, f"{name}-{package_key(step, inputs, options)[:32]}.pt2")
    compiled = not os.path.exists(path)
    if compiled:
        if on_compile is not None:
            on_compile()
        from .inductor import INLINE_CACHE_WRITES, cache_dir_for_compile, inline_cache_writes

        os.makedirs(folder, exist_ok=True)
        with torch.no_grad():
            program = torch.export.export(step, tuple(inputs), strict=False)
            if INLINE_CACHE_WRITES[platform] and inline_cache_writes(program.graph_module):
                program = program.run_decompositions({})  # retraced: the write's aten ops, functional
        partial = f"{path[:-len('.pt2')]}.partial{os.getpid()}.pt2"  # AOTInductor wants the suffix
        with cache_dir_for_compile(config.compile_cache_dir):
            torch._inductor.aoti_compile_and_package(program, package_path=partial, inductor_configs=options)
        os.replace(partial, path)
    model = torch._inductor.aoti_load_package(path)
    constants = _constants(step)
    wanted = model.get_constant_fqns()
    missing = [k for k in wanted if k not in constants]
    if missing:
        raise RuntimeError(f"the AOTInductor package {path} expects weights the model does not have: {missing[:5]}")
    weights = {k: constants[k] for k in wanted}
    model.load_constants(weights, check_full_update=True, user_managed=True)
    return PackagedStep(model, weights), compiled


class PackagedStep:
    """A loaded package, called like the step, and the weight tensors handed to it: they are
    held here so that their memory outlives the package even if the model's parameters are
    replaced later (the package would then read stale weights, which the parity check reports,
    never freed memory)."""

    def __init__(self, model: Callable, weights: dict[str, torch.Tensor]) -> None:
        self.model, self.weights = model, weights

    def __call__(self, *args: Any) -> Any:
        return self.model(*args)


def _constants(step: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name, tied ones under each of their names."""
    out = {k: p.data for k, p in step.named_parameters(remove_duplicate=False)}
    out.update(step.named_buffers(remove_duplicate=False))
    return out
