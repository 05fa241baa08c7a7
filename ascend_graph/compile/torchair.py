"""The torchair backend (Ascend NPU), written against torchair's public API.

torchair ships inside torch_npu (``torch_npu.dynamo.torchair``) and is importable as ``torchair``
once torch_npu is imported. Both are imported only when this backend is chosen. Not run here (no
NPU); the contract tests check what is handed to torchair.

What vllm-ascend's torchair graph mode does, and this adapter too: a ``CompilerConfig`` with
``mode``, ``experimental_config.frozen_parameter``, ``.enable_view_optimize`` and
``.tiling_schedule_optimize``; ``torch.npu.set_compile_mode(jit_compile=False)`` (use the
prebuilt operator binaries rather than compiling operators online); then
``torchair.get_npu_backend(compiler_config=...)``, or ``torchair.inference.cache_compile`` when
compiled graphs are cached on disk.

How the runner compiles for it (``compile_recipe``): ``dynamic=True`` with every tensor input of
the step marked static (``torch._dynamo.mark_static``: input ids, positions, slot mapping, block
tables, context lengths, each tensor of every layer's cache tuple), as vllm-ascend did. Shapes stay
those of the capture size; the host integers the fused attention op takes (``actual_seq_lengths``)
stay symbolic. torchair's docs: with ``dynamic=False`` they become graph constants and every new
sequence length recompiles. ``mode="reduce-overhead"`` is deprecated from torch_npu 7.3.0 on, for the
``npugraph_ex`` backend (``compile.npugraph_ex``) and warns here.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from ..config import GraphConfig, TorchairOptions
from .recipe import CompileRecipe

MISSING = ("the torchair backend needs torch_npu (which ships torchair) and the Ascend CANN toolkit: "
           "install CANN, then `pip install 'ascend-graph[npu]'` (torch_npu matching your torch), and "
           "source CANN's set_env.sh; or choose another backend (GraphConfig.backend)")


def import_torchair() -> ModuleType:
    """torch_npu, then torchair; a clear ImportError when either is absent."""
    try:
        import torch_npu  # noqa: F401  (registers the NPU device and makes torchair importable)
    except ImportError as e:
        raise ImportError(f"{MISSING} (import torch_npu failed: {e})") from e
    try:
        import torchair
    except ImportError:
        try:
            from torch_npu.dynamo import torchair
        except ImportError as e:
            raise ImportError(f"{MISSING} (torch_npu is installed but torchair is not importable: {e})") from e
    return torchair


# experimental_config option -> the TorchairOptions field that sets it
EXPERIMENTAL_OPTIONS = (("frozen_parameter", "enable_frozen_parameter"),
                        ("enable_view_optimize", "enable_view_optimize"),
                        ("tiling_schedule_optimize", "tiling_schedule_optimize"))


def compiler_config(torchair: ModuleType, options: TorchairOptions) -> Any:
    """A ``torchair.CompilerConfig`` carrying ``options``; ``reduce-overhead`` warns (DeprecationWarning).
    An option the installed torchair lacks raises or warns by ``options.missing_options``
    (``TorchairOptions``), before anything is compiled."""
    if options.mode == "reduce-overhead":
        warnings.warn("torchair mode 'reduce-overhead' is deprecated (torch_npu 7.3.0 and later): use the "
                      "npugraph_ex backend instead (GraphConfig(backend='npugraph_ex'))",
                      DeprecationWarning, stacklevel=3)
    config = torchair.CompilerConfig()
    config.mode = options.mode
    experimental, defaults = config.experimental_config, TorchairOptions()
    for option, field in EXPERIMENTAL_OPTIONS:
        value = getattr(options, field)
        if hasattr(experimental, option):  # torchair raises on an option it does not have
            setattr(experimental, option, value)
        else:
            _missing(option, field, value, value != getattr(defaults, field), options.missing_options)
    return config


def _missing(option: str, field: str, value: Any, changed: bool, policy: str) -> None:
    """An experimental option the installed torchair lacks: ValueError or a warning, by ``policy``."""
    what = f"the installed torchair has no experimental_config.{option} (torchair.{field}={value!r})"
    if policy == "error" or (policy == "auto" and changed):
        raise ValueError(f"{what}: install a torch_npu whose torchair has it, leave torchair.{field} at its "
                         f"default, or set torchair.missing_options='warn' to compile without it")
    warnings.warn(f"{what}: compiling without it (torchair.missing_options={policy!r})", RuntimeWarning, stacklevel=4)


def compile_recipe(config: GraphConfig) -> CompileRecipe:
    """``dynamic=True``, every step tensor marked static (the module docstring says why)."""
    return CompileRecipe(dynamic=True, mark_static=True)


def make_backend(name: str, config: GraphConfig, platform: str, mode: Optional[str]) -> Callable:
    """torchair's NPU backend for ``config.torchair``; ``mode`` (torch.compile's) overrides its mode."""
    options = config.torchair if mode is None else replace(config.torchair, mode=mode)
    torchair = _prepare()
    return torchair.get_npu_backend(compiler_config=compiler_config(torchair, options))


def cache_compile(method: Callable, config: GraphConfig, *, dynamic: bool = True) -> Callable:
    """``torchair.inference.cache_compile`` of a bound ``nn.Module`` method, for ``use_cached_graph``.

    Use it in place of ``torch.compile`` (it compiles on first call and caches the graph in
    ``config.compile_cache_dir``, or torchair's default directory; a later process loads it).
    The cache belongs to the method's code object: vllm-ascend gives each batch size its own
    renamed copy of ``forward`` so that the sizes do not overwrite each other's cache. GE's own
    cache (``ge_cache``) stays off: torchair refuses it together with frozen parameters.
    ``dynamic`` is torch.compile's, ``True`` as in ``compile_recipe``.
    """
    torchair = _prepare()
    return torchair.inference.cache_compile(
        method, config=compiler_config(torchair, config.torchair), dynamic=dynamic,
        cache_dir=config.compile_cache_dir, ge_cache=False)


def _prepare() -> ModuleType:
    torchair = import_torchair()
    torch.npu.set_compile_mode(jit_compile=False)
    return torchair
