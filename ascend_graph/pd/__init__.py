"""Prefill/decode disaggregation: KV blocks move from an eager prefill process into a decode
process's static tuple caches on an existing transfer engine (docs/pd.md)."""

from .auth import AuthError, new_secret
from .decode import DecodeEngine, TransferStats
from .identity import ModelIdentity, model_identity
from .layout import CacheLayout, Descriptor, LayoutMismatch, Region, TransferPlan, block_runs, plan_transfer
from .prefill import PrefillServer
from .process import PrefillProcess
from .select import open_transport, resolve_transport
from .transport import TransferError, Transport

__all__ = ["AuthError", "CacheLayout", "DecodeEngine", "Descriptor", "LayoutMismatch", "ModelIdentity",
           "PrefillProcess", "PrefillServer", "Region", "TransferError", "TransferPlan", "TransferStats", "Transport",
           "block_runs", "model_identity", "new_secret", "open_transport", "plan_transfer", "resolve_transport"]
