"""What two PD peers must share beyond cache geometry: the model, and how each layer stores its cache.

Equal block shapes do not make two caches interchangeable: a different checkpoint with the same
shapes, or an NPU node whose fused write stores ``k_pe`` de-interleaved (docs/npu.md) against a
CPU node storing it as the checkpoint does, would decode garbage without an error. So each side
sends a ``ModelIdentity`` in its handshake (inside its ``CacheLayout``, ``pd/layout.py``):

- per attention layer: the backend's kind (``mla`` / ``paged``), its cache family
  (``AttentionBackend.cache_family``: ``torch`` / ``npu``, which implementations store the same
  bytes) and how ``k_pe`` lies in the cache (``layer.cached_rope_layout``: ``interleaved`` /
  ``half`` / ``deinterleaved``; paged layers have no ``k_pe``: ``NO_K_PE``);
- the model config's digest (SHA-256 of its fields as sorted JSON);
- digests of a few weights that keep their checkpoint form (the embedding, the final norm, the
  LM head): SHA-256 of the dtype, the shape and a bounded sample (at most ``SAMPLE_ROWS`` rows,
  evenly spaced and including the first and last, of at most ``SAMPLE_ELEMENTS`` elements in
  all), so a V3-sized embedding digests in milliseconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

NO_K_PE = "none (paged: no k_pe)"
WEIGHT_NAMES = ("embed_tokens.weight", "norm.weight", "lm_head.weight")  # after a leading "model."
SAMPLE_ROWS = 64
SAMPLE_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class LayerAttention:
    """How one layer's attention stores its cache."""

    layer: int
    kind: str  # "mla" or "paged"
    family: str  # AttentionBackend.cache_family
    rope_layout: str  # of k_pe in the cache, or NO_K_PE


@dataclass(frozen=True)
class ModelIdentity:
    """A model's identity for a PD handshake (see the module docstring)."""

    config: str
    weights: tuple[tuple[str, str], ...]  # (parameter name, digest)
    attention: tuple[LayerAttention, ...]

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return {"config": self.config, "weights": [list(w) for w in self.weights],
                "attention": [dataclasses.asdict(a) for a in self.attention]}

    @classmethod
    def from_dict(cls, data: Any) -> "ModelIdentity":
        """Strict: exactly the keys ``to_dict`` writes, of the right types; ``ValueError`` naming what is wrong."""
        _keys(data, ("config", "weights", "attention"), "identity")
        if not isinstance(data["config"], str):
            raise ValueError("identity.config must be a string")
        weights = data["weights"]
        if not (isinstance(weights, list) and all(isinstance(w, list) and len(w) == 2 and
                                                  all(isinstance(x, str) for x in w) for w in weights)):
            raise ValueError("identity.weights must be a list of [name, digest] string pairs")
        if not isinstance(data["attention"], list):
            raise ValueError("identity.attention must be a list")
        layers = []
        for i, a in enumerate(data["attention"]):
            _keys(a, ("layer", "kind", "family", "rope_layout"), f"identity.attention[{i}]")
            if not (isinstance(a["layer"], int) and not isinstance(a["layer"], bool)
                    and all(isinstance(a[k], str) for k in ("kind", "family", "rope_layout"))):
                raise ValueError(f"identity.attention[{i}]: layer must be an int, the rest strings")
            layers.append(LayerAttention(**a))
        return cls(data["config"], tuple((n, d) for n, d in weights), tuple(layers))

    def difference(self, peer: "ModelIdentity", peer_name: str) -> Optional[str]:
        """The first difference from ``peer``'s identity, in words, or None."""
        if len(self.attention) != len(peer.attention):
            return (f"attention layer count differs: {len(self.attention)} here, {len(peer.attention)} on the "
                    f"{peer_name}")
        for mine, theirs in zip(self.attention, peer.attention):
            for key, words in (("kind", "attention kind"), ("rope_layout", "k_pe rope layout"),
                               ("family", "attention backend family")):
                a, b = getattr(mine, key), getattr(theirs, key)
                if a != b:
                    return f"layer {mine.layer} {words} differs: {a} here, {b} on the {peer_name}"
        if self.config != peer.config:
            return (f"model config differs: digest {self.config[:12]} here, {peer.config[:12]} on the {peer_name} "
                    "(another model, or other settings)")
        mine, theirs = dict(self.weights), dict(peer.weights)
        if sorted(mine) != sorted(theirs):
            return f"model weights sampled differ: {sorted(mine)} here, {sorted(theirs)} on the {peer_name}"
        for name in sorted(mine):
            if mine[name] != theirs[name]:
                return (f"model weights differ: {name} digest {mine[name][:12]} here, {theirs[name][:12]} on the "
                        f"{peer_name} (another checkpoint)")
        return None


def _keys(data: Any, keys: tuple[str, ...], what: str) -> None:
    if not isinstance(data, dict) or sorted(data) != sorted(keys):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{what} must be an object of exactly {', '.join(keys)}; got {got}")


def model_identity(model: nn.Module) -> ModelIdentity:
    """The identity of ``model``: its attention layers' cache layout, its config, a few weights.

    ``model`` has ``config`` (a dataclass, or an object with ``to_dict``), ``attention_layers()``
    whose layers have a ``backend`` (and, for MLA, ``cached_rope_layout``), and parameters named
    ``[model.]embed_tokens.weight`` / ``norm.weight`` / ``lm_head.weight`` (at least one)."""
    layers = []
    for i, layer in enumerate(model.attention_layers()):
        backend = layer.backend
        rope = layer.cached_rope_layout if backend.kind == "mla" else NO_K_PE
        layers.append(LayerAttention(i, backend.kind, backend.cache_family, rope))
    params = {name.removeprefix("model."): p for name, p in model.named_parameters(remove_duplicate=False)}
    weights = tuple((name, weight_digest(params[name])) for name in WEIGHT_NAMES if name in params)
    if not weights:
        raise ValueError(f"{type(model).__name__} has none of the weights a model identity digests "
                         f"({', '.join(WEIGHT_NAMES)})")
    return ModelIdentity(config_digest(model.config), weights, tuple(layers))


def config_digest(config: Any) -> str:
    """SHA-256 of a config's fields as sorted JSON (a dataclass, or an object with ``to_dict``)."""
    if dataclasses.is_dataclass(config):
        fields = dataclasses.asdict(config)
    elif hasattr(config, "to_dict"):
        fields = config.to_dict()
    else:
        raise TypeError(f"a model identity needs a dataclass config or one with to_dict(), got "
                        f"{type(config).__name__}")
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


@torch.no_grad()
def weight_digest(t: torch.Tensor) -> str:
    """SHA-256 of ``t``'s dtype, shape and a bounded sample of its values (module docstring)."""
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.is_meta or t.numel() == 0:
        return h.hexdigest()
    flat = t.reshape(-1) if t.dim() == 1 else t
    rows = min(flat.shape[0], SAMPLE_ROWS if t.dim() > 1 else SAMPLE_ELEMENTS)
    index = torch.linspace(0, flat.shape[0] - 1, rows, device=t.device).round().long()
    sample = flat.index_select(0, index).reshape(rows, -1)[:, :max(1, SAMPLE_ELEMENTS // rows)]
    h.update(sample.to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
