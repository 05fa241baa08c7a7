"""Prefill/decode disaggregation: KV blocks move from an eager prefill process into a decode
process's static tuple caches on an existing transfer engine (docs/pd.md)."""

from .decode import DecodeEngine, TransferStats
from .layout import CacheLayout, Descriptor, LayoutMismatch, Region, TransferPlan, block_runs, plan_transfer
from .prefill import PrefillServer
from .process import PrefillProcess
from .select import open_transport, resolve_transport
from .transport import TransferError, Transport

__all__ = ["CacheLayout", "DecodeEngine", "Descriptor", "LayoutMismatch", "PrefillProcess", "PrefillServer", "Region",
           "TransferError", "TransferPlan", "TransferStats", "Transport", "block_runs", "open_transport",
           "plan_transfer", "resolve_transport"]
