"""vllm-ascend's configuration read onto ``GraphConfig``: the entry point ``graph_config``.

``graph_config(d, base=None)`` takes a dict of our own ``GraphConfig`` keys, vllm-ascend's
``{"torchair_graph_config": {...}}``, the same section inside ``{"additional_config": {...}}``
(its other sections are ignored with a warning), or a mix; a setting given both ways must agree.
``GraphConfig.from_dict`` takes our own keys only and names this function for the rest; the
environment and the CLI read through it (``ascend_graph.config_sources``). This module depends
on ``ascend_graph.config``, never the reverse.

The keys and defaults are vllm-ascend's ``TorchairGraphConfig`` (``vllm_ascend/ascend_config.py``,
v0.9 to v0.11; torchair graph mode was dropped in v0.13). How each maps:

| key | default there | here |
| --- | --- | --- |
| ``enabled`` | False | ``enabled`` |
| ``mode`` | ``''`` (torchair's default, max-autotune) | ``torchair.mode``; ``''`` leaves it |
| ``graph_batch_sizes`` | ``[]`` | ``capture_sizes`` (sorted, repeats dropped; a size above ``max_batch_size`` raises where vllm-ascend drops it); ``[]`` means vllm-ascend's ``[1, max_num_seqs]``, i.e. ``(1,)`` plus ``max_batch_size`` |
| ``graph_batch_sizes_init`` | False | ``capture_sizes=None``: powers of two plus ``max_batch_size`` (vllm-ascend starts at 4 or tp_size; we also capture 1 and 2) |
| ``use_cached_graph`` | False | ``torchair.use_cached_graph`` (cache in ``compile_cache_dir``) |
| ``enable_view_optimize`` | True | ``torchair.enable_view_optimize`` |
| ``enable_frozen_parameter`` | True | ``torchair.enable_frozen_parameter`` |
| ``enable_multistream_mla``, ``enable_multistream_moe``, ``enable_super_kernel``, ``enable_kv_nz``, ``use_cached_kv_cache_bytes`` | False | not supported: ``false`` is accepted, ``true`` raises |

As in vllm-ascend, the graph-only keys (``mode``, ``use_cached_graph``, ``graph_batch_sizes``,
``graph_batch_sizes_init``, and the unsupported ones) are rejected when graph mode is off, and
``graph_batch_sizes_init`` is rejected next to a non-empty ``graph_batch_sizes``. Whether graph
mode is on: the section's ``enabled``, else the result of our own keys over ``base``.

No vllm-ascend key selects the ``npugraph_ex`` backend: its ``ascend_compilation_config.
enable_npugraph_ex`` runs npugraph_ex's FX passes eagerly (``force_eager``) inside vllm-ascend's
own ACL graph capture, not npugraph_ex's capture; that section is ignored with the others.
"""

from __future__ import annotations

import warnings
from dataclasses import fields, replace
from typing import Any, Literal, Mapping, Optional

from ..config import TORCHAIR_MODES, GraphConfig, PositiveInt, TorchairOptions, check_value

SECTION = "torchair_graph_config"

# Unsupported features, each with why: requesting one must not pass silently.
UNSUPPORTED = {
    "enable_multistream_mla": "MLA's vector ops are not moved to a second stream by our models",
    "enable_multistream_moe": "shared experts are not overlapped on a second stream by our models",
    "enable_super_kernel": "super-kernel fusion of MoE layers is not implemented",
    "enable_kv_nz": "the KV caches keep the ND layout (one format for graph and eager)",
    "use_cached_kv_cache_bytes": "the KV cache size is not cached across runs",
}
# The section's keys and their types (checked by ``config.check_value``, as GraphConfig's fields).
KINDS = {
    "enabled": bool, "mode": Optional[Literal[("",) + TORCHAIR_MODES]],
    "graph_batch_sizes": Optional[tuple[PositiveInt, ...]], "graph_batch_sizes_init": bool,
    "use_cached_graph": bool, "enable_view_optimize": bool, "enable_frozen_parameter": bool,
    **{key: bool for key in UNSUPPORTED},
}
GRAPH_ONLY = ("mode", "use_cached_graph", "graph_batch_sizes", "graph_batch_sizes_init", *UNSUPPORTED)


def graph_config(d: Mapping[str, Any], base: Optional[GraphConfig] = None) -> GraphConfig:
    """``base`` (default: all defaults) updated from ``d``: our own keys and/or vllm-ascend's section."""
    own, section = split_vllm_ascend(d)
    config = GraphConfig.from_dict(own, base=base)
    if section is None:
        return config
    updates, torchair = map_torchair_graph_config(section, config.enabled)
    _check_agreement(own, config, updates, torchair)
    return replace(config, **updates, torchair=replace(config.torchair, **torchair))


def split_vllm_ascend(d: Mapping[str, Any]) -> tuple[dict[str, Any], Optional[Mapping[str, Any]]]:
    """Our own keys of ``d``, and the ``torchair_graph_config`` section (top level or in ``additional_config``)."""
    if not isinstance(d, Mapping):
        raise TypeError(f"the graph config must be a dict, got {type(d).__name__}")
    own = dict(d)
    section = own.pop(SECTION, None)
    additional = own.pop("additional_config", None)
    if additional is not None:
        if not isinstance(additional, Mapping):
            raise TypeError(f"additional_config must be a dict, got {type(additional).__name__}")
        if SECTION in additional and section is not None:
            raise ValueError(f"{SECTION} is given both at the top level and inside additional_config")
        section = additional.get(SECTION, section)
        ignored = sorted(k for k in additional if k != SECTION)
        if ignored:
            warnings.warn(f"ascend_graph reads only {SECTION} from additional_config; ignored: "
                          f"{', '.join(ignored)}", stacklevel=3)
    if section is not None and not isinstance(section, Mapping):
        raise TypeError(f"{SECTION} must be a dict, got {type(section).__name__}")
    return own, section


def map_torchair_graph_config(section: Optional[Mapping[str, Any]],
                              enabled_default: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(GraphConfig updates, TorchairOptions updates)`` for a ``torchair_graph_config`` dict."""
    if section is None:
        return {}, {}
    values = {}
    for key, value in section.items():
        if key not in KINDS:
            raise ValueError(f"unknown key {key!r} in {SECTION}; known keys: {', '.join(KINDS)}")
        values[key] = check_value(f"{SECTION}.{key}", value, KINDS[key])
    enabled = values.get("enabled", enabled_default)
    _check_rules(values, enabled)
    updates = {"enabled": values["enabled"]} if "enabled" in values else {}
    if enabled:
        updates["capture_sizes"] = _capture_sizes(values)
    torchair = {key: values[key] for key in ("use_cached_graph", "enable_view_optimize", "enable_frozen_parameter")
                if key in values}
    if values.get("mode"):
        torchair["mode"] = values["mode"]
    return updates, torchair


def _check_agreement(own: Mapping[str, Any], config: GraphConfig, updates: Mapping[str, Any],
                     torchair: Mapping[str, Any]) -> None:
    """A setting given by our own keys and by the section must have one value."""
    own_torchair = own.get("torchair", {})
    given = own_torchair if isinstance(own_torchair, Mapping) else [f.name for f in fields(TorchairOptions)]
    pairs = [(key, getattr(config, key), value) for key, value in updates.items() if key in own]
    pairs += [(f"torchair.{key}", getattr(config.torchair, key), value) for key, value in torchair.items()
              if key in given]
    for key, mine, theirs in pairs:
        if mine != theirs:
            raise ValueError(f"{key} is set twice with different values: {mine!r} from our own keys and "
                             f"{theirs!r} from vllm-ascend's {SECTION}")


def _check_rules(values: dict[str, Any], enabled: bool) -> None:
    if not enabled:
        for key in GRAPH_ONLY:
            if values.get(key):
                raise ValueError(f"{SECTION}.{key} is valid only when graph mode is enabled "
                                 f"({SECTION}.enabled is false)")
    if values.get("graph_batch_sizes_init") and values.get("graph_batch_sizes"):
        raise ValueError(f"{SECTION}.graph_batch_sizes_init is valid only when graph_batch_sizes is empty")
    for key, why in UNSUPPORTED.items():
        if values.get(key):
            raise ValueError(f"{SECTION}.{key} is not supported by ascend_graph: {why}; set it to false or remove it")


def _capture_sizes(values: dict[str, Any]) -> Optional[tuple[int, ...]]:
    if values.get("graph_batch_sizes"):
        return tuple(sorted(set(values["graph_batch_sizes"])))
    if values.get("graph_batch_sizes_init"):
        return None
    return (1,)
