"""Models over tuple KV caches: DeepSeek V2/V3 (MLA) and HF checkpoint loading."""

from .deepseek import DeepseekForCausalLM
from .deepseek_config import DeepseekConfig, QuantizationConfig, RopeScaling
from .loader import load_deepseek
from .rope import softmax_scale

__all__ = ["DeepseekConfig", "DeepseekForCausalLM", "QuantizationConfig", "RopeScaling", "load_deepseek",
           "softmax_scale"]
