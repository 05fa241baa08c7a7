"""Attention metadata and the MLA / paged attention ops over tuple KV caches."""

from .metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata, build_attention_metadata, pad_decode
from .mla import mla_decode, mla_prefill
from .paged import paged_decode, paged_prefill

__all__ = [
    "AttentionMetadata", "DecodeMetadata", "PrefillMetadata", "build_attention_metadata", "pad_decode",
    "mla_decode", "mla_prefill", "paged_decode", "paged_prefill",
]
