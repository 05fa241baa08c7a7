"""Load a DeepSeek V2/V3 HF checkpoint directory (``config.json`` + safetensors) into the model.

Tensors are found by their HF names, in ``model.safetensors`` or in the shards listed by
``model.safetensors.index.json``, and copied into the model's tensors of the same names, shapes
and order. This module is the one place where names are mapped, for routed experts only: they
come either per expert (``model.layers.N.mlp.experts.X.{gate,up,down}_proj.weight``, as published
checkpoints and ``save_pretrained`` write them) or already stacked (``mlp.experts.gate_up_proj
[X, 2I, E]``, ``mlp.experts.down_proj [X, E, I]``), and both fill the model's stacked tensors,
whose names and shapes are transformers 5's own (``DeepseekV3Experts``); ``checkpoint_tensors``
maps back. Block-scaled FP8 weights (``float8_e4m3fn`` plus ``weight_scale_inv`` of
``[ceil(out / 128), ceil(in / 128)]``, DeepSeek-V3's release format) are dequantized here.
Multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``) fill the model's
``mtp.{i}`` (``mtp.py``) where the model holds them (``mtp_layers``), and are skipped otherwise.
Once every tensor is filled, ``model.process_weights_after_loading()`` builds the derived forms.

Everything is planned and checked (names, shapes, dtypes) from the file headers before any data
is read, so a bad checkpoint fails fast with an error naming the tensor.

A tensor-parallel model (``tp``) takes its share of each checkpoint tensor
(``DeepseekForCausalLM.tp_read``): shapes are checked as shares, and only the share's rows or
columns are read from the file (safetensors slices); FP8 weights are read whole, dequantized, then cut.
Under expert parallel (``ep``) a rank reads only the routed experts of its range: per-expert
tensors of other experts are neither read nor expected, stacked ones are read by their rows.
"""

from __future__ import annotations

import json
import os
import re
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..distributed import Group
from ..runtime import weights_on_huge_pages
from .deepseek import DeepseekForCausalLM
from . import mtp
from .deepseek_config import DeepseekConfig

_EXPERT = re.compile(r"^((?:model\.layers|mtp)\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """The checkpoint does not match the model its config describes."""


class _Target(NamedTuple):
    """Where one checkpoint tensor goes: a model tensor, or one expert's slice of a stacked one."""

    name: str  # model state-dict name
    expert: Optional[int] = None
    part: Optional[str] = None  # "gate" | "up" | "down" for per-expert tensors


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError as e:  # optional dependency
        raise ImportError("loading checkpoints needs the 'safetensors' package: "
                          "pip install safetensors (or pip install 'ascend-graph[hf]')") from e
    return safe_open


def checkpoint_files(path: str | os.PathLike) -> dict[str, str]:
    """Map every tensor name of the checkpoint in directory ``path`` to its safetensors file."""
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    if os.path.isfile(single):
        with _safe_open()(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise FileNotFoundError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")


def _target(name: str, config: DeepseekConfig, experts: Optional[range] = None,
            mtp_layers: int = 0) -> Optional[_Target]:
    """The model tensor ``name`` fills, or None for a tensor that is skipped on purpose (also a
    routed expert outside ``experts``, this rank's range: default all; an MTP layer the model does
    not hold: it holds ``mtp_layers``)."""
    if name.endswith("_scale_inv"):  # an FP8 weight's scale goes where its weight goes
        weight = name[:-len("_scale_inv")]
        return None if _target(weight, config, experts, mtp_layers) is None else _Target(name)
    name = mtp.state_name(name, config, mtp_layers)
    if name is None:
        return None
    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings):
        return None  # recomputed / shared with the embedding
    expert = _EXPERT.match(name)
    if expert:
        prefix, index, part = expert.groups()
        experts = range(config.n_routed_experts or 0) if experts is None else experts
        if int(index) not in experts:
            return None  # another expert-parallel rank's
        stacked = "down_proj" if part == "down" else "gate_up_proj"
        return _Target(f"{prefix}.{stacked}", int(index) - experts.start, part)
    return _Target(name)


def _piece(model_tensor: Tensor, target: _Target) -> Tensor:
    """The view of ``model_tensor`` that ``target`` writes: all of it, or one expert's part."""
    if target.expert is None:
        return model_tensor
    w = model_tensor[target.expert]
    rows = w.shape[0] // 2
    return {"gate": w[:rows], "up": w[rows:], "down": w}[target.part]


def _expected_names(model: DeepseekForCausalLM) -> dict[str, list[str]]:
    """Checkpoint names that fill each model tensor (by its state-dict name), in the per-expert
    form for stacked experts."""
    config, out = model.config, {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            prefix, parts = name.rsplit(".", 1)[0], ("down",) if name.endswith("down_proj") else ("gate", "up")
            prefix = mtp.checkpoint_name(prefix, config)
            out[name] = [f"{prefix}.{x}.{p}_proj.weight" for x in model.expert_range for p in parts]
        else:
            out[name] = [mtp.checkpoint_name(name, config)]
    return out


class _Plan(NamedTuple):
    """Checked assignments: checkpoint name -> (target, scale name or None)."""

    entries: dict[str, tuple[_Target, Optional[str]]]


def _plan(model: DeepseekForCausalLM, files: dict[str, str]) -> _Plan:
    """Match checkpoint names to model tensors; check shapes and dtypes from the headers."""
    config, state = model.config, model.state_dict()
    headers = _headers(files)
    entries, unexpected, filled = {}, [], set()
    for name in sorted(files):
        if name.endswith("_scale_inv"):
            continue  # consumed with its weight
        target = _target(name, config, model.expert_range, len(model.mtp))
        if target is None:
            continue
        if target.name not in state:
            unexpected.append(name)
            continue
        shape, dtype = headers[name]
        expected = tuple(_piece(state[target.name], target).shape)
        shape = tuple(model.tp_read(name, shape, torch.empty(shape, device="meta").__getitem__).shape)
        if shape != expected:
            raise CheckpointError(f"tensor {name} has shape {list(shape)}, the model expects {list(expected)}")
        entries[name] = (target, _scale_name(name, dtype, files, headers, config))
        filled.add(name)
    _check_scales(files, entries, config, model.expert_range, len(model.mtp))
    _check_complete(model, filled, unexpected)
    return _Plan(entries)


def _headers(files: dict[str, str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor, read from the safetensors headers (no data)."""
    out, safe_open = {}, _safe_open()
    by_file: dict[str, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        if not os.path.isfile(file):
            raise FileNotFoundError(f"checkpoint shard {file} (holding {names[0]}, ...) does not exist")
        with safe_open(file, framework="pt") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"tensor {name} is listed in the index but missing from {file}")
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), _st_dtype(sl.get_dtype(), name))
    return out


def _st_dtype(code: str, name: str) -> torch.dtype:
    table = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
             "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    if code not in table:
        raise CheckpointError(f"tensor {name} has unsupported dtype {code}")
    return table[code]


def _scale_name(name: str, dtype: torch.dtype, files, headers, config: DeepseekConfig) -> Optional[str]:
    """The ``weight_scale_inv`` belonging to an FP8 ``name`` (checked), or None for other dtypes."""
    scale = name + "_scale_inv"
    if dtype not in _FP8:
        if scale in files:
            raise CheckpointError(f"tensor {scale} scales {name}, which is {dtype}, not FP8")
        return None
    if scale not in files:
        raise CheckpointError(f"tensor {name} is FP8 but its block scale {scale} is missing")
    (rows, cols), (bo, bi) = headers[name][0], _block(config)
    expected = (-(-rows // bo), -(-cols // bi))
    if headers[scale][0] != expected:
        raise CheckpointError(f"tensor {scale} has shape {list(headers[scale][0])}, expected {list(expected)} "
                              f"for {name} {[rows, cols]} in {bo}x{bi} blocks")
    return scale


def _block(config: DeepseekConfig) -> tuple[int, int]:
    q = config.quantization_config
    return q.weight_block_size if q is not None else (128, 128)


def _check_scales(files, entries, config: DeepseekConfig, experts: range, mtp_layers: int) -> None:
    used = {scale for _, scale in entries.values() if scale}
    for name in files:
        if name.endswith("_scale_inv") and name not in used and _target(name, config, experts, mtp_layers) is not None:
            raise CheckpointError(f"unexpected tensor {name}: no FP8 weight {name[:-len('_scale_inv')]} uses it")


def _check_complete(model: DeepseekForCausalLM, filled: set[str], unexpected: list[str]) -> None:
    """Raise naming unexpected and missing tensors (up to 10 of each).

    A stacked expert tensor is complete when it came whole or when every expert's part came.
    """
    missing = [n for tensor, names in _expected_names(model).items()
               if mtp.checkpoint_name(tensor, model.config) not in filled for n in names if n not in filled]
    raise_on_mismatch(missing, unexpected)


def raise_on_mismatch(missing: list[str], unexpected: list[str], what: str = "checkpoint") -> None:
    """``CheckpointError`` naming up to 10 unexpected and 10 missing tensors, if there are any."""
    problems = []
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {', '.join(unexpected[:10])}")
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {', '.join(missing[:10])}")
    if problems:
        raise CheckpointError(f"{what} does not match the config: " + "; ".join(problems))


def dequantize_fp8(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = (128, 128)) -> Tensor:
    """float32 ``weight * scale_inv`` with one scale per ``block`` (edge blocks may be partial)."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


@torch.no_grad()
def _fill(model: DeepseekForCausalLM, files: dict[str, str], plan: _Plan) -> None:
    """Read each planned tensor once and copy it (dequantized, cast) into the model."""
    state, safe_open = model.state_dict(), _safe_open()
    block = _block(model.config)
    by_file: dict[str, list[str]] = {}
    for name in plan.entries:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                target, scale = plan.entries[name]
                if scale is not None:
                    tensor = dequantize_fp8(f.get_tensor(name), _read(files[scale], scale, f, file), block)
                    tensor = model.tp_shard(name, tensor)
                else:
                    sl = f.get_slice(name)
                    tensor = model.tp_read(name, sl.get_shape(), sl.__getitem__)  # this rank's share only
                _piece(state[target.name], target).copy_(tensor)


def _read(file: str, name: str, open_handle, open_file: str) -> Tensor:
    if file == open_file:
        return open_handle.get_tensor(name)
    with _safe_open()(file, framework="pt") as f:
        return f.get_tensor(name)


def checkpoint_tensors(model: DeepseekForCausalLM) -> dict[str, Tensor]:
    """The model's weights under the names and shapes a published checkpoint (and
    ``save_pretrained``) writes: ``model.state_dict()`` with each stacked expert tensor split into
    per-expert ``{gate,up,down}_proj.weight`` views, and without a tied ``lm_head``. The inverse of
    what ``load_deepseek`` reads; ``safetensors`` wants them ``.contiguous()``."""
    out = {}
    for name, tensor in model.state_dict().items():
        name = mtp.checkpoint_name(name, model.config)
        prefix, _, leaf = name.rpartition(".")
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if not (prefix.endswith(".mlp.experts") and leaf in ("gate_up_proj", "down_proj")):
            out[name] = tensor
            continue
        for x, w in enumerate(tensor):
            parts = {"down": w} if leaf == "down_proj" else dict(zip(("gate", "up"), w.chunk(2)))
            out.update({f"{prefix}.{x}.{part}_proj.weight": t for part, t in parts.items()})
    return out


def load_deepseek(path: str | os.PathLike, dtype: Optional[torch.dtype] = None,
                  device: torch.device | str = "cpu", huge_pages: bool = True,
                  tp: Group = Group.single(), dp: Group = Group.single(),
                  ep: Group = Group.single(), mtp_layers: int = 0) -> DeepseekForCausalLM:
    """Build a ``DeepseekForCausalLM`` from the checkpoint directory ``path``.

    ``dtype`` defaults to the checkpoint's ``dtype``/``torch_dtype`` (bfloat16 for FP8 or unknown).
    ``huge_pages``: on CPU, weights and derived forms of 2 MiB or more go onto transparent huge
    pages (``ascend_graph.runtime.weights_on_huge_pages``; decode streams them faster).
    ``tp``, ``dp``, ``ep``: the groups of ``get_parallel_state()``; the model is this rank's share
    (an expert-parallel rank reads only its experts). ``mtp_layers``: how many of the checkpoint's
    multi-token-prediction layers to load (``num_nextn_predict_layers`` at most; none by default).
    Raises ``CheckpointError`` naming the tensor on missing, unexpected or misshapen tensors.
    """
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    config = DeepseekConfig.from_dict(raw)
    dtype = dtype or _DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype")), torch.bfloat16)
    files = checkpoint_files(path)
    model = DeepseekForCausalLM(config, dtype=dtype, device=device, init_weights=False, tp=tp, dp=dp, ep=ep,
                                mtp_layers=mtp_layers)
    _fill(model, files, _plan(model, files))
    model.process_weights_after_loading()
    if huge_pages:
        weights_on_huge_pages(model)
    return model.eval()
