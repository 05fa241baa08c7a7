"""DeepSeek V2/V3 decoder over per-layer ``MLACache(kv_c, k_pe)`` tuple caches.

Shape legend: T tokens in the step (decode rows first, then prefill tokens), E hidden size,
H heads, Dn qk_nope_head_dim, R qk_rope_head_dim, Dv v_head_dim, C kv_lora_rank,
Q q_lora_rank, V vocabulary.

Weights keep the checkpoint's names, shapes and order: ``state_dict()`` holds exactly the tensors
transformers' own model holds (routed experts stacked per layer as transformers 5 holds them:
``mlp.experts.gate_up_proj [X, 2I, E]``, ``mlp.experts.down_proj [X, E, I]``; ``loader.py`` maps
the per-expert tensors of published checkpoints onto them). ``kv_b_proj.weight`` is the
checkpoint's ``[H*(Dn + Dv), C]``, each head's ``W_UK`` rows then its ``W_UV`` rows.

Derived forms are built once by ``process_weights_after_loading()`` (the loader and random init
call it; call it again after changing weights in place or replacing them) and are never saved:
- ``MLAttention.w_uk_t [H, C, Dn]`` and ``w_uv [H, Dv, C]``, contiguous non-persistent buffers
  (``kv_b_parts``): the batched matmuls of absorbed attention read them in place and both
  products reduce along contiguous memory (sliced per head from the checkpoint layout, bfloat16
  ``bmm`` copies its operand on every call). They cost one more copy of ``kv_b_proj``: 4 MiB per
  layer in bfloat16 at V2-Lite's dims, 32 MiB at V3's. ``.to()`` casts and moves them with the
  weights.
- On CPU a linear with more than ``runtime.LONG_REDUCTION`` input features (V2-Lite's dense down
  projection, most of V3's linears and its ``lm_head``) is a ``layers.ChunkedLinear``, whose
  weight is re-laid out chunk-major in place of itself (one copy; its state dict still shows the
  checkpoint's ``[N, K]``).
The model never chooses graph or eager: the runner compiles ``forward`` or not.

Multi-token-prediction layers (``mtp_layers`` of V3's ``num_nextn_predict_layers``; none unless
asked for) are ``mtp.{i}`` (``mtp.py``), each with one more cache after the target's layers
(``kv_cache_specs``); ``forward`` leaves it alone, ``mtp_predict`` runs it.

Tensor parallel (``tp``, a group of ``distributed``), as vLLM shards DeepSeek: ``q_a_proj``,
``kv_a_proj_with_mqa`` and their norms replicated; ``q_proj`` / ``q_b_proj`` and ``kv_b_proj``
split by head (so ``w_uk_t`` / ``w_uv`` are this rank's heads'); ``o_proj`` by input columns, then
all-reduced; the latent cache whole on every rank (one latent head); dense MLP and MoE as
``moe.layer`` says; embedding, router and head replicated (``TP_SPLIT``, ``tp_shard``).

Data parallel (``dp``) replicates the whole model: attention runs each rank's own rows. Expert
parallel (``ep``, every rank) gives each rank a range of the routed experts, whole
(``moe.layer``); the model tells the MoE which rows are padding (a decode row of context length
0, as ``DECODE_PADDING`` pads a captured batch), so that no expert computes them.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from ..attention import AttentionMetadata
from ..distributed import Group
from ..kv_cache import MLACache, MLACacheSpec
from ..layers import linear
from ..moe.layer import expert_range
from .deepseek_config import DeepseekConfig
from .deepseek_layers import DecoderLayer, MLAttention, _earlier_kv_b_order, kv_b_parts  # noqa: F401 (public here)
from .mtp import MTPLayer, check_mtp_layers
from .rope import RotaryEmbedding
from .selection import ChoosesBackends
from .tensor_parallel import shard_index, split_dim
from ..layers import RMSNorm

# how a tensor-parallel rank splits each linear's checkpoint weight: by output rows (0: per head,
# per intermediate feature) or by input columns (1, its output all-reduced); routed experts'
# stacked tensors are split along I (``_EXPERT_SPLIT``); anything else is replicated
TP_SPLIT = {"q_proj": 0, "q_b_proj": 0, "kv_b_proj": 0, "o_proj": 1, "gate_proj": 0, "up_proj": 0,
            "down_proj": 1}
_EXPERT_SPLIT = {"experts.gate_up_proj": 1, "experts.down_proj": 2}  # [X, 2I, E] (two halves), [X, E, I]
# routed experts' tensors, stacked or per expert (group 1: the expert's index); under expert
# parallel a rank keeps whole experts of its range instead
_ROUTED = re.compile(r"\.mlp\.experts\.(?:(\d+)\.(?:gate|up|down)_proj\.weight|gate_up_proj|down_proj)$")


def _tp_split(name: str) -> tuple[Optional[int], int]:
    """``(dim, parts)``: the dim along which checkpoint tensor ``name`` is split (None:
    replicated) and into how many separately split parts (2: a stacked gate/up)."""
    for leaf, dim in _EXPERT_SPLIT.items():
        if name.endswith(leaf):
            return dim, 2 if leaf.endswith("gate_up_proj") else 1
    return split_dim(name, TP_SPLIT), 1


class DeepseekModel(nn.Module):
    """Embedding, decoder layers and the final norm (``model.*`` in the checkpoint)."""

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype, device=None, tp: Group = Group.single(),
                 dp: Group = Group.single(), ep: Group = Group.single()) -> None:
        super().__init__()
        self.ep = ep
        self.embed_tokens = nn.utils.skip_init(nn.Embedding, config.vocab_size, config.hidden_size, dtype=dtype,
                                               device=torch.get_default_device() if device is None else device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device, tp, dp, ep)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config, device)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: tuple[MLACache, ...],
                attn_metadata: AttentionMetadata) -> Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, the model has {len(self.layers)}")
        x = self.embed_tokens(input_ids)  # [T, E]
        cos, sin = self.rotary_emb(positions)  # [T, R/2] each, shared by all layers
        valid = valid_rows(attn_metadata, x.shape[0]) if self.ep.size > 1 else None  # EP: padding skips experts
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, cache, attn_metadata, valid)
        return self.norm(x)


def valid_rows(meta: AttentionMetadata, tokens: int) -> Tensor:
    """``[T]`` bool: False for a padding row (a decode row of context length 0, ``DECODE_PADDING``);
    prefill tokens are always real."""
    if meta.decode is None:
        return torch.ones(tokens, dtype=torch.bool, device=meta.slot_mapping.device)
    decode = meta.decode.context_lens > 0  # [B]
    if meta.prefill is None:
        return decode
    return torch.cat([decode, decode.new_ones(tokens - decode.shape[0])])


class DeepseekForCausalLM(ChoosesBackends, nn.Module):
    """DeepSeek V2/V3 for decoding with tuple MLA caches.

    Attention and MoE run the backends chosen for the weights (``select_backends``, ``backends``).

    ``forward`` returns the final-normed hidden states; ``compute_logits`` applies ``lm_head``
    (so a runner can pick the rows it needs before the vocabulary projection). Weights are created
    in ``dtype`` on ``device`` in the checkpoint's form; with ``init_weights`` they are
    seeded-random (``init_random_weights_``), otherwise left for a loader to fill, which then calls
    ``process_weights_after_loading()`` (the model does not run before it).

    With ``tp``, ``dp``, ``ep`` (``get_parallel_state()``'s groups) the model is this rank's share
    (module docstring; ``parallel_layout()``); ``tp_shard`` cuts a full checkpoint tensor to it.
    Seeded random weights of a share are not the unsharded model's share: cut those from the full
    model's tensors.
    """

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, init_weights: bool = True, seed: int = 0,
                 tp: Group = Group.single(), dp: Group = Group.single(), ep: Group = Group.single(),
                 mtp_layers: int = 0) -> None:
        super().__init__()
        check_mtp_layers(mtp_layers, config)
        self.config, self.tp, self.dp, self.ep = config, tp, dp, ep
        # the routed experts this rank holds (checked before anything is built)
        self.expert_range = expert_range(config.n_routed_experts or 0, ep)
        self.model = DeepseekModel(config, dtype, device, tp, dp, ep)
        self.lm_head = linear(config.hidden_size, config.vocab_size, dtype, device,
                              chunked=not config.tie_word_embeddings)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # after every target tensor: a seed draws the same target weights with or without them
        self.mtp = nn.ModuleList(MTPLayer(config, i, dtype, device, tp, dp, ep) for i in range(mtp_layers))
        self.drafting = 0  # draft tokens per step: step_logits adds the MTP layer's draft (``speculative``)
        self.returns_hidden = False  # step_logits adds the hidden states (vLLM's MTP drafter reads them)
        if init_weights:
            self.init_random_weights_(seed)

    @property
    def embed_tokens(self) -> nn.Module:
        """The target's embedding (vLLM's drafters look for ``model.embed_tokens`` on the model they serve)."""
        return self.model.embed_tokens

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (routing and rope frequencies stay float32 regardless)."""
        return self.model.embed_tokens.weight.dtype

    def attention_layers(self):
        """Every layer's attention, one per cache: the target's layers, then the MTP layers'."""
        return (layer.self_attn for layer in (*self.model.layers, *self.mtp))

    def parallel_layout(self) -> dict:
        """This rank's place: the TP, DP and EP sizes and ranks, and its routed experts ``[start, stop)``."""
        out = {f"{name}_{what}": getattr(getattr(self, name), what) for name in ("tp", "dp", "ep")
               for what in ("size", "rank")}
        return out | {"experts": [self.expert_range.start, self.expert_range.stop]}

    def extra_repr(self) -> str:
        r = self.expert_range
        return f"tp={self.tp.size}, dp={self.dp.size}, ep={self.ep.size}, experts=[{r.start}, {r.stop})"

    def kv_cache_specs(self) -> list[MLACacheSpec]:
        """One ``MLACacheSpec`` per layer, in the model's dtype: the target's, then the MTP layers'."""
        spec = MLACacheSpec(self.config.kv_lora_rank, self.config.qk_rope_head_dim, self.dtype)
        return [spec] * (self.config.num_hidden_layers + len(self.mtp))

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: tuple[MLACache, ...],
                attn_metadata: AttentionMetadata) -> Tensor:
        """``input_ids [T]``, ``positions [T]`` (int64) -> final-normed hidden states ``[T, E]``.

        Tokens are ordered as ``attn_metadata`` says: decode rows first, then prefill sequences.
        Each layer writes its new ``kv_c``/``k_pe`` into ``kv_caches[layer]`` in place; the MTP
        layers' caches (after the target's) are left alone.
        """
        n = self.config.num_hidden_layers
        return self.model(input_ids, positions, kv_caches[:n] if len(kv_caches) == n + len(self.mtp) else kv_caches,
                          attn_metadata)

    def mtp_predict(self, input_ids: Tensor, positions: Tensor, hidden: Tensor, kv_caches: tuple[MLACache, ...],
                    attn_metadata: AttentionMetadata, layer: int = 0) -> Tensor:
        """MTP layer ``layer`` over a step (``mtp.MTPLayer.predict``): row r's token after position
        ``positions[r]`` and that position's hidden state ``hidden [T, E]`` (``forward``'s, or the
        previous draft step's) -> ``[T, E]`` for ``compute_mtp_logits`` and the next draft step.
        Writes the rows into the layer's cache (``kv_caches[num_hidden_layers + layer]``)."""
        if not 0 <= layer < len(self.mtp):
            raise ValueError(f"layer must be in [0, {len(self.mtp)}) (the model's MTP layers), got {layer}")
        if len(kv_caches) != self.config.num_hidden_layers + len(self.mtp):
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, expected the target's "
                             f"{self.config.num_hidden_layers} + {len(self.mtp)} MTP")
        cos, sin = self.model.rotary_emb(positions)
        valid = valid_rows(attn_metadata, input_ids.shape[0]) if self.ep.size > 1 else None
        return self.mtp[layer].predict(self.model.embed_tokens(input_ids), positions, hidden, cos, sin,
                                       kv_caches[self.config.num_hidden_layers + layer], attn_metadata, valid)

    def step_logits(self, hidden: Tensor, rows: Optional[Tensor], input_ids: Tensor, positions: Tensor,
                    kv_caches: tuple[MLACache, ...], attn_metadata: AttentionMetadata) -> Tensor:
        """What a runner's step returns from ``forward``'s ``hidden [T, E]`` at ``rows [n]`` (each
        sequence's last token; None: every row): the logits ``[n, V]``. With ``drafting`` (the
        draft tokens per step, 0: off) also the first MTP layer's draft logits beside them,
        ``[n, 2V]``, and with ``drafting > 1`` its output hidden states as float32 columns after
        those, ``[n, 2V + E]`` (a draft chain's first input, ``draft_step``). Drafting runs the MTP
        layer over every row, each with the token after it: the step's next input token within a
        prefill, the target's greedy choice at ``rows`` (a verify row's next token, as accepted).
        With ``returns_hidden`` instead: the logits and ``hidden`` at ``rows`` as float32 columns,
        ``[n, V + E]`` (inside vLLM, for its own MTP drafter)."""
        last = hidden if rows is None else hidden[rows]
        logits = self.compute_logits(last)
        if not self.drafting:
            return torch.cat([logits, last.float()], dim=-1) if self.returns_hidden else logits
        after = input_ids.roll(-1)  # within a prefill: the next prompt token
        after = after.index_put((rows,), logits.argmax(-1)) if rows is not None else logits.argmax(-1)
        draft, out = self.mtp_draft(after, positions, hidden, kv_caches, attn_metadata, rows)
        return torch.cat([logits, draft, out.float()] if self.drafting > 1 else [logits, draft], dim=-1)

    def mtp_draft(self, after: Tensor, positions: Tensor, hidden: Tensor, kv_caches: tuple[MLACache, ...],
                  attn_metadata: AttentionMetadata, rows: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """The first MTP layer over a step's rows (``mtp_predict``; it writes them into its cache)
        -> its draft logits ``[n, V]`` and output hidden states ``[n, E]`` at ``rows`` (None: all)."""
        out = self.mtp_predict(after, positions, hidden, kv_caches, attn_metadata)
        out = out if rows is None else out[rows]
        return self.compute_mtp_logits(out), out

    def draft_step(self, input_ids: Tensor, positions: Tensor, hidden: Tensor, kv_caches: tuple[MLACache, ...],
                   attn_metadata: AttentionMetadata) -> Tensor:
        """One step of a draft chain: row r drafts again from its previous draft ``input_ids[r]``
        (the token after ``positions[r]``) and the MTP output that drafted it, ``hidden [n, E]``
        float32 (``step_logits``' columns, or the previous ``draft_step``'s) -> ``[n, V + E]``:
        the next draft's logits, then this step's output hidden states as float32."""
        draft, out = self.mtp_draft(input_ids, positions, hidden.to(self.dtype), kv_caches, attn_metadata)
        return torch.cat([draft, out.float()], dim=-1)

    def compute_mtp_logits(self, hidden: Tensor, layer: int = 0) -> Tensor:
        """``hidden [T, E]`` (from ``mtp_predict``) -> float32 logits ``[T, V]``: the target's
        ``lm_head``, which the MTP layers share (``mtp.py``); ``layer`` names the MTP layer."""
        return self.compute_logits(hidden)

    def tp_shard(self, name: str, tensor: Tensor) -> Tensor:
        """This rank's share of the full checkpoint tensor ``name`` (``tp_read``): a view, but for
        a routed experts' ``gate_up_proj`` and a zeroed ``o_proj.bias``."""
        if self.tp.size == 1 and self.ep.size == 1:
            return tensor
        return self.tp_read(name, tensor.shape, tensor.__getitem__)

    def tp_read(self, name: str, shape: Sequence[int], read: Callable[[tuple], Tensor]) -> Tensor:
        """This rank's share of checkpoint tensor ``name`` (a state-dict name, or a per-expert
        ``...experts.X.{gate,up,down}_proj.weight``) of full ``shape``, from ``read(index)`` of the
        pieces it needs (a safetensors slice reads no more). A routed experts' ``gate_up_proj``
        is cut half by half (gate rows, then up rows); ``o_proj.bias`` is replicated but added
        once: zeros beyond rank 0, as vLLM's row-parallel linear adds it on rank 0 only. Under
        expert parallel a routed expert is whole: a stacked tensor's rows of ``expert_range``,
        a per-expert tensor (of this rank's range: the loader reads no other) as it is."""
        routed = _ROUTED.search(name) if self.ep.size > 1 else None
        if routed:
            r = self.expert_range
            return read((slice(None),) if routed.group(1) else (slice(r.start, r.stop),))
        dim, parts = _tp_split(name)
        pieces = [read(index) for index in shard_index(shape, dim, self.tp, name, parts)]
        share = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
        if name.endswith("self_attn.o_proj.bias") and self.tp.rank > 0:
            return torch.zeros_like(share)
        return share

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """``hidden [T, E]`` (from ``forward``) -> float32 logits ``[T, V]``."""
        return self.lm_head(hidden).float()

    def process_weights_after_loading(self) -> None:
        """Build every layer's derived weight forms from the checkpoint tensors (see the module
        docstring); call it after filling or replacing weights (``load_state_dict`` calls it)."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()

    @torch.no_grad()
    def init_random_weights_(self, seed: int = 0, std: float | None = None) -> None:
        """Seeded random weights (drawn on the CPU, so equal on every device), then their derived
        forms: matrices ``normal(0, std or config.initializer_range)``, biases zero, norm weights
        one. Each matrix is drawn in its element order, ``kv_b_proj`` in the order earlier versions
        stored it (``_earlier_kv_b_order``), so a seed gives the same model as it always did."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range if std is None else std
        c = self.config
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                draw = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                if name.endswith("self_attn.kv_b_proj.weight"):
                    draw = _earlier_kv_b_order(draw, c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim)
                p.copy_(draw)
            else:
                p.fill_(0.0 if name.endswith(".bias") else 1.0)
        self.process_weights_after_loading()
