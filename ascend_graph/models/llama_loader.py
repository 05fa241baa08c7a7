"""Load a transformers ``LlamaForCausalLM`` checkpoint's tensors into ``models.llama.LlamaForCausalLM``.

The checkpoint names are transformers': ``model.embed_tokens.weight``,
``model.layers.N.self_attn.{q,k,v,o}_proj.weight``, ``model.layers.N.mlp.{gate,up,down}_proj.weight``,
``model.layers.N.{input,post_attention}_layernorm.weight``, ``model.norm.weight`` and
``lm_head.weight``; the model keeps the same tensors without the ``model.`` prefix. With
``tie_word_embeddings`` the head is the embedding (a checkpoint's ``lm_head.weight`` is then
skipped, as transformers skips it). ``rotary_emb.inv_freq`` buffers, which older checkpoints
carry, are recomputed and skipped. Anything else is an error naming the tensor.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

from .llama import LlamaForCausalLM
from .loader import CheckpointError, raise_on_mismatch

PREFIX = "model."


def checkpoint_names(model: LlamaForCausalLM) -> dict[str, str]:
    """Each checkpoint tensor name the model needs -> its own state-dict name."""
    out = {}
    for name in model.state_dict():
        if name == "lm_head.weight":
            if not model.config.tie_word_embeddings:
                out[name] = name
            continue
        out[PREFIX + name] = name
    return out


def _skipped(name: str, model: LlamaForCausalLM) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.config.tie_word_embeddings)


def load_llama_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Copy ``(checkpoint name, tensor)`` pairs into ``model`` (cast to its dtype); a
    tensor-parallel model (``tp``) takes its share of each full tensor (``model.tp_shard``).

    ``CheckpointError`` naming the tensor that is misshapen, unexpected (another layer count or
    architecture, a bias) or missing once the stream ends.
    """
    names, state = checkpoint_names(model), model.state_dict()
    filled, unexpected = set(), []
    for name, tensor in weights:
        if _skipped(name, model):
            continue
        if name not in names:
            unexpected.append(name)
            continue
        target = state[names[name]]
        tensor = model.tp_shard(names[name], tensor)  # a tensor-parallel rank keeps its share
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"tensor {name} has shape {list(tensor.shape)}, the model expects "
                                  f"{list(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        filled.add(name)
    raise_on_mismatch([n for n in names if n not in filled], unexpected, what="Llama checkpoint")
