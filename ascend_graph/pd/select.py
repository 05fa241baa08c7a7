"""Choosing a transport by name: ``auto`` is Mooncake where its engine loads, else gloo."""

from __future__ import annotations

import functools
from typing import Optional

from .transport import Transport

TRANSPORTS = ("auto", "mooncake", "gloo")


@functools.lru_cache(maxsize=1)
def mooncake_problem() -> Optional[str]:
    """Why Mooncake's transfer engine does not load in this process, or None when it does.

    The import is tried once and its outcome cached: a wheel that is installed but cannot load
    (``libibverbs.so.1`` missing, an ``OSError`` from its loader) counts as unavailable."""
    from .mooncake import _engine_class

    try:
        _engine_class()
    except ImportError as e:
        return str(e)
    return None


def mooncake_available() -> bool:
    """Whether Mooncake's transfer engine loads here (``pip install "ascend-graph[pd]"``)."""
    return mooncake_problem() is None


def resolve_transport(name: str) -> str:
    """The transport ``name`` stands for: ``auto`` is Mooncake where its engine loads, else gloo."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {name!r}")
    if name == "auto":
        return "mooncake" if mooncake_available() else "gloo"
    return name


def open_transport(name: str, role: str, host: str = "127.0.0.1") -> Transport:
    """A new, unregistered transport of kind ``name`` (``auto``/``mooncake``/``gloo``) for ``role``.

    ``ImportError`` with the reason when ``mooncake`` is asked for and its engine does not load."""
    kind = resolve_transport(name)
    if kind == "mooncake":
        problem = mooncake_problem()
        if problem is not None:
            raise ImportError(problem)
        from .mooncake import MooncakeTransport

        return MooncakeTransport(role, host=host)
    from .gloo import GlooTransport

    return GlooTransport(role, host=host)
