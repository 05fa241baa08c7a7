"""torch.compile backends of graph mode, chosen by configuration and device.

``resolve_backend(config, device)`` gives the callable to hand ``torch.compile(backend=...)``.
``ascend_graph_backend`` is the same choice made at compile time from the example inputs'
device, registered as ``"ascend_graph"`` through the ``torch_dynamo_backends`` entry point, so
``torch.compile(fn, backend="ascend_graph", options={...})`` works without importing this package.

Each backend lives in its own module, imported only when chosen, so an absent platform
(torch_npu, CUDA) costs nothing. ``compile_recipe(config, device)`` is how the runner compiles
for the chosen backend (``compile.recipe``): the module's ``compile_recipe``, else the default.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..config import GraphConfig
from .recipe import DEFAULT_RECIPE, CompileRecipe

# backend name -> module with ``make_backend(name, config, platform, mode)``
BACKEND_MODULES = {
    "torchair": "ascend_graph.compile.torchair",
    "npugraph_ex": "ascend_graph.compile.npugraph_ex",
    "inductor": "ascend_graph.compile.inductor",
    "cudagraphs": "ascend_graph.compile.debug",
    "aot_eager": "ascend_graph.compile.debug",
    "eager": "ascend_graph.compile.debug",
}
# what ``backend="auto"`` means on each platform
AUTO_BACKEND = {"npu": "torchair", "cuda": "inductor", "cpu": "inductor"}
# platforms each backend runs on; the rest run anywhere
BACKEND_PLATFORMS = {"torchair": ("npu",), "npugraph_ex": ("npu",), "cudagraphs": ("cuda",),
                     "inductor": ("cpu", "cuda", "npu")}

DeviceLike = Union[torch.device, str]


def detect_platform(device: DeviceLike) -> str:
    """``"npu"``, ``"cuda"`` or ``"cpu"`` for a device (``"npu"``/``"npu:0"`` strings work without torch_npu)."""
    kind = device.split(":")[0] if isinstance(device, str) else getattr(device, "type", None)
    if kind == "privateuseone" and torch._C._get_privateuse1_backend_name() == "npu":
        kind = "npu"
    if kind not in AUTO_BACKEND:
        raise ValueError(f"device {device!r} is not supported: graph mode runs on npu, cuda or cpu devices")
    return kind


def backend_name(config: GraphConfig, platform: str) -> str:
    """The concrete backend ``config.backend`` means on ``platform``; raises if it cannot run there."""
    name = AUTO_BACKEND[platform] if config.backend == "auto" else config.backend
    allowed = BACKEND_PLATFORMS.get(name)
    if allowed is not None and platform not in allowed:
        raise ValueError(f"backend={name!r} needs a {' or '.join(allowed)} device, got a {platform} device")
    return name


def resolve_backend(config: GraphConfig, device: DeviceLike, *, mode: Optional[str] = None) -> Callable:
    """The callable to pass as ``torch.compile(..., backend=...)`` for ``config`` on ``device``.

    NPU: the torchair (GE) adapter, or npugraph_ex; CUDA: Inductor with CUDA graphs (``reduce-overhead``); CPU:
    Inductor with the configured options; ``"cudagraphs"``, ``"aot_eager"``, ``"eager"``: torch's
    own backends. ``mode`` is torch.compile's mode: the torchair mode on torchair, Inductor's
    mode options on Inductor.
    """
    if not isinstance(config, GraphConfig):
        raise TypeError(f"config must be a GraphConfig, got {type(config).__name__}")
    platform = detect_platform(device)
    name = backend_name(config, platform)
    module = importlib.import_module(BACKEND_MODULES[name])
    return module.make_backend(name, config, platform, mode)


def compile_recipe(config: GraphConfig, device: DeviceLike) -> CompileRecipe:
    """How the runner compiles its steps for ``config``'s backend on ``device`` (raises as
    ``resolve_backend`` where that backend cannot run there); imports no platform package."""
    name = backend_name(config, detect_platform(device))
    module = importlib.import_module(BACKEND_MODULES[name])
    recipe = getattr(module, "compile_recipe", None)
    return recipe(config) if recipe is not None else DEFAULT_RECIPE


def ascend_graph_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                         mode: Optional[str] = None, options: Any = None) -> Callable:
    """The ``"ascend_graph"`` torch.compile backend: compile ``gm`` for its inputs' device.

    torch.compile passes ``mode`` (when not ``"default"``) or ``options`` (never both):
    ``options`` is a ``GraphConfig`` or a dict for ``GraphConfig.from_dict``. ``config.enabled``
    is the runner's switch and is not consulted here: being called is the request to compile.
    """
    if options is None:
        config = GraphConfig()
    elif isinstance(options, GraphConfig):
        config = options
    else:
        config = GraphConfig.from_dict(options)
    return resolve_backend(config, input_device(example_inputs), mode=mode)(gm, example_inputs)


def input_device(example_inputs: Sequence[Any]) -> torch.device:
    """The accelerator among the inputs' devices, else CPU (a graph with no tensor inputs runs on CPU)."""
    devices = {x.device for x in example_inputs if isinstance(x, torch.Tensor)}
    accelerators = sorted((d for d in devices if d.type != "cpu"), key=str)
    if len({d.type for d in accelerators}) > 1:
        raise ValueError(f"example inputs are on several accelerators: {', '.join(map(str, accelerators))}")
    return accelerators[0] if accelerators else torch.device("cpu")


__all__ = ["CompileRecipe", "ascend_graph_backend", "backend_name", "compile_recipe", "detect_platform", "input_device",
           "resolve_backend"]
