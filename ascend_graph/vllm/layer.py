"""A stand-in attention layer per model layer, so that vLLM's block pool manages our caches.

vLLM sizes, allocates and hands out KV blocks for the ``AttentionLayerBase`` modules it finds
in ``compilation_config.static_forward_context`` (``GPUModelRunner.get_kv_cache_spec``,
``v1/worker/utils.py``: ``allocate_kv_cache``, ``bind_kv_cache_to_layers``). ``TupleCacheLayer``
is such a module whose spec vLLM counts as the same bytes per block that our two tensors take:
for an ``MLACache(kv_c, k_pe)`` an MLA spec of one head of ``kv_lora_rank + qk_rope_head_dim``,
for a ``KVCache(k, v)`` a full-attention spec of ``num_kv_heads`` heads of ``head_size`` (keys
and values). Its backend takes any block size (no kernel-block splitting: vLLM's block table is
ours). Its backend's metadata builder hands the model vLLM's
``CommonAttentionMetadata`` unchanged (block tables, sequence lengths, query starts).

Prototype: the ``GraphRunner`` allocates the tuples itself; vLLM's fused buffer is released
when bound (docs/vllm.md, "Caches"), and the model captures its graphs then (``on_bound``).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from ..kv_cache import CacheSpec, KVCacheSpec, MLACacheSpec


class TupleCacheMetadataBuilder(AttentionMetadataBuilder):
    """Passes vLLM's common metadata through; decodes first (``reorder_batch_threshold = 1``)."""

    reorder_batch_threshold: int | None = 1

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CommonAttentionMetadata:
        return common_attn_metadata


class TupleCacheBackend(AttentionBackend):
    """The backend vLLM sees for our layers: metadata only; attention runs inside ascend_graph's model."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "ASCEND_GRAPH_TUPLE_CACHE"

    @staticmethod
    def get_impl_cls() -> type:
        raise NotImplementedError("ascend_graph's layers compute attention in the model, not in a vLLM impl")

    @staticmethod
    def get_builder_cls() -> type[TupleCacheMetadataBuilder]:
        return TupleCacheMetadataBuilder


class TupleCacheLayer(nn.Module, AttentionLayerBase):
    """Registered under ``name`` in vLLM's forward context; records how many blocks vLLM allocated."""

    def __init__(self, vllm_config: VllmConfig, name: str, spec: CacheSpec) -> None:
        super().__init__()
        context = vllm_config.compilation_config.static_forward_context
        if name in context:
            raise ValueError(f"duplicate layer name in vLLM's forward context: {name}")
        context[name] = self
        self._context = context  # at bind: does a stock layer (vLLM's MTP drafter's) share vLLM's buffer?
        self.layer_name = name
        self.spec = spec
        self.num_blocks: Optional[int] = None
        self.kv_cache: Any = ()  # never a tensor: vLLM's CPU runner then leaves it alone
        self.kept_bytes = 0  # vLLM's buffer, kept where a stock layer lives in it too
        # Set by the model: returns this layer's cache tuple, the runner's tensors its graphs
        # capture (a KV connector registers those); callable once vLLM has bound the caches.
        self.tuple_cache: Optional[Callable[[], Any]] = None
        # Set by the model: returns its identity for a KV connector's handshake (pd/identity.py).
        self.model_identity: Optional[Callable[[], Any]] = None
        # Set by the model: called after each bind (the model captures once every layer is bound).
        self.on_bound: Optional[Callable[[], None]] = None

    def get_attn_backend(self) -> type[AttentionBackend]:
        return TupleCacheBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> FullAttentionSpec:
        if isinstance(self.spec, KVCacheSpec):  # k and v: num_kv_heads x head_size each per token
            # each TP rank holds its own kv heads (ascend_graph's Llama splits them evenly)
            shards = vllm_config.parallel_config.tensor_parallel_size
            return FullAttentionSpec(block_size=vllm_config.cache_config.block_size, max_tp_shards=shards,
                                     num_kv_heads=self.spec.num_kv_heads, head_size=self.spec.head_size,
                                     dtype=self.spec.dtype)
        if not isinstance(self.spec, MLACacheSpec):
            raise TypeError(f"spec must be an MLACacheSpec or KVCacheSpec, got {type(self.spec).__name__}")
        return MLAAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=1, max_tp_shards=1,
                                head_size=self.spec.kv_lora_rank + self.spec.qk_rope_head_dim,
                                dtype=self.spec.dtype, cache_dtype_str="auto")

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Take the block count of vLLM's view, then release vLLM's buffer (our runner holds the
        caches), unless a stock attention layer's cache lives in it too (vLLM's MTP drafter's:
        vLLM places every layer in one allocation): then it is kept, its size in ``kept_bytes``.
        Then ``on_bound`` (where the model set it)."""
        self.num_blocks = int(kv_cache.shape[0])
        stock = any(isinstance(layer, AttentionLayerBase) and not isinstance(layer, TupleCacheLayer)
                    for layer in self._context.values())
        storage = kv_cache.untyped_storage()
        if stock:
            self.kept_bytes = storage.nbytes()
        elif storage.nbytes():
            storage.resize_(0)
        self.kv_cache = ()
        if self.on_bound is not None:
            self.on_bound()
