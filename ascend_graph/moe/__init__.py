"""Mixture of experts: the router, the routed experts' forms and the MoE block."""

from .layer import MLP, MoE, RoutedExperts, Router

__all__ = ["MLP", "MoE", "RoutedExperts", "Router"]
