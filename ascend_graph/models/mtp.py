"""DeepSeek V3's multi-token-prediction (MTP) layers, stored in the checkpoint as
``model.layers.{num_hidden_layers + i}`` (``num_nextn_predict_layers`` of them) and held by the
model as ``mtp.{i}`` (``checkpoint_name`` / ``state_name`` map one to the other).

One MTP layer is a decoder block with its own MLA cache, ``enorm``, ``hnorm``, ``eh_proj`` and
``shared_head.norm``. Its embedding and vocabulary projection are the target's: as vLLM does
(``_maybe_share_embeddings`` / ``_maybe_share_lm_head`` for MTP drafts), the checkpoint's copies
(``embed_tokens``, ``shared_head.head``, identical in DeepSeek-V3's release) are not loaded.
Row r of an MTP step holds a position p, the token after it ``t`` and a hidden state ``h`` of
position p: the target model's final-normed hidden state, or, for a later draft step, the
previous MTP step's output. As vLLM's ``DeepSeekMultiTokenPredictorLayer`` computes it:

    x = eh_proj(cat(enorm(embed(t)) [zero where p == 0], hnorm(h)))
    out = shared_head.norm(block(x))      # recycled as the next draft step's h
    logits = lm_head(out)
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import Tensor, nn

from ..attention import AttentionMetadata
from ..distributed import Group
from ..kv_cache import MLACache
from ..layers import RMSNorm, linear
from .deepseek_config import DeepseekConfig
from .deepseek_layers import DecoderLayer

_MTP = re.compile(r"^mtp\.(\d+)\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # an MTP layer's copies of the target's tensors


def checkpoint_name(name: str, config: DeepseekConfig) -> str:
    """The checkpoint's name of model tensor ``name`` (``mtp.{i}.`` -> ``model.layers.{N + i}.``)."""
    m = _MTP.match(name)
    return name if m is None else f"model.layers.{config.num_hidden_layers + int(m.group(1))}.{name[m.end():]}"


def state_name(name: str, config: DeepseekConfig, mtp_layers: int) -> Optional[str]:
    """The model tensor that checkpoint tensor ``name`` fills: an MTP layer's under ``mtp.{i}.``,
    None for an MTP layer the model does not hold (``i >= mtp_layers``) and for its copies of the
    target's embedding and head (``SHARED``); other names unchanged."""
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) < config.num_hidden_layers:
        return name
    i, rest = int(m.group(1)) - config.num_hidden_layers, name[m.end():]
    return f"mtp.{i}.{rest}" if i < mtp_layers and rest not in SHARED else None


def check_mtp_layers(mtp_layers: int, config: DeepseekConfig) -> None:
    """``mtp_layers`` must be within ``0 .. num_nextn_predict_layers``."""
    if not isinstance(mtp_layers, int) or not 0 <= mtp_layers <= config.num_nextn_predict_layers:
        raise ValueError(f"mtp_layers must be an int in [0, num_nextn_predict_layers="
                         f"{config.num_nextn_predict_layers}], got {mtp_layers!r}")


class SharedHead(nn.Module):
    """``shared_head.norm`` (its ``head`` is the target's ``lm_head``)."""

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class MTPLayer(DecoderLayer):
    """MTP layer ``index`` (checkpoint layer ``num_hidden_layers + index``): the decoder block's
    modules under their checkpoint names, plus ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head.norm``; the block runs over the layer's own cache."""

    def __init__(self, config: DeepseekConfig, index: int, dtype: torch.dtype, device=None,
                 tp: Group = Group.single(), dp: Group = Group.single(), ep: Group = Group.single()) -> None:
        super().__init__(config, config.num_hidden_layers + index, dtype, device, tp, dp, ep)
        e = config.hidden_size
        self.enorm = RMSNorm(e, config.rms_norm_eps, dtype, device)
        self.hnorm = RMSNorm(e, config.rms_norm_eps, dtype, device)
        self.eh_proj = linear(2 * e, e, dtype, device)
        self.shared_head = SharedHead(config, dtype, device)

    def predict(self, embeds: Tensor, positions: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor,
                cache: MLACache, meta: AttentionMetadata, valid: Optional[Tensor] = None) -> Tensor:
        """Rows of (the token after's embedding ``[T, E]``, position, hidden ``[T, E]``) ->
        ``shared_head.norm`` of the block's output ``[T, E]`` (the target's ``lm_head`` projects
        it); writes the rows into ``cache``."""
        embeds = torch.where(positions.unsqueeze(-1) == 0, torch.zeros_like(embeds), embeds)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(self.forward(x, cos, sin, cache, meta, valid))
