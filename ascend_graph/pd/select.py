"""Choosing a transport by name: ``auto`` is Mooncake where installed, else gloo."""

from __future__ import annotations

import importlib.util

from .transport import Transport

TRANSPORTS = ("auto", "mooncake", "gloo")


def mooncake_available() -> bool:
    """Whether Mooncake's transfer engine is installed (``pip install "ascend-graph[pd]"``)."""
    return importlib.util.find_spec("mooncake") is not None


def resolve_transport(name: str) -> str:
    """The transport ``name`` stands for: ``auto`` is Mooncake where installed, else gloo."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {name!r}")
    if name == "auto":
        return "mooncake" if mooncake_available() else "gloo"
    return name


def open_transport(name: str, role: str, host: str = "127.0.0.1") -> Transport:
    """A new, unregistered transport of kind ``name`` (``auto``/``mooncake``/``gloo``) for ``role``."""
    kind = resolve_transport(name)
    if kind == "mooncake":
        from .mooncake import MooncakeTransport

        return MooncakeTransport(role, host=host)
    from .gloo import GlooTransport

    return GlooTransport(role, host=host)
