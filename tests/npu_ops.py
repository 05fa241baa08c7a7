"""A CPU stand-in for the torch_npu operators the npu attention backend calls (test code, not
the package), one per torch_npu release (7.1, 7.2, 7.3).

Each operator is declared with torch_npu's own schema string, copied from op-plugin's
``op_plugin/config/op_plugin_functions.yaml`` at that release's tag (``SCHEMAS``; tags and
commits in docs/npu.md), through ``torch.library.Library(...).define`` under a namespace of the
stand-in's own (``npu_standin_7_1``...). So what a graph compiler may assume (which arguments
are mutated, which outputs alias) comes from the real declarations: the MLA write
``npu_kv_rmsnorm_rope_cache`` declares no mutation and returns the caches it wrote in place (as
its kernel does: ``std::tie(k_cache, ckv_cache, ...)``), ``..._v2`` declares ``Tensor(a!)``.

Each kernel implements the documented semantics in plain torch, raises where the operator's
documentation (op-plugin ``docs/context``) rules an input out, for that release (``_check_*``),
and ``CALLS`` records what each was handed (by argument name) for the contract tests.
``install(monkeypatch, release)`` puts one release's stand-in in ``sys.modules["torch_npu"]``
and lets the npu backends run on CPU tensors.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Optional

import torch
from torch import Tensor

CALLS: list[tuple[str, dict]] = []  # (op, arguments) per call from Python (not from inside a graph)
RUNS: list[list[int]] = []  # actual_seq_lengths_kv of every fused-attention run
RELEASES = ((7, 1), (7, 2), (7, 3))

_FIA = ("npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
        "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
        "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, "
        "Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, "
        "Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, "
        "Tensor? value_antiquant_scale=None, Tensor? value_antiquant_offset=None, Tensor? block_table=None, "
        "Tensor? query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, "
        "Tensor? value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, "
        "Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, "
        "int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout=\"BSH\", "
        "int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, "
        "int antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, "
        "bool softmax_lse_flag=False) -> (Tensor, Tensor)")
_SCATTER = "npu_scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> Tensor(a!)"
_SCATTER_FUNCTIONAL = "npu_scatter_nd_update(Tensor self, Tensor indices, Tensor updates) -> Tensor"
_WRITE_7_1 = ("npu_kv_rmsnorm_rope_cache(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index, "
              "Tensor k_cache, Tensor ckv_cache, *, Tensor? k_rope_scale=None, Tensor? c_kv_scale=None, "
              "Tensor? k_rope_offset=None, Tensor? c_kv_offset=None, float epsilon=1e-5, str cache_mode='Norm', "
              "bool is_output_kv=False) -> (Tensor, Tensor, Tensor, Tensor)")
_WRITE_V2_7_2 = ("npu_kv_rmsnorm_rope_cache_v2(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index, "
                 "Tensor(a!) k_cache, Tensor(b!) ckv_cache, *, Tensor? k_rope_scale=None, Tensor? c_kv_scale=None, "
                 "Tensor? k_rope_offset=None, Tensor? c_kv_offset=None, float epsilon=1e-5, str cache_mode='Norm', "
                 "bool is_output_kv=False) -> (Tensor, Tensor)")
_WRITE_7_3 = ("npu_kv_rmsnorm_rope_cache(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index, "
              "Tensor k_cache, Tensor ckv_cache, *, Tensor? k_rope_scale=None, Tensor? c_kv_scale=None, "
              "Tensor? k_rope_offset=None, Tensor? c_kv_offset=None, Tensor? v=None, float epsilon=1e-5, "
              "str cache_mode='Norm', bool is_output_kv=False) -> (Tensor, Tensor, Tensor, Tensor)")
_WRITE_V2_7_3 = ("npu_kv_rmsnorm_rope_cache_v2(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index, "
                 "Tensor(a!) k_cache, Tensor(b!) ckv_cache, *, Tensor? k_rope_scale=None, Tensor? c_kv_scale=None, "
                 "Tensor? k_rope_offset=None, Tensor? c_kv_offset=None, Tensor? v=None, float epsilon=1e-5, "
                 "str cache_mode='Norm', bool is_output_kv=False) -> (Tensor, Tensor)")

_WRITE_V2_FUNCTIONAL_7_2 = ("npu_kv_rmsnorm_rope_cache_v2_functional(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, "
                            "Tensor index, Tensor k_cache, Tensor ckv_cache, *, Tensor? k_rope_scale=None, "
                            "Tensor? c_kv_scale=None, Tensor? k_rope_offset=None, Tensor? c_kv_offset=None, "
                            "float epsilon=1e-5, str cache_mode='Norm', bool is_output_kv=False) "
                            "-> (Tensor, Tensor, Tensor, Tensor)")
_WRITE_V2_FUNCTIONAL_7_3 = ("npu_kv_rmsnorm_rope_cache_v2_functional(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, "
                            "Tensor index, Tensor k_cache, Tensor ckv_cache, *, Tensor? k_rope_scale=None, "
                            "Tensor? c_kv_scale=None, Tensor? k_rope_offset=None, Tensor? c_kv_offset=None, "
                            "Tensor? v=None, float epsilon=1e-5, str cache_mode='Norm', bool is_output_kv=False) "
                            "-> (Tensor, Tensor, Tensor, Tensor)")

# op-plugin op_plugin_functions.yaml, tags 7.1.0 / 7.2.0 / 7.3.0: the schema lines, as written there
# (7.2.0 has 7.1.0's npu_kv_rmsnorm_rope_cache; the attention and scatter lines are the same at every tag)
SCHEMAS = {
    (7, 1): (_FIA, _SCATTER, _SCATTER_FUNCTIONAL, _WRITE_7_1),
    (7, 2): (_FIA, _SCATTER, _SCATTER_FUNCTIONAL, _WRITE_7_1, _WRITE_V2_7_2, _WRITE_V2_FUNCTIONAL_7_2),
    (7, 3): (_FIA, _SCATTER, _SCATTER_FUNCTIONAL, _WRITE_7_3, _WRITE_V2_7_3, _WRITE_V2_FUNCTIONAL_7_3),
}
# in-place operator -> (its functional form in the yaml, the arguments it mutates)
FUNCTIONAL = {"npu_scatter_nd_update_": ("npu_scatter_nd_update", ("self",)),
              "npu_kv_rmsnorm_rope_cache_v2": ("npu_kv_rmsnorm_rope_cache_v2_functional", ("k_cache", "ckv_cache"))}


def _bind(schema, args: tuple, kwargs: dict) -> dict:
    """Every argument of ``schema`` by name: the positional ones, the keywords, the defaults."""
    names = [a.name for a in schema.arguments]
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def _fail(op: str, what: str):
    raise RuntimeError(f"{op}: {what} (torch_npu's documentation rules it out)")


# --- npu_fused_infer_attention_score ----------------------------------------------------------


def _check_mla_decode(release, a, b, n) -> None:
    q, k, qr, kr = a["query"], a["key"], a["query_rope"], a["key_rope"]
    heads = (32, 64, 128) if release < (7, 3) else (1, 2, 4, 8, 16, 32, 64, 128)
    op = "npu_fused_infer_attention_score (query_rope)"
    if q.shape[-1] != 512 or k.shape[-1] != 512 or k.shape[1] != 1:
        _fail(op, f"query/key head size 512 and one kv head (paged), got {q.shape[-1]}/{k.shape[-1]}, {k.shape[1]}")
    if qr.shape[-1] != 64 or kr.shape[-1] != 64 or qr.shape[:-1] != q.shape[:-1] or kr.shape[:-1] != k.shape[:-1]:
        _fail(op, f"query_rope/key_rope head size 64, other dims as query/key; got {tuple(qr.shape)}, "
                  f"{tuple(kr.shape)}")
    if n not in heads:
        _fail(op, f"{heads} query heads on {release}, got {n}")
    if not (q.is_contiguous() and qr.is_contiguous() and kr.is_contiguous()):
        _fail(op, "contiguous query, query_rope and key_rope")
    if qr.dtype != q.dtype or kr.dtype != k.dtype or a["sparse_mode"] != 0 or a["atten_mask"] is not None:
        _fail(op, "query_rope/key_rope in query/key's dtype; one query token: sparse_mode 0 and no mask")
    size = a["block_size"]
    if not (size in (16, 128) if release < (7, 3) else (size % 16 == 0 and 0 < size <= 1024)):
        _fail(op, f"block_size 16 or 128 on {release} (multiples of 16 up to 1024 from 7.3), got {a['block_size']}")


def _check_decode(release, a, b: int) -> int:
    q, k, v, table, lens = a["query"], a["key"], a["value"], a["block_table"], a["actual_seq_lengths_kv"]
    n, hk, op = a["num_heads"], a["num_key_value_heads"] or a["num_heads"], "npu_fused_infer_attention_score"
    if a["input_layout"] not in ("BNSD", "BSH") or k.shape != v.shape:
        _fail(op, f"paged decode in BNSD or BSH with key and value of one shape, got {a['input_layout']}")
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != b:
        _fail(op, "block_table int32 [B, max blocks]")
    if lens is None or not (len(lens) == 1 or len(lens) >= b):
        _fail(op, "actual_seq_lengths_kv of length 1 or >= B in page attention")
    if any(x > table.shape[1] * a["block_size"] for x in lens):
        _fail(op, "actual_seq_lengths_kv within block_table's blocks")
    if a["query_rope"] is not None or a["key_rope"] is not None:
        _check_mla_decode(release, a, b, n)
        return 1
    d = q.shape[-1] // n if a["input_layout"] == "BSH" else q.shape[-1]
    if n > 256 or d > 512 or n % hk or n // hk > 64 or not 0 < a["block_size"] <= 512 or a["block_size"] % 16:
        _fail(op, f"<= 256 heads of size <= 512, heads a multiple (<= 64x) of kv heads, block_size 16-aligned "
                  f"<= 512; got {n}/{hk} heads of {d}, block_size {a['block_size']}")
    if a["input_layout"] == "BSH" and k.shape[-1] > 65535:
        _fail(op, f"kv heads x head size <= 65535 in the [N, S, H] cache layout, got {k.shape[-1]}")
    return hk


def _check_tnd(release, a) -> None:
    q, k, v, op = a["query"], a["key"], a["value"], "npu_fused_infer_attention_score (TND)"
    mask, lens_q, lens_kv = a["atten_mask"], a["actual_seq_lengths"], a["actual_seq_lengths_kv"]
    if a["input_layout"] != "TND" or a["sparse_mode"] != 3 or mask is None or mask.shape != (2048, 2048):
        _fail(op, "without a block table: TND, sparse_mode 3 and a [2048, 2048] mask")
    if mask.dtype != torch.bool or not torch.equal(mask[:4, :4], torch.ones(4, 4, dtype=torch.bool).triu(1)):
        _fail(op, "the sparse_mode 3 mask: bool, True above the diagonal")
    if lens_q is None or lens_kv is None or len(lens_q) != len(lens_kv) or len(lens_q) > 4096:
        _fail(op, "actual_seq_lengths and actual_seq_lengths_kv, as many (<= 4096)")
    qd, vd, n, hk = q.shape[-1], v.shape[-1], q.shape[1], k.shape[1]
    if not ((qd == k.shape[-1] == 192 and vd in (128, 192)) or (release >= (7, 2) and qd == k.shape[-1] == vd == 128)):
        _fail(op, f"query/key 192 with value 128/192 (or all 128 from 7.2), got {qd}/{k.shape[-1]}/{vd} on {release}")
    if release < (7, 3) and q.dtype != torch.bfloat16:
        _fail(op, f"bfloat16 only on {release}, got {q.dtype}")
    if release < (7, 2) and (n != hk or v.shape[1] != n or n not in (2, 4, 8, 16, 32, 64, 128)):
        _fail(op, f"equal query/key/value heads (2 to 128) on 7.1, got {n}/{hk}/{v.shape[1]}")
    ends_q, ends_kv = [0, *lens_q], [0, *lens_kv]
    per_q = [ends_q[i + 1] - ends_q[i] for i in range(len(lens_q))]
    per_kv = [ends_kv[i + 1] - ends_kv[i] for i in range(len(lens_kv))]
    if min(per_q + per_kv) < 0 or (release < (7, 3) and any(x >= y for x, y in zip(per_q, per_kv))):
        _fail(op, f"non-decreasing lengths; on {release} with sparse_mode 3 each query length below its kv "
                  f"length, got {per_q} / {per_kv}")


def _rows(cache: Tensor, table: Tensor, length: int, layout: str) -> Tensor:
    """The first ``length`` tokens of one row from a paged key: ``[L, Hk, D]``."""
    if layout == "BNSD":  # [N, Hk, S, D]
        s = cache.shape[2]
        return cache[table[:-(-length // s)].long()].transpose(1, 2).flatten(0, 1)[:length]
    s = cache.shape[1]  # BSH: [N, S, Hk * D]
    return cache[table[:-(-length // s)].long()].flatten(0, 1)[:length]


def _attend(q, k, v, qr, kr, scale: float, causal_offset: Optional[int]) -> Tensor:
    """``q [Q, N, D]`` over ``k [L, Hk, D]``, ``v [L, Hk, Dv]`` in float32 (grouped heads)."""
    g = q.shape[1] // k.shape[1]
    f = lambda t: t.float().repeat_interleave(g, dim=1).transpose(0, 1)  # noqa: E731  [N, L, D]
    scores = q.float().transpose(0, 1) @ f(k).transpose(1, 2)  # [N, Q, L]
    if qr is not None:
        scores = scores + qr.float().transpose(0, 1) @ f(kr).transpose(1, 2)
    scores = scores * scale
    if causal_offset is not None:  # query i sees keys j <= causal_offset + i (bottom-right causal)
        i, j = torch.arange(q.shape[0])[:, None], torch.arange(k.shape[0])[None, :]
        scores = scores.masked_fill(j > causal_offset + i, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ f(v)).transpose(0, 1)  # [Q, N, Dv]


def _fia_shape(a) -> tuple:
    q, v, layout = a["query"], a["value"], a["input_layout"]
    if layout == "BSH":  # value [N, S, Hk * Dv]
        hk = a["num_key_value_heads"] or a["num_heads"]
        return (*q.shape[:-1], a["num_heads"] * (v.shape[-1] // hk))
    return (*q.shape[:-1], v.shape[-1])  # BNSD, TND


def _fia_kernel(release, schema):
    def kernel(*args, **kwargs):
        a = _bind(schema, args, kwargs)
        q, scale, out = a["query"], a["scale"], a["query"].new_zeros(_fia_shape(a))
        if q.dtype not in (torch.float16, torch.bfloat16) or a["key"].dtype != q.dtype:
            _fail("npu_fused_infer_attention_score", f"float16/bfloat16 query and key of one dtype, got {q.dtype}")
        if a["block_table"] is None:
            _check_tnd(release, a)
            q0 = k0 = 0
            for q1, k1 in zip(a["actual_seq_lengths"], a["actual_seq_lengths_kv"]):  # cumulative ends
                o = _attend(q[q0:q1], a["key"][k0:k1], a["value"][k0:k1], None, None, scale, (k1 - k0) - (q1 - q0))
                out[q0:q1] = o.to(out.dtype)
                q0, k0 = q1, k1
            return out, q.new_zeros(1, dtype=torch.float32)
        b = q.shape[0]
        hk = _check_decode(release, a, b)
        given = list(a["actual_seq_lengths_kv"])
        lens = given[:b] if len(given) > 1 else given * b  # one length: every row
        RUNS.append(lens)  # at run time, in eager steps and graph replays alike
        qv, qr = q.view(b, a["num_heads"], -1), a["query_rope"]
        for row, length in enumerate(lens):
            if length == 0:
                continue  # nothing to read: the row's output stays zero
            table = a["block_table"][row]
            rows = lambda t: _rows(t, table, length, a["input_layout"]).reshape(length, hk, -1)  # noqa: E731
            kr = None if qr is None else rows(a["key_rope"])
            o = _attend(qv[row:row + 1], rows(a["key"]), rows(a["value"]),
                        None if qr is None else qr.view(b, a["num_heads"], -1)[row:row + 1], kr, scale, None)
            out.view(b, a["num_heads"], -1)[row] = o[0].to(out.dtype)
        return out, q.new_zeros(1, dtype=torch.float32)
    return kernel


def _fia_fake(schema):
    def fake(*args, **kwargs):
        a = _bind(schema, args, kwargs)
        return a["query"].new_empty(_fia_shape(a)), a["query"].new_empty(1, dtype=torch.float32)
    return fake


# --- the MLA cache write: npu_kv_rmsnorm_rope_cache (and _v2) ---------------------------------


def _write(op: str, a) -> tuple[Tensor, Tensor]:
    """The documented write (PA mode): RMSNorm and rope of ``kv``, scattered at ``index``; negative
    indices skipped (vllm-ascend passes -1 for padding; op-plugin's reference skips them)."""
    kv, k_cache, ckv_cache, index = a["kv"], a["k_cache"], a["ckv_cache"], a["index"]
    if a["cache_mode"] != "PA" or index.dtype != torch.int64 or a.get("v") is not None or a["k_rope_scale"] is not None:
        _fail(op, "cache_mode 'PA' (as called here), int64 index, unquantized, no v")
    if kv.dim() != 4 or kv.shape[1] != 1 or (kv.shape[-1], ckv_cache.shape[-1], k_cache.shape[-1]) != (576, 512, 64):
        _fail(op, f"kv [B, 1, S, 576] (rms 512 + rope 64) and caches of 512 / 64, got {tuple(kv.shape)}")
    rows = kv.shape[0] * kv.shape[2]
    if a["cos"].shape != (*kv.shape[:-1], 64) or a["sin"].shape != a["cos"].shape or a["gamma"].shape != (512,):
        _fail(op, "cos/sin [B, 1, S, 64] and gamma [512]")
    dtypes = {kv.dtype, a["gamma"].dtype, a["cos"].dtype, k_cache.dtype, ckv_cache.dtype}
    if not dtypes <= {torch.float16, torch.bfloat16} or index.shape != (rows,):
        _fail(op, f"float16/bfloat16 inputs and caches, index [B * S]; got {dtypes}, {tuple(index.shape)}")
    live = index[index >= 0]
    if len(live) != len(live.unique()) or bool((live >= ckv_cache.shape[0] * ckv_cache.shape[1]).any()):
        _fail(op, f"index values unique (a repeated index is undefined) and in range, got {index.tolist()}")
    x = kv.float().reshape(rows, 576)
    normed = x[:, :512] * torch.rsqrt(x[:, :512].pow(2).mean(-1, keepdim=True) + a["epsilon"]) * a["gamma"].float()
    x1, x2 = x[:, 512::2], x[:, 513::2]  # the documented rope: pairs split into halves, then rotate-half
    cos, sin = a["cos"].float().reshape(rows, 64), a["sin"].float().reshape(rows, 64)
    rotated = torch.cat((x1, x2), -1) * cos + torch.cat((-x2, x1), -1) * sin
    keep = index >= 0
    ckv_cache.view(-1, 512)[index[keep]] = normed[keep].to(ckv_cache.dtype)
    k_cache.view(-1, 64)[index[keep]] = rotated[keep].to(k_cache.dtype)
    return rotated.view(*kv.shape[:-1], 64).to(kv.dtype), normed.view(*kv.shape[:-1], 512).to(kv.dtype)


def _write_kernel(schema, form: str):
    """``form``: "v1" (returns the caches themselves, then k_rope, c_kv), "v2" (in place,
    returns k_rope, c_kv) or "functional" (v2 on copies of the caches, returned last)."""
    def kernel(*args, **kwargs):
        a = _bind(schema, args, kwargs)
        if form == "functional":
            a = {**a, "k_cache": a["k_cache"].clone(), "ckv_cache": a["ckv_cache"].clone()}
        k_rope, c_kv = _write(schema.name, a)
        if form == "v1":
            return a["k_cache"], a["ckv_cache"], k_rope, c_kv  # std::tie(k_cache, ckv_cache, ...) in op-plugin
        return (k_rope, c_kv) if form == "v2" else (k_rope, c_kv, a["k_cache"], a["ckv_cache"])
    return kernel


def _write_fake(schema, form: str):
    def fake(*args, **kwargs):  # op-plugin's meta registrations: fresh tensors, the caches' likes
        a = _bind(schema, args, kwargs)
        kv, caches = a["kv"], (torch.empty_like(a["k_cache"]), torch.empty_like(a["ckv_cache"]))
        outs = (kv.new_empty((*kv.shape[:-1], 64)), kv.new_empty((*kv.shape[:-1], 512)))
        return {"v1": (*caches, *outs), "v2": outs, "functional": (*outs, *caches)}[form]
    return fake


def _functionalize_onto(schema, functional, mutated: tuple[str, ...]):
    """The functionalization kernel of an in-place operator, as torch_npu generates them
    (Ascend/pytorch ``codegen/gen_functionalization_type.py``): its functional form on the
    unwrapped inputs; the trailing outputs replace the mutated arguments."""
    def kernel(*args, **kwargs):
        a = _bind(schema, args, kwargs)
        for t in a.values():
            if isinstance(t, Tensor):
                torch._functionalize_sync(t)
        inner = {k: torch._from_functional_tensor(t) if isinstance(t, Tensor) else t for k, t in a.items()}
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
            outs = functional(**inner)
        outs = outs if isinstance(outs, tuple) else (outs,)
        kept = len(outs) - len(mutated)
        for name, new in zip(mutated, outs[kept:]):
            torch._functionalize_replace(a[name], new)
            torch._functionalize_commit_update(a[name])
            torch._functionalize_sync(a[name])
        if schema.returns[0].alias_info is not None:
            return a[mutated[0]]
        return tuple(torch._to_functional_tensor(t) for t in outs[:kept])
    return kernel


# --- npu_scatter_nd_update_ -------------------------------------------------------------------


def _scatter_kernel(schema, in_place: bool):
    def kernel(*args, **kwargs):
        a = _bind(schema, args, kwargs)
        if not in_place:
            a = {**a, "self": a["self"].clone()}
        data, indices, updates, op = a["self"], a["indices"], a["updates"], "npu_scatter_nd_update_"
        depth = indices.shape[-1]
        if indices.dtype not in (torch.int32, torch.int64) or indices.dim() < 2 or depth > data.dim():
            _fail(op, "int32/int64 indices of at least 2 dims, last dim <= input dims")
        if updates.dtype != data.dtype or updates.shape != (*indices.shape[:-1], *data.shape[depth:]):
            _fail(op, "updates in input's dtype, shape indices[:-1] + input[depth:]")
        bounds = torch.tensor(data.shape[:depth])
        if bool((indices < 0).any()) or bool((indices >= bounds).any()):
            _fail(op, "indices in bounds (no negative index)")
        data[tuple(indices[..., i].long() for i in range(depth))] = updates
        return data
    return kernel


# --- one stand-in module per release ----------------------------------------------------------

_LIBS: dict = {}


def namespace(release) -> str:
    return f"npu_standin_{release[0]}_{release[1]}"


def _library(release):
    """The release's operators, defined once per process from ``SCHEMAS[release]``."""
    if release not in _LIBS:
        ns = namespace(release)
        lib = torch.library.Library(ns, "DEF")
        for schema_text in SCHEMAS[release]:
            lib.define(schema_text)
        ops = getattr(torch.ops, ns)
        schema = lambda name: getattr(ops, name).default._schema  # noqa: E731
        fia = schema("npu_fused_infer_attention_score")
        impls = {"npu_fused_infer_attention_score": (_fia_kernel(release, fia), _fia_fake(fia)),
                 "npu_scatter_nd_update_": (_scatter_kernel(schema("npu_scatter_nd_update_"), True),
                                            lambda *a, **k: a[0]),
                 "npu_scatter_nd_update": (_scatter_kernel(schema("npu_scatter_nd_update"), False),
                                           lambda *a, **k: torch.empty_like(a[0]))}
        forms = {"npu_kv_rmsnorm_rope_cache": "v1", "npu_kv_rmsnorm_rope_cache_v2": "v2",
                 "npu_kv_rmsnorm_rope_cache_v2_functional": "functional"}
        for name, form in forms.items():
            if hasattr(ops, name):
                impls[name] = (_write_kernel(schema(name), form), _write_fake(schema(name), form))
        for name, (kernel, fake) in impls.items():
            lib.impl(name, kernel, "CPU")
            torch.library.register_fake(f"{ns}::{name}", fake, lib=lib)
        for name, (functional, mutated) in FUNCTIONAL.items():
            if hasattr(ops, name):
                lib.impl(name, _functionalize_onto(schema(name), getattr(ops, functional).default, mutated),
                         "Functionalize")
        _LIBS[release] = (lib, sorted(impls))
    return _LIBS[release]


def _recorded(name: str, packet):
    schema = packet.default._schema

    def call(*args, **kwargs):
        if not torch.compiler.is_compiling():  # a graph replays the op, not this Python wrapper
            CALLS.append((name, _bind(schema, args, kwargs)))
        return packet(*args, **kwargs)
    return call


def module(release=(7, 1)) -> types.ModuleType:
    """A ``torch_npu`` stand-in for ``release``: its operators, recorded."""
    _, names = _library(release)
    m = types.ModuleType("torch_npu")
    m.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    ops = getattr(torch.ops, namespace(release))
    for name in names:
        setattr(m, name, _recorded(name, getattr(ops, name)))
    return m


OPS = ("npu_fused_infer_attention_score", "npu_kv_rmsnorm_rope_cache", "npu_kv_rmsnorm_rope_cache_v2",
       "npu_scatter_nd_update_")


def npu_available() -> bool:
    """Whether the real torch_npu imports and sees an NPU."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def recording(real: types.ModuleType) -> types.ModuleType:
    """The real torch_npu with ``OPS`` recorded into ``CALLS`` (arguments by name, from the real
    schema) before each call: the contract tests' view of an NPU run."""
    proxy = types.ModuleType("torch_npu")
    proxy.__spec__ = real.__spec__
    proxy.__getattr__ = lambda name: getattr(real, name)
    for name in OPS:
        if hasattr(real, name) and hasattr(torch.ops.npu, name):
            schema, target = getattr(torch.ops.npu, name).default._schema, getattr(real, name)

            def call(*args, _target=target, _name=name, _schema=schema, **kwargs):
                CALLS.append((_name, _bind(_schema, args, kwargs)))
                return _target(*args, **kwargs)

            setattr(proxy, name, call)
    return proxy


def install_device(monkeypatch) -> None:
    """The real torch_npu, recorded, for the same tests on an NPU."""
    import torch_npu

    monkeypatch.setitem(sys.modules, "torch_npu", recording(torch_npu))
    CALLS.clear()
    RUNS.clear()


def install(monkeypatch, release=(7, 1)) -> None:
    """``release``'s stand-in as ``torch_npu`` (its operators where the backend looks them up);
    the npu backends accept CPU tensors of their dtypes."""
    from ascend_graph.attention import npu, npu_limits

    monkeypatch.setitem(sys.modules, "torch_npu", module(release))
    monkeypatch.setattr(npu_limits, "OPS_NAMESPACE", namespace(release))
    runs = classmethod(lambda cls, device, dtype: dtype in npu.DTYPES)
    monkeypatch.setattr(npu.NpuMLA, "supports", runs)
    monkeypatch.setattr(npu.NpuPaged, "supports", runs)
    CALLS.clear()
    RUNS.clear()
