"""Models over tuple KV caches: DeepSeek V2/V3 (MLA) with HF checkpoint loading; a small Llama (GQA)."""

from .deepseek import DeepseekForCausalLM
from .deepseek_config import DeepseekConfig, QuantizationConfig, RopeScaling
from .llama import LlamaConfig, LlamaForCausalLM
from .loader import checkpoint_tensors, load_deepseek
from .named import BUILTIN_MODELS, named_model
from .rope import softmax_scale

__all__ = ["BUILTIN_MODELS", "DeepseekConfig", "DeepseekForCausalLM", "LlamaConfig", "LlamaForCausalLM", "QuantizationConfig", "RopeScaling",
           "checkpoint_tensors", "load_deepseek", "named_model", "softmax_scale"]
