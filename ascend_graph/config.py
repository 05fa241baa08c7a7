"""User-facing graph-mode configuration: ``GraphConfig`` and its per-backend options.

``GraphConfig`` is what the runner and the compile backends read. It is built directly, or from
a dict of its own keys (``GraphConfig.from_dict``; ``to_dict`` gives that dict back). Other
sources build on this module, never the reverse: vllm-ascend's ``torchair_graph_config`` and
``additional_config`` dicts go through ``ascend_graph.integrations.vllm_ascend.graph_config``,
the ``ASCEND_GRAPH_*`` environment through ``ascend_graph.config_sources.from_env``.

Each field's type is declared once, as its annotation, and one checker (``check_value``)
enforces it at construction: a bad value raises ``TypeError`` or ``ValueError`` before anything
runs, naming the key (dotted for nested options: ``inductor.cpp_wrapper``) and what it expects.
Every field, its default and meaning, and every environment variable: docs/configuration.md.
"""

from __future__ import annotations

import functools
import os
import types
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from typing import Annotated, Any, ClassVar, Literal, Mapping, Optional, Union, get_args, get_origin, get_type_hints


@dataclass(frozen=True)
class Minimum:
    """Annotation metadata: the smallest value an int field takes."""

    value: int


@dataclass(frozen=True)
class IsPath:
    """Annotation metadata: a non-empty ``str`` or ``os.PathLike``, kept as ``str``."""


PositiveInt = Annotated[int, Minimum(1)]
NonNegativeInt = Annotated[int, Minimum(0)]
PathStr = Annotated[str, IsPath()]
Backend = Literal["auto", "torchair", "npugraph_ex", "inductor", "cudagraphs", "aot_eager", "eager"]
RecompilePolicy = Literal["error", "warn"]
TorchairMode = Literal["max-autotune", "reduce-overhead"]
MissingOptionPolicy = Literal["auto", "error", "warn"]

BACKENDS = get_args(Backend)
RECOMPILE_POLICIES = get_args(RecompilePolicy)
TORCHAIR_MODES = get_args(TorchairMode)

# Top-level keys that moved into a nested options class: old name -> new dotted name.
MOVED = {
    "inductor_cpp_wrapper": "inductor.cpp_wrapper",
    "inductor_freezing_min_batch": "inductor.freezing_min_batch",
    "aot_inductor": "inductor.aot",
}
# vllm-ascend's sections, read by the integration, not by ``GraphConfig.from_dict``.
VLLM_ASCEND_KEYS = ("torchair_graph_config", "additional_config")
VLLM_ASCEND_ENTRY_POINT = "ascend_graph.integrations.vllm_ascend.graph_config"


@dataclass(frozen=True)
class TorchairOptions:
    """How the torchair backend (Ascend NPU) compiles; ignored on every other backend.

    ``mode`` -> torchair's ``CompilerConfig.mode`` (``"reduce-overhead"`` is deprecated from
    torch_npu 7.3.0 on, for the ``npugraph_ex`` backend, and warns); ``enable_frozen_parameter``,
    ``enable_view_optimize``, ``tiling_schedule_optimize`` -> its ``experimental_config`` options
    of those names; ``use_cached_graph``: compile through ``torchair.inference.cache_compile``
    into ``GraphConfig.compile_cache_dir``, so a later process loads the graphs instead of
    compiling. ``missing_options``: what an option the installed torchair lacks does:
    ``"error"`` (ValueError naming it), ``"warn"`` (a warning naming it; compiled without it) or
    ``"auto"``: an error where the option was changed from its default, a warning where it was
    left at its default (vllm-ascend's recipe, which runs correctly without it). Meanings:
    docs/configuration.md.
    """

    KEY: ClassVar[str] = "torchair"

    mode: TorchairMode = "max-autotune"
    enable_frozen_parameter: bool = True
    enable_view_optimize: bool = True
    tiling_schedule_optimize: bool = True
    use_cached_graph: bool = False
    missing_options: MissingOptionPolicy = "auto"

    def __post_init__(self) -> None:
        check_fields(self, f"{self.KEY}.")


@dataclass(frozen=True)
class NpugraphExOptions:
    """How the npugraph_ex backend (torchair's aclgraph capture, Ascend NPU) compiles; ignored
    on every other backend. The fields are npugraph_ex's ``options`` of those names.

    - ``capture_limit``: captures of one FX graph (one per input shape) before that graph runs
      eager from then on; torchair's default.
    - ``clone_input``: npugraph_ex copies the non-mutated inputs into its own buffers before each
      replay. Off here (torchair: on): the runner's inputs are persistent buffers at fixed addresses.
    - ``frozen_parameter``: the addresses of parameters and of ``mark_static_address`` tensors (the
      KV caches, the static input buffers) are taken as fixed. On here (torchair: off): the runner
      checks that those addresses never change.
    - ``force_eager``: run the rewritten FX graph eagerly, never captured (to tell a capture
      problem from a rewrite problem); torchair's default.
    - ``use_graph_pool``: all capture sizes capture into one memory pool
      (``torch.npu.graph_pool_handle()``, made when the backend is built); torchair's default is
      no shared pool.
    """

    KEY: ClassVar[str] = "npugraph_ex"

    capture_limit: PositiveInt = 64
    clone_input: bool = False
    frozen_parameter: bool = True
    force_eager: bool = False
    use_graph_pool: bool = False

    def __post_init__(self) -> None:
        check_fields(self, f"{self.KEY}.")


@dataclass(frozen=True)
class InductorOptions:
    """How the Inductor backend compiles; ``freezing_min_batch`` and ``aot`` are CPU only.

    - ``cpp_wrapper``: Inductor's C++ wrapper on or off; ``None`` = the platform's default
      (``compile.inductor.DEFAULT_CPP_WRAPPER``). A graph taking opaque values (vLLM's
      ``LayerName``) always gets the Python wrapper, which can pass them to its ops.
    - ``freezing_min_batch``: capture sizes of at least this many rows compile with Inductor's
      freezing (weights become graph constants; a weight changed after capture is not seen by
      that graph). ``None`` = off.
    - ``aot``: each capture size compiled ahead of time into an AOTInductor package under the
      compile cache, loaded instead of compiled by a later process (``compile.aot_inductor``).
      Not combinable with ``freezing_min_batch``.
    - ``dynamic_batch``: capture sizes of 2 rows and more share one compile whose batch
      dimension is dynamic (size 1 compiles alone); ``None`` = on for a CPU runner's own Inductor
      backend when the model has no bf16/fp16 parameters (``runner.groups``). CPU only; not
      combinable with ``aot`` or ``freezing_min_batch``.
    - ``precompile``: each compiled step (dynamo's trace and Inductor's code) saved under the
      compile cache and loaded by a later process instead of traced (``compile.precompile``; torch's
      ``aot_compile``, which torch calls experimental). ``None`` = on wherever it applies: a CPU
      runner's own Inductor backend without ``aot`` or ``freezing_min_batch`` (``True`` elsewhere
      is refused).

    Costs and measured effects: docs/configuration.md.
    """

    KEY: ClassVar[str] = "inductor"

    cpp_wrapper: Optional[bool] = None
    freezing_min_batch: Optional[PositiveInt] = None
    aot: bool = False
    dynamic_batch: Optional[bool] = None
    precompile: Optional[bool] = None

    def __post_init__(self) -> None:
        check_fields(self, f"{self.KEY}.")
        if self.precompile and (self.aot or self.freezing_min_batch is not None):
            raise ValueError("inductor.precompile=True cannot be combined with inductor.aot or "
                             "inductor.freezing_min_batch: those compile their own way")
        if self.dynamic_batch and (self.aot or self.freezing_min_batch is not None):
            raise ValueError("inductor.dynamic_batch=True cannot be combined with inductor.aot or "
                             "inductor.freezing_min_batch: both compile each capture size on its own")
        if self.aot and self.freezing_min_batch is not None:
            raise ValueError("inductor.aot=True cannot be combined with inductor.freezing_min_batch: "
                             "a package keeps the weights out of its code, freezing folds them in")


@dataclass(frozen=True)
class GraphConfig:
    """Graph-mode configuration of the decode runner; every field in docs/configuration.md.

    - ``enabled``: off, every step runs eager.
    - ``backend``: ``"auto"`` picks by device (torchair on NPU, Inductor on CUDA and CPU), or one
      of ``BACKENDS`` by name (``torchair`` and ``npugraph_ex`` on an NPU only).
    - ``max_batch_size``: the largest decode batch run as a graph; always captured.
    - ``capture_sizes``: batch sizes to capture, in ``[1, max_batch_size]``, kept sorted;
      ``None`` = powers of two below ``max_batch_size``. ``max_batch_size`` is always added.
    - ``fallback_on_compile_error``: a failed compile runs eager (True) or raises (False).
    - ``on_recompile``: a compile after warm-up raises (``"error"``) or logs (``"warn"``).
    - ``compile_cache_dir``: the backends' persistent compile cache; ``None`` = their default.
    - ``parity_interval``: every N graph steps the runner checks graph against eager; 0 = off.
    - ``inductor``, ``torchair``, ``npugraph_ex``: the backends' own options.

    Constructor keywords and ``from_dict`` keys of the old flat Inductor fields
    (``MOVED``) raise, naming the new place.
    """

    enabled: bool = False
    backend: Backend = "auto"
    max_batch_size: PositiveInt = 64
    capture_sizes: Optional[tuple[PositiveInt, ...]] = None
    fallback_on_compile_error: bool = True
    on_recompile: RecompilePolicy = "error"
    compile_cache_dir: Optional[PathStr] = None
    parity_interval: NonNegativeInt = 0
    inductor: InductorOptions = field(default_factory=InductorOptions)
    torchair: TorchairOptions = field(default_factory=TorchairOptions)
    npugraph_ex: NpugraphExOptions = field(default_factory=NpugraphExOptions)

    def __new__(cls, *args: Any, **kwargs: Any) -> "GraphConfig":
        for key in kwargs:
            if key in MOVED:
                raise TypeError(moved_message(key))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        check_fields(self)
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
        """JSON-safe dict of our own keys (options as nested dicts); ``from_dict`` reads it back equal."""
        d = asdict(self)
        if d["capture_sizes"] is not None:
            d["capture_sizes"] = list(d["capture_sizes"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base: Optional["GraphConfig"] = None) -> "GraphConfig":
        """``base`` (default: all defaults) with the keys of ``d`` replaced.

        ``d`` holds field names; ``inductor``, ``torchair`` and ``npugraph_ex`` are dicts of their options' fields
        and change only the options they name. Unknown keys are rejected by name; the old flat
        Inductor keys with their new place; vllm-ascend's sections with the entry point that
        reads them (``VLLM_ASCEND_ENTRY_POINT``).
        """
        base = base if base is not None else cls()
        for key in d if isinstance(d, Mapping) else ():
            if key in MOVED:
                raise ValueError(moved_message(key))
            if key in VLLM_ASCEND_KEYS:
                raise ValueError(f"{key!r} is vllm-ascend's schema, not a GraphConfig key: read such a dict "
                                 f"with {VLLM_ASCEND_ENTRY_POINT}(d, base)")
        return replace(base, **_updates(base, d, ""))


def moved_message(key: str) -> str:
    """The error for an old flat key: where it lives now."""
    new = MOVED[key]
    section, name = new.split(".")
    return (f"{key!r} moved to {new!r}: pass {section}={section.capitalize()}Options({name}=...) to GraphConfig, "
            f"or {{{section!r}: {{{name!r}: ...}}}} in a dict")


# ---------------------------------------------------------------------------------------------
# One checker, driven by the dataclasses' annotations


def check_fields(obj: Any, prefix: str = "") -> None:
    """Check and normalise every field of the frozen dataclass ``obj`` against its annotation."""
    for name, kind in _field_kinds(type(obj)).items():
        object.__setattr__(obj, name, check_value(prefix + name, getattr(obj, name), kind))


def check_value(key: str, value: Any, kind: Any) -> Any:
    """``value`` checked against the annotation ``kind`` and normalised; errors name ``key``.

    Kinds: ``bool`` (the ints 0 and 1 too: configs written as ``int(os.environ[...])`` give
    those), ``int`` (not bool; ``Annotated[int, Minimum(n)]`` for a floor), ``str``,
    ``Literal[...]`` (a choice), ``Optional[X]``, ``tuple[X, ...]`` (from a list or tuple),
    ``PathStr``, and an options dataclass (an instance of it).
    """
    origin, args = get_origin(kind), get_args(kind)
    if origin is Annotated:
        inner, *meta = args
        if any(isinstance(m, IsPath) for m in meta):
            return _check_path(key, value)
        value = check_value(key, value, inner)
        for m in meta:
            if isinstance(m, Minimum) and value < m.value:
                raise ValueError(f"{key} must be >= {m.value}, got {value}")
        return value
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return check_value(key, value, inner)
    if origin is Literal:
        if type(value) not in {type(a) for a in args} or value not in args:
            raise ValueError(f"{key} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{key} must be a list of {_describe(args[0], plural=True)}, got {type(value).__name__} {value!r}")
        return tuple(check_value(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
    if kind is bool:
        return _check_bool(key, value)
    if kind in (int, str):
        if isinstance(value, bool) or not isinstance(value, kind):
            raise TypeError(f"{key} must be {_describe(kind)}, got {type(value).__name__} {value!r}")
        return value
    if is_dataclass(kind):
        if not isinstance(value, kind):
            article = "an" if kind.__name__[0] in "AEIOU" else "a"
            raise TypeError(f"{key} must be {article} {kind.__name__}, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"{key}: no check for the annotation {kind!r}")


@functools.cache
def _field_kinds(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in fields(cls)}


def _describe(kind: Any, plural: bool = False) -> str:
    base = get_args(kind)[0] if get_origin(kind) is Annotated else kind
    names = {bool: ("a bool", "bools"), int: ("an int", "ints"), str: ("a string", "strings")}
    return names[base][plural] if base in names else getattr(base, "__name__", str(base))


def _check_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise TypeError(f"{key} must be a bool (or 0/1), got {type(value).__name__} {value!r}")


def _check_path(key: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"{key} must be a non-empty path string or None, got {value!r}")
    return os.fspath(value)


def _check_sizes(sizes: tuple[int, ...], max_batch_size: int) -> tuple[int, ...]:
    if not sizes:
        raise ValueError("capture_sizes must not be empty; use None for the default sizes")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"capture_sizes must not repeat a size, got {list(sizes)}")
    too_big = [s for s in sizes if s > max_batch_size]
    if too_big:
        raise ValueError(f"capture_sizes {too_big} exceed max_batch_size={max_batch_size}; "
                         "raise max_batch_size or drop those sizes")
    return tuple(sorted(sizes))


# ---------------------------------------------------------------------------------------------
# Reading a dict of our own keys


def _updates(obj: Any, d: Any, prefix: str) -> dict[str, Any]:
    """``d``'s keys as ``replace`` arguments over the dataclass ``obj``; nested options merged."""
    names = [f.name for f in fields(obj)]
    where = prefix.rstrip(".") or "the graph config"
    if not isinstance(d, Mapping):
        raise TypeError(f"{where} must be a dict of {', '.join(names)}, got {type(d).__name__}")
    updates = {}
    for key, value in d.items():
        if key not in names:
            raise ValueError(f"unknown key {key!r} in {where}; known keys: {', '.join(names)}")
        current = getattr(obj, key)
        if is_dataclass(current) and not isinstance(value, type(current)):
            value = replace(current, **_updates(current, value, f"{prefix}{key}."))
        updates[key] = value
    return updates
