"""Attention over tuple KV caches: metadata, the backend interface and its implementations."""

from .backend import ATTENTION_BACKENDS, choose_block_size, model_attention_backends, select_attention_backend
from .base import AttentionBackend, MLABackend, PagedBackend
from .metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata, build_attention_metadata, pad_decode
from .mla import mla_decode, mla_prefill
from .paged import paged_decode, paged_prefill

__all__ = [
    "ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "DecodeMetadata", "MLABackend", "PagedBackend",
    "PrefillMetadata", "build_attention_metadata", "choose_block_size", "model_attention_backends", "mla_decode", "mla_prefill", "pad_decode", "paged_decode",
    "paged_prefill", "select_attention_backend",
]
