"""Mixture of experts: the router, the routed experts' forms, their backends, the MoE block."""

from .backend import MOE_BACKENDS, MoEBackend, select_moe_backend
from .experts import RoutedExperts
from .layer import MLP, MoE
from .router import Router

__all__ = ["MLP", "MOE_BACKENDS", "MoE", "MoEBackend", "RoutedExperts", "Router", "select_moe_backend"]
