"""Where a ``GraphConfig`` comes from outside Python code: the environment and JSON text.

Both read our own keys and vllm-ascend's ``torchair_graph_config`` / ``additional_config``
through ``ascend_graph.integrations.vllm_ascend.graph_config``. This module sits above
``config`` and ``integrations.vllm_ascend``; the engine (``GraphConfig`` default) and the CLI
(``--graph-config``) call it. The variables: docs/configuration.md.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import replace
from typing import Iterator, Mapping, Optional

from .config import GraphConfig
from .integrations.vllm_ascend import graph_config

CONFIG_VARIABLE = "ASCEND_GRAPH_CONFIG"
BACKEND_VARIABLE = "ASCEND_GRAPH_BACKEND"
ENABLED_VARIABLE = "ASCEND_GRAPH_ENABLED"


def from_json(text: str, base: Optional[GraphConfig] = None, source: str = "the graph config") -> GraphConfig:
    """``base`` updated from ``text``, a JSON object (our keys and/or vllm-ascend's sections).

    Errors are prefixed with ``source`` (a variable's or a flag's name).
    """
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source} is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise TypeError(f"{source} must be a JSON object, got {type(parsed).__name__}")
    with _naming(source):
        return graph_config(parsed, base=base)


def from_env(base: Optional[GraphConfig] = None, environ: Mapping[str, str] = os.environ) -> GraphConfig:
    """``base`` (default: all defaults) overridden from the environment.

    - ``ASCEND_GRAPH_CONFIG``: a JSON object, read by ``from_json`` over ``base``.
    - ``ASCEND_GRAPH_BACKEND``: the backend name, over the JSON.
    - ``ASCEND_GRAPH_ENABLED``: ``1``/``true``/``on``/``yes`` or ``0``/``false``/``off``/``no``;
      applied last, so ``ASCEND_GRAPH_ENABLED=0`` turns graph mode off whatever else is set.

    Unset or empty variables change nothing.
    """
    config = base if base is not None else GraphConfig()
    raw = environ.get(CONFIG_VARIABLE, "").strip()
    if raw:
        config = from_json(raw, base=config, source=CONFIG_VARIABLE)
    backend = environ.get(BACKEND_VARIABLE, "").strip()
    if backend:
        with _naming(BACKEND_VARIABLE):
            config = replace(config, backend=backend)
    enabled = environ.get(ENABLED_VARIABLE, "").strip()
    if enabled:
        config = replace(config, enabled=_parse_bool(ENABLED_VARIABLE, enabled))
    return config


@contextlib.contextmanager
def _naming(source: str) -> Iterator[None]:
    """Prefix a config error with where the value came from."""
    try:
        yield
    except (TypeError, ValueError) as e:
        raise type(e)(f"{source}: {e}") from None


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name} must be 0/1, true/false or on/off, got {raw!r}")
