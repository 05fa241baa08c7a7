"""User-facing graph-mode configuration: the flag, the backend, capture sizes, fallback policy.

``GraphConfig`` is what the runner and the compile backends read. It is built directly, from a
dict (``GraphConfig.from_dict``: our own keys, or vllm-ascend's ``torchair_graph_config``), or
from the environment (``GraphConfig.from_env``). Every bad value raises before anything runs,
naming the key and what it expects.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Iterator, Mapping, Optional

BACKENDS = ("auto", "torchair", "inductor", "cudagraphs", "aot_eager", "eager")
RECOMPILE_POLICIES = ("error", "warn")
TORCHAIR_MODES = ("max-autotune", "reduce-overhead")


@dataclass(frozen=True)
class TorchairOptions:
    """How the torchair backend (Ascend NPU) compiles; ignored on every other backend.

    - ``mode`` -> ``CompilerConfig.mode``: ``"max-autotune"`` (torchair's default: the FX graph
      becomes an Ascend IR graph run by GE) or ``"reduce-overhead"`` (captured NPU graphs).
    - ``enable_frozen_parameter`` -> ``experimental_config.frozen_parameter``: parameter
      addresses are taken as fixed, so the graph skips refreshing them every step.
    - ``enable_view_optimize`` -> ``experimental_config.enable_view_optimize``.
    - ``tiling_schedule_optimize`` -> ``experimental_config.tiling_schedule_optimize`` where the
      installed torchair has that option (vllm-ascend turns it on except on 300I Duo).
    - ``use_cached_graph``: compile through ``torchair.inference.cache_compile`` so a later
      process loads the compiled graphs from ``GraphConfig.compile_cache_dir`` instead of
      recompiling (and skips dynamo's guards on replay).
    """

    mode: str = "max-autotune"
    enable_frozen_parameter: bool = True
    enable_view_optimize: bool = True
    tiling_schedule_optimize: bool = True
    use_cached_graph: bool = False

    def __post_init__(self) -> None:
        _check_choice("torchair.mode", self.mode, TORCHAIR_MODES)
        for f in fields(self):
            if f.type == "bool":
                object.__setattr__(self, f.name, _check_bool(f"torchair.{f.name}", getattr(self, f.name)))


@dataclass(frozen=True)
class GraphConfig:
    """Graph-mode configuration of the decode runner; see the module docstring for the sources.

    - ``enabled``: the switch. Off, every step runs eager.
    - ``backend``: ``"auto"`` picks by device (torchair on an Ascend NPU; Inductor with CUDA
      graphs on CUDA; Inductor on CPU). Explicit: ``"torchair"``, ``"inductor"``,
      ``"cudagraphs"`` (CUDA graphs without codegen), ``"aot_eager"`` (AOTAutograd without
      codegen, for debugging), ``"eager"`` (dynamo tracing only).
    - ``max_batch_size``: the largest decode batch that runs as a graph; always captured.
    - ``capture_sizes``: batch sizes to capture; ``None`` = powers of two below
      ``max_batch_size``, plus ``max_batch_size``. Explicit sizes must lie in
      ``[1, max_batch_size]``; ``max_batch_size`` is added when missing (as vllm-ascend does).
    - ``fallback_on_compile_error``: a failed compile runs eager (True) or raises (False).
    - ``on_recompile``: what a compile after warm-up does: ``"error"`` or ``"warn"``.
    - ``compile_cache_dir``: persistent compile cache (Inductor's FX graph cache directory;
      torchair's ``cache_compile`` directory). ``None`` = the backend's own default. On CPU it
      also holds the compiled C++ kernels: copied whole to a node with the same CPU and torch,
      it gives that node a warm start. ``torch.compiler.save_cache_artifacts()`` does not:
      it carries the generated source only, and the C++ compiler runs again (README,
      "Performance", start-up).
    - ``parity_interval``: every N graph steps the runner checks graph against eager; 0 = off.
    - ``inductor_cpp_wrapper``: Inductor's C++ wrapper; ``None`` = the measured platform default.
    - ``inductor_freezing_min_batch``: CPU only. Capture sizes of at least this many rows
      compile with Inductor's freezing: the weights become constants of the graph, and the
      dense matmuls read weights pre-packed for oneDNN. It costs a packed copy of those
      weights per frozen size, and weights changed after capture are not seen by the graph
      (the parity check would report it). ``None`` = off. Figures: README, "Performance"
      (``benchmarks/levers.py`` and the suite's decode and memory parts). Size 1 is better
      left unfrozen: its matmuls become reductions over the unpacked weights.
    - ``aot_inductor``: CPU only, Inductor backend. Each capture size is compiled ahead of
      time (torch.export + AOTInductor) into a package under ``compile_cache_dir`` (else
      Inductor's cache directory); a later process with the same model, shapes, options and
      code loads it without compiling, and replays skip dynamo's guard check. The weights
      stay the model's tensors (not copied into the package). No recompile detection: a
      package is only ever loaded for the inputs it was built for
      (``ascend_graph.compile.aot_inductor``). Not combinable with freezing.
    - ``torchair``: options of the torchair backend (``TorchairOptions``).
    """

    enabled: bool = False
    backend: str = "auto"
    max_batch_size: int = 64
    capture_sizes: Optional[tuple[int, ...]] = None
    fallback_on_compile_error: bool = True
    on_recompile: str = "error"
    compile_cache_dir: Optional[str] = None
    parity_interval: int = 0
    inductor_cpp_wrapper: Optional[bool] = None
    inductor_freezing_min_batch: Optional[int] = None
    aot_inductor: bool = False
    torchair: TorchairOptions = field(default_factory=TorchairOptions)

    def __post_init__(self) -> None:
        for name in ("enabled", "fallback_on_compile_error", "aot_inductor"):
            object.__setattr__(self, name, _check_bool(name, getattr(self, name)))
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("on_recompile", self.on_recompile, RECOMPILE_POLICIES)
        _check_int("max_batch_size", self.max_batch_size, minimum=1)
        _check_int("parity_interval", self.parity_interval, minimum=0)
        if self.inductor_cpp_wrapper is not None:
            object.__setattr__(self, "inductor_cpp_wrapper",
                               _check_bool("inductor_cpp_wrapper", self.inductor_cpp_wrapper))
        if self.inductor_freezing_min_batch is not None:
            _check_int("inductor_freezing_min_batch", self.inductor_freezing_min_batch, minimum=1)
            if self.aot_inductor:
                raise ValueError("aot_inductor=True cannot be combined with inductor_freezing_min_batch: "
                                 "a package keeps the weights out of its code, freezing folds them in")
        if self.compile_cache_dir is not None:
            path = self.compile_cache_dir
            if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
                raise TypeError(f"compile_cache_dir must be a non-empty path string or None, got {path!r}")
            object.__setattr__(self, "compile_cache_dir", os.fspath(path))
        if not isinstance(self.torchair, TorchairOptions):
            raise TypeError(f"torchair must be a TorchairOptions, got {type(self.torchair).__name__}")
        if self.capture_sizes is not None:
            object.__setattr__(self, "capture_sizes", _check_sizes(self.capture_sizes, self.max_batch_size))

    def resolved_capture_sizes(self) -> tuple[int, ...]:
        """The batch sizes to capture, ascending; the last is always ``max_batch_size``."""
        if self.capture_sizes is None:
            sizes = {1 << i for i in range(self.max_batch_size.bit_length()) if 1 << i < self.max_batch_size}
        else:
            sizes = set(self.capture_sizes)
        return tuple(sorted(sizes | {self.max_batch_size}))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of our own keys; ``GraphConfig.from_dict`` reads it back unchanged."""
        d = asdict(self)
        if d["capture_sizes"] is not None:
            d["capture_sizes"] = list(d["capture_sizes"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base: Optional["GraphConfig"] = None) -> "GraphConfig":
        """Build a config from ``d``, over ``base`` (default: all defaults).

        ``d`` holds our own keys (the field names; ``torchair`` a dict of ``TorchairOptions``
        fields), and/or vllm-ascend's ``{"torchair_graph_config": {...}}``, also accepted nested
        as ``{"additional_config": {"torchair_graph_config": {...}}}``; how its keys map is in
        ``ascend_graph.integrations.vllm_ascend``. The same setting given both ways must agree. Unknown keys
        are rejected by name; other ``additional_config`` sections (vllm-ascend features outside
        graph compilation) are ignored with a warning. vllm-ascend's graph-only keys are refused
        while graph mode is off, as vllm-ascend refuses them; our own keys are not, so that
        ``enabled`` alone turns graph mode off without editing the rest.
        """
        from .integrations.vllm_ascend import map_torchair_graph_config, split_vllm_ascend

        base = base if base is not None else cls()
        own, section = split_vllm_ascend(d)
        updates, torchair_updates = _parse_own(own)
        vllm_updates, vllm_torchair = map_torchair_graph_config(section, updates.get("enabled", base.enabled))
        for key, value in vllm_updates.items():
            _merge_agreeing(updates, key, value)
        for key, value in vllm_torchair.items():
            _merge_agreeing(torchair_updates, key, value, prefix="torchair.")
        if torchair_updates:
            updates["torchair"] = replace(base.torchair, **torchair_updates)
        return replace(base, **updates)

    @classmethod
    def from_env(cls, base: Optional["GraphConfig"] = None,
                 environ: Mapping[str, str] = os.environ) -> "GraphConfig":
        """``base`` (default: all defaults) overridden from the environment.

        - ``ASCEND_GRAPH_CONFIG``: a JSON object, read by ``from_dict`` over ``base`` (our keys or
          vllm-ascend's ``torchair_graph_config``).
        - ``ASCEND_GRAPH_BACKEND``: the backend name, over the JSON.
        - ``ASCEND_GRAPH_ENABLED``: ``1``/``true``/``on`` or ``0``/``false``/``off``; applied last,
          so ``ASCEND_GRAPH_ENABLED=0`` turns graph mode off whatever else is set.
        Unset or empty variables change nothing.
        """
        cfg = base if base is not None else cls()
        raw = environ.get("ASCEND_GRAPH_CONFIG", "").strip()
        if raw:
            try:
                parsed = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"ASCEND_GRAPH_CONFIG is not valid JSON: {e}") from None
            if not isinstance(parsed, dict):
                raise TypeError(f"ASCEND_GRAPH_CONFIG must be a JSON object, got {type(parsed).__name__}")
            with _naming("ASCEND_GRAPH_CONFIG"):
                cfg = cls.from_dict(parsed, base=cfg)
        backend = environ.get("ASCEND_GRAPH_BACKEND", "").strip()
        if backend:
            with _naming("ASCEND_GRAPH_BACKEND"):
                cfg = replace(cfg, backend=backend)
        enabled = environ.get("ASCEND_GRAPH_ENABLED", "").strip()
        if enabled:
            cfg = replace(cfg, enabled=_parse_env_bool("ASCEND_GRAPH_ENABLED", enabled))
        return cfg


# ---------------------------------------------------------------------------------------------
# Parsing our own keys


_TYPES = {
    "enabled": "bool", "backend": "str", "max_batch_size": "int", "capture_sizes": "sizes",
    "fallback_on_compile_error": "bool", "on_recompile": "str", "compile_cache_dir": "str|None",
    "parity_interval": "int", "inductor_cpp_wrapper": "bool|None", "inductor_freezing_min_batch": "int|None",
    "aot_inductor": "bool",
}
_TORCHAIR_TYPES = {
    "mode": "str", "enable_frozen_parameter": "bool", "enable_view_optimize": "bool",
    "tiling_schedule_optimize": "bool", "use_cached_graph": "bool",
}


def _parse_own(d: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Type-checked updates for GraphConfig and for its TorchairOptions."""
    known = [*_TYPES, "torchair"]
    updates = {}
    for key, value in d.items():
        if key not in known:
            raise ValueError(f"unknown key {key!r} in the graph config; known keys: {', '.join(known)} "
                             "(and vllm-ascend's torchair_graph_config / additional_config)")
        if key != "torchair":
            updates[key] = convert(key, value, _TYPES[key])
    torchair = d.get("torchair", {})
    if not isinstance(torchair, Mapping):
        raise TypeError(f"torchair must be a dict of {', '.join(_TORCHAIR_TYPES)}, got {type(torchair).__name__}")
    torchair_updates = {}
    for key, value in torchair.items():
        if key not in _TORCHAIR_TYPES:
            raise ValueError(f"unknown key {key!r} in torchair; known keys: {', '.join(_TORCHAIR_TYPES)}")
        torchair_updates[key] = convert(f"torchair.{key}", value, _TORCHAIR_TYPES[key])
    return updates, torchair_updates


def _merge_agreeing(updates: dict[str, Any], key: str, value: Any, prefix: str = "") -> None:
    if key in updates and updates[key] != value:
        raise ValueError(f"{prefix}{key} is set twice with different values: {updates[key]!r} from our own "
                         f"keys and {value!r} from vllm-ascend's torchair_graph_config")
    updates[key] = value


def convert(key: str, value: Any, kind: str) -> Any:
    """``value`` checked against ``kind`` (bool, int, str, sizes, or ``X|None``), naming ``key``."""
    if kind.endswith("|None"):
        return None if value is None else convert(key, value, kind[:-5])
    if kind == "bool":
        return _check_bool(key, value)
    if kind == "int":
        return _check_int(key, value, minimum=None)
    if kind == "str":
        if not isinstance(value, str):
            raise TypeError(f"{key} must be a string, got {type(value).__name__} {value!r}")
        return value
    if kind == "sizes":
        if value is None:
            return None
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{key} must be a list of positive ints or null, got {type(value).__name__}")
        return tuple(sorted(_check_int(f"{key}[{i}]", v, minimum=1) for i, v in enumerate(value)))
    raise AssertionError(kind)


# ---------------------------------------------------------------------------------------------
# Value checks, shared by the constructors and the dict parsers


def _check_bool(key: str, value: Any) -> bool:
    """A bool; the ints 0 and 1 are accepted (configs written as ``int(os.environ[...])`` do)."""
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise TypeError(f"{key} must be a bool (or 0/1), got {type(value).__name__} {value!r}")


def _check_int(key: str, value: Any, minimum: Optional[int]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{key} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {value}")
    return value


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_sizes(sizes: Any, max_batch_size: int) -> tuple[int, ...]:
    sizes = convert("capture_sizes", sizes, "sizes")
    if not sizes:
        raise ValueError("capture_sizes must not be empty; use None for the default sizes")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"capture_sizes must not repeat a size, got {list(sizes)}")
    too_big = [s for s in sizes if s > max_batch_size]
    if too_big:
        raise ValueError(f"capture_sizes {too_big} exceed max_batch_size={max_batch_size}; "
                         "raise max_batch_size or drop those sizes")
    return sizes


@contextlib.contextmanager
def _naming(variable: str) -> Iterator[None]:
    """Prefix a config error with the environment variable it came from."""
    try:
        yield
    except (TypeError, ValueError) as e:
        raise type(e)(f"{variable}: {e}") from None


def _parse_env_bool(name: str, raw: str) -> bool:
    value = raw.lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name} must be 0/1, true/false or on/off, got {raw!r}")
