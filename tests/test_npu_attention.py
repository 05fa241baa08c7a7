"""The npu attention backends end to end on the CPU, over a stand-in for torch_npu's operators
(tests/npu_ops.py: declared with torch_npu's own schemas, per release, and their documented
semantics and limits in plain torch). Outputs against float64 oracles on contiguous copies,
cache writes against reference writes, the exact arguments handed to torch_npu, and graph mode
through AOTAutograd as torchair compiles. Nothing here ran on an NPU."""

import copy
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import npu_ops
from attention_cases import _assert_matches, _slots, _tables, _write_prefix
from ascend_graph.attention import build_attention_metadata, choose_block_size
from ascend_graph.attention.base import AttentionShape
from ascend_graph.attention.metadata import pad_decode
from ascend_graph.attention.npu import NpuMLA, NpuPaged, deinterleave
from ascend_graph.attention.oracle import dense_attention, naive_mla
from ascend_graph.kv_cache import NULL_BLOCK, KVCache, MLACache
from ascend_graph.layers import RMSNorm, apply_rope

S = 128  # the NPU's MLA block size
MAX_LEN = 1024
V71, V72, V73 = npu_ops.RELEASES
ALIASING = "ignore:.*may not alias any inputs to this custom operator:UserWarning"  # the v1 write's returns

# .ci/npu_check sets ASCEND_GRAPH_REQUIRE_NPU=1: there a missing NPU fails the "npu" cases
REQUIRE_NPU = os.environ.get("ASCEND_GRAPH_REQUIRE_NPU") == "1"
needs_npu = pytest.mark.skipif(not (REQUIRE_NPU or npu_ops.npu_available()), reason="needs an Ascend NPU and torch_npu")


def _release(place: str):
    """The stand-in's release of ``place`` ("standin-7.1" -> (7, 1)); None for the real torch_npu."""
    return tuple(int(x) for x in place.split("-")[1].split(".")) if place.startswith("standin") else None


def _place(where, monkeypatch) -> torch.device:
    """The CPU over a release's stand-in ("standin-7.1"...), or an NPU over the real torch_npu (recorded)."""
    if where.startswith("standin"):
        npu_ops.install(monkeypatch, _release(where))
        return torch.device("cpu")
    if not npu_ops.npu_available():
        pytest.fail("ASCEND_GRAPH_REQUIRE_NPU=1, but torch_npu does not import or sees no NPU")
    npu_ops.install_device(monkeypatch)
    return torch.device("npu")


def _meta(tables, cached, new, num_blocks, dev, width=None):
    return build_attention_metadata(tables, cached, new, block_size=S, num_blocks=num_blocks, max_model_len=MAX_LEN,
                                    block_table_width=width, device=dev, host_context_lens=True)


def _mla_cache(num_blocks, c, r, dtype, dev):
    return MLACache(torch.zeros(num_blocks, S, 1, c, dtype=dtype, device=dev),
                    torch.zeros(num_blocks, S, 1, r, dtype=dtype, device=dev))


def _calls(name):
    return [kw for n, kw in npu_ops.CALLS if n == name]


def _close(out, ref, rel_atol):
    _assert_matches(out.cpu(), ref, rel_atol)


@pytest.mark.parametrize("place,c,r,interleaved", [
    ("standin-7.1", 512, 64, True), ("standin-7.2", 512, 64, True), ("standin-7.3", 512, 64, True),
    pytest.param("npu", 512, 64, True, marks=needs_npu), ("standin-7.3", 32, 8, True), ("standin-7.1", 512, 64, False)])
def test_mla_write_equals_the_reference_write_and_padding_touches_no_live_slot(monkeypatch, place, c, r, interleaved):
    dev = _place(place, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    dtype, t, num_blocks = torch.bfloat16, 7, 6
    cache = MLACache(torch.randn(num_blocks, S, 1, c, generator=gen).to(dtype),
                     torch.randn(num_blocks, S, 1, r, generator=gen).to(dtype))
    before = [x.clone() for x in cache]
    kv_c, k_pe = torch.randn(t, c, generator=gen).to(dtype), torch.randn(t, r, generator=gen).to(dtype)
    norm = RMSNorm(c, 1e-6, dtype)
    norm.weight.data = torch.rand(c, generator=gen).to(dtype) + 0.5
    angles = torch.rand(t, r // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = angles.cos().float(), angles.sin().float()
    slots = torch.tensor([3 * S + 5, 1 * S, 5 * S + 127, -1, 2 * S + 64, -1, 4 * S + 1])
    on_dev = MLACache(*(x.to(dev) for x in cache))
    backend = NpuMLA()
    read = backend.write_latent(on_dev, kv_c.to(dev), k_pe.to(dev), norm.to(dev), cos.to(dev), sin.to(dev),
                                slots.to(dev), interleaved)
    assert all(a.data_ptr() == b.data_ptr() and a.shape == b.shape for a, b in zip(read, on_dev))  # the caches
    cache = MLACache(*(x.cpu() for x in on_dev))

    # the reference write, in float64: RMSNorm, the rope, and the fused write's de-interleaved layout
    x = kv_c.double()
    ref_c = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    ref_pe = apply_rope(k_pe.double()[:, None, :], cos.double(), sin.double(), interleaved)[:, 0]
    ref_pe = deinterleave(ref_pe) if interleaved else ref_pe
    flat_c, flat_pe = (x.view(-1, x.shape[-1]) for x in cache)
    live = slots >= 0
    _close(flat_c[slots[live]], ref_c[live], 1e-2)
    _close(flat_pe[slots[live]], ref_pe[live], 1e-2)
    fused = (c, r, interleaved) == (512, 64, True)
    for now, old in zip(cache, before):  # every other slot bit-identical; the unfused write pads into null slot 0
        untouched = torch.ones(num_blocks * S, dtype=torch.bool)
        untouched[slots[live]] = False
        untouched[NULL_BLOCK * S] = fused
        assert torch.equal(now.view(num_blocks * S, -1)[untouched], old.view(num_blocks * S, -1)[untouched])
    v1, v2 = _calls("npu_kv_rmsnorm_rope_cache"), _calls("npu_kv_rmsnorm_rope_cache_v2")
    if not fused:
        assert v1 == v2 == []
        return
    has_v2 = _release(place) >= V72 if _release(place) else hasattr(torch.ops.npu, "npu_kv_rmsnorm_rope_cache_v2")
    (kw,) = v2 if has_v2 else v1  # v2 where this torch_npu has it, else v1 (its returns read)
    assert (v1 if has_v2 else v2) == []
    assert kw["k_cache"] is on_dev.k_pe and kw["ckv_cache"] is on_dev.kv_c
    assert kw["cache_mode"] == "PA" and kw["epsilon"] == 1e-6 and not kw["is_output_kv"]
    assert kw["index"].tolist() == slots.tolist() and kw["index"].dtype == torch.int64  # padding stays -1
    assert kw["kv"].shape == (t, 1, 1, c + r) and kw["cos"].shape == (t, 1, 1, r)
    assert torch.equal(kw["cos"][:, 0, 0].float().cpu(), torch.cat((cos, cos), -1).to(dtype).float())


def test_the_query_rope_matches_the_cached_key_layout(monkeypatch):
    """Every score q_pe . k_pe is what the checkpoint's own rope gives (the permutation cancels)."""
    npu_ops.install(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 3, 64, generator=gen, dtype=torch.float64)
    k = torch.randn(5, 1, 64, generator=gen, dtype=torch.float64)
    angles = torch.rand(5, 32, generator=gen, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    ref = (apply_rope(q, cos, sin) * apply_rope(k, cos, sin)).sum(-1)
    ours = (NpuMLA().rope_query(q, cos, sin, True) * deinterleave(apply_rope(k, cos, sin))).sum(-1)
    torch.testing.assert_close(ours, ref)
    assert not torch.allclose(NpuMLA().rope_query(q, cos, sin, True), apply_rope(q, cos, sin))  # a real permutation


def _mla_case(gen, h, dn, r, dv, c, lens, num_blocks, dev, dtype=torch.bfloat16):
    tables = _tables(gen, lens, num_blocks, S)
    seqs = [tuple(torch.randn(n, 1, w, generator=gen).to(dtype) for w in (c, r)) for n in lens]
    cache = _mla_cache(num_blocks, c, r, dtype, dev)
    _write_prefix(cache, tables, [[t.to(dev) for t in x] for x in seqs], lens, S)
    w_uk, w_uv = (torch.randn(h, d, c, generator=gen).div(math.sqrt(c)).to(dtype) for d in (dn, dv))
    return tables, seqs, cache, w_uk, w_uv


@pytest.mark.parametrize("place,h", [("standin-7.1", 32), ("standin-7.2", 128), ("standin-7.3", 16),
                                     pytest.param("npu", 32, marks=needs_npu)])
def test_mla_decode_and_prefill_equal_the_float64_oracle(monkeypatch, place, h):
    """DeepSeek's dims (Dn 128, R 64, Dv 128, C 512) with the heads each release takes (16:
    V2-Lite, 7.3 on); decode rows on and across a block boundary, padded rows; a prefill after
    cached context through TND with the value unpadded (192 / 128)."""
    dev = _place(place, monkeypatch)
    dn, r, dv, c = 128, 64, 128, 512
    gen = torch.Generator().manual_seed(2)
    lens, num_blocks, dtype = [1, S, S + 1, 300, 77], 24, torch.bfloat16
    tables, seqs, cache, w_uk, w_uv = _mla_case(gen, h, dn, r, dv, c, lens, num_blocks, dev)
    on = lambda *ts: [t.to(dev) for t in ts]  # noqa: E731
    scale = 1 / math.sqrt(dn + r)
    pos, meta = _meta(tables, [n - 1 for n in lens], [1] * len(lens), num_blocks, dev, width=MAX_LEN // S)
    _, meta = pad_decode(pos, meta, len(lens) + 2)
    q_nope = torch.randn(len(lens) + 2, h, dn, generator=gen).to(dtype)
    q_pe = torch.randn(len(lens) + 2, h, r, generator=gen).to(dtype)
    backend = NpuMLA()
    out = backend.decode(*on(q_nope, q_pe), cache, meta.decode, *on(w_uk, w_uv), scale).cpu()
    for i, (kv, pe) in enumerate(seqs):
        _close(out[i:i + 1], naive_mla(q_nope[i:i + 1], q_pe[i:i + 1], kv[:, 0], pe[:, 0], w_uk, w_uv, scale), 2e-2)
    assert torch.isfinite(out[len(lens):]).all()
    kw = _calls("npu_fused_infer_attention_score")[-1]
    assert kw["actual_seq_lengths_kv"] == lens + [0, 0] and kw["block_table"] is meta.decode.block_tables
    assert kw["input_layout"] == "BNSD" and kw["num_key_value_heads"] == 1 and kw["block_size"] == S
    assert kw["key"] is kw["value"] and kw["key"].data_ptr() == cache.kv_c.data_ptr()  # in place, no copy
    assert kw["key_rope"].data_ptr() == cache.k_pe.data_ptr() and kw["num_heads"] == h and kw["scale"] == scale
    assert kw["query"].is_contiguous() and kw["query_rope"].is_contiguous()

    cached, new = [2, S - 3, 200], [5, 9, 100]  # every sequence after cached context (7.1/7.2's TND needs it)
    ctx = [a + b for a, b in zip(cached, new)]
    tables, seqs, cache, w_uk, w_uv = _mla_case(gen, h, dn, r, dv, c, ctx, num_blocks, dev)
    _, meta = _meta(tables, cached, new, num_blocks, dev)
    qn, qp = torch.randn(sum(new), h, dn, generator=gen).to(dtype), torch.randn(sum(new), h, r, generator=gen).to(dtype)
    out = backend.prefill(*on(qn, qp), cache, meta.prefill, *on(w_uk, w_uv), scale).cpu()
    start = 0
    for (kv, pe), q_len in zip(seqs, new):
        ref = naive_mla(qn[start:start + q_len], qp[start:start + q_len], kv[:, 0], pe[:, 0], w_uk, w_uv, scale)
        _close(out[start:start + q_len], ref, 2e-2)
        start += q_len
    kw = _calls("npu_fused_infer_attention_score")[-1]
    assert kw["input_layout"] == "TND" and kw["sparse_mode"] == 3 and kw["block_table"] is None
    assert kw["query"].shape[-1] == 192 and kw["value"].shape[-1] == 128 and kw["query"].dtype == torch.bfloat16
    assert kw["actual_seq_lengths"] == [5, 14, 114] and kw["actual_seq_lengths_kv"] == [7, 7 + S + 6, 7 + S + 6 + 300]
    assert backend.prefill_runs == {"tnd": 1}


@pytest.mark.parametrize("release,tnd", [(V71, False), (V72, False), (V73, True)])
def test_a_fresh_prefill_goes_where_the_release_takes_it_and_is_counted(monkeypatch, release, tnd):
    """7.1/7.2 document TND with sparse_mode=3 for query lengths below kv lengths: a prefill with
    no cached context runs in torch there (counted, named), through TND on 7.3; both equal the oracle."""
    npu_ops.install(monkeypatch, release)
    gen = torch.Generator().manual_seed(4)
    h, dn, r, dv, c, num_blocks = 32, 128, 64, 128, 512, 8
    tables, seqs, cache, w_uk, w_uv = _mla_case(gen, h, dn, r, dv, c, [40, 7], num_blocks, "cpu")
    _, meta = _meta(tables, [0, 0], [40, 7], num_blocks, "cpu")
    qn, qp = torch.randn(47, h, dn, generator=gen).bfloat16(), torch.randn(47, h, r, generator=gen).bfloat16()
    backend = NpuMLA()
    out = backend.prefill(qn, qp, cache, meta.prefill, w_uk, w_uv, 0.1)
    for (kv, pe), (a, b) in zip(seqs, [(0, 40), (40, 47)]):
        _close(out[a:b], naive_mla(qn[a:b], qp[a:b], kv[:, 0], pe[:, 0], w_uk, w_uv, 0.1), 2e-2)
    assert bool(_calls("npu_fused_infer_attention_score")) == tnd
    assert list(backend.prefill_runs) == (["tnd"] if tnd else
                                          ["torch: TND with sparse_mode=3 on torch_npu 7.1/7.2 takes query lengths "
                                           "below kv lengths"])


@pytest.mark.parametrize("place,hq,hk,d,dtype,tnd", [
    ("standin-7.1", 4, 4, 32, torch.float16, False), ("standin-7.1", 8, 2, 128, torch.float16, False),
    ("standin-7.2", 8, 2, 128, torch.float16, True), ("standin-7.3", 8, 2, 128, torch.bfloat16, True),
    pytest.param("npu", 8, 2, 128, torch.bfloat16, True, marks=needs_npu)])
def test_gqa_write_decode_and_prefill_equal_the_float64_oracle(monkeypatch, place, hq, hk, d, dtype, tnd):
    """Prefill through TND where the release takes the heads and head size (float16 cast to
    bfloat16 on 7.2), else in torch."""
    dev = _place(place, monkeypatch)
    gen = torch.Generator().manual_seed(3)
    num_blocks, lens = 16, [1, S, S + 1, 250]
    tables = _tables(gen, lens, num_blocks, S)
    seqs = [tuple(torch.randn(n, hk, d, generator=gen).to(dtype) for _ in "kv") for n in lens]
    cache = KVCache(torch.randn(num_blocks, S, hk, d, generator=gen).to(dtype),
                    torch.randn(num_blocks, S, hk, d, generator=gen).to(dtype))
    before = [x.clone() for x in cache]
    cache = KVCache(*(x.to(dev) for x in cache))
    backend, scale = NpuPaged(), 1 / math.sqrt(d)
    slots = torch.tensor([s for t, n in zip(tables, lens) for s in _slots(t, 0, n, S)] + [-1, -1])
    k_new = torch.cat([k for k, _ in seqs] + [torch.ones(2, hk, d, dtype=dtype)])
    v_new = torch.cat([v for _, v in seqs] + [torch.ones(2, hk, d, dtype=dtype)])
    backend.write(cache, k_new.to(dev), v_new.to(dev), slots.to(dev))
    for now, old, new in zip(cache, before, (k_new, v_new)):
        flat, flat_old = now.cpu().view(-1, hk, d), old.view(-1, hk, d)
        assert torch.equal(flat[slots[:-2]], new[:-2])
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots[:-2]] = False
        untouched[NULL_BLOCK * S] = False
        assert torch.equal(flat[untouched], flat_old[untouched])
        assert torch.equal(flat[NULL_BLOCK * S], new[-1])  # padding: the null block's slot 0 (no negative index)
    pos, meta = _meta(tables, [n - 1 for n in lens], [1] * len(lens), num_blocks, dev, width=MAX_LEN // S)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    out = backend.decode(q.to(dev), cache, meta.decode, scale).cpu()
    for i, (k, v) in enumerate(seqs):
        _close(out[i:i + 1], dense_attention(q[i:i + 1], k, v, scale), 1e-2)
    kw = _calls("npu_fused_infer_attention_score")[-1]
    assert kw["input_layout"] == "BSH" and kw["num_heads"] == hq and kw["num_key_value_heads"] == hk
    assert kw["key"].data_ptr() == cache.k.data_ptr() and kw["value"].data_ptr() == cache.v.data_ptr()
    assert kw["actual_seq_lengths_kv"] == lens and kw["query"].shape == (len(lens), 1, hq * d)
    new = [3 if n > 3 else n for n in lens]  # the last 3 tokens of each sequence after its cached prefix
    _, meta = _meta(tables, [n - k for n, k in zip(lens, new)], new, num_blocks, dev)
    decodes = sum(1 for n in new if n == 1)
    q = torch.randn(sum(new[decodes:]), hq, d, generator=gen).to(dtype)
    runs = len(_calls("npu_fused_infer_attention_score"))
    out = backend.prefill(q.to(dev), cache, meta.prefill, scale).cpu()
    assert out.dtype == dtype and (len(_calls("npu_fused_infer_attention_score")) > runs) == tnd
    start = 0
    for (k, v), q_len in zip(seqs[decodes:], new[decodes:]):
        _close(out[start:start + q_len], dense_attention(q[start:start + q_len], k, v, scale), 2e-2)
        start += q_len


def test_the_standin_refuses_what_the_documentation_rules_out(monkeypatch):
    """What the real operators would refuse: the small model's latent, 16 heads before 7.3, a
    non-contiguous query, a repeated write index, a negative scatter index."""
    npu_ops.install(monkeypatch, V71)
    gen = torch.Generator().manual_seed(5)
    tables, _, cache, w_uk, w_uv = _mla_case(gen, 16, 128, 64, 128, 512, [5, 9], 8, "cpu")
    _, meta = _meta(tables, [4, 8], [1, 1], 8, "cpu")
    q = torch.randn(2, 16, 128).bfloat16(), torch.randn(2, 16, 64).bfloat16()
    with pytest.raises(RuntimeError, match=r"\(32, 64, 128\) query heads on \(7, 1\), got 16"):
        NpuMLA().decode(*q, cache, meta.decode, w_uk, w_uv, 0.1)
    small = _mla_case(gen, 4, 16, 8, 16, 32, [5, 9], 8, "cpu")
    with pytest.raises(RuntimeError, match="query/key head size 512"):
        NpuMLA().decode(torch.randn(2, 4, 16).bfloat16(), torch.randn(2, 4, 8).bfloat16(), small[2], meta.decode,
                        small[3], small[4], 0.1)
    fia = sys.modules["torch_npu"].npu_fused_infer_attention_score
    q_lat = torch.randn(32, 2, 512).bfloat16().transpose(0, 1)  # [B, H, C], not contiguous
    with pytest.raises(RuntimeError, match="contiguous query"):
        fia(q_lat.unsqueeze(2), cache.kv_c.view(8, 1, S, 512),
            cache.kv_c.view(8, 1, S, 512), query_rope=torch.randn(2, 32, 1, 64).bfloat16(),
            key_rope=cache.k_pe.view(8, 1, S, 64), num_heads=32, num_key_value_heads=1, input_layout="BNSD",
            block_table=meta.decode.block_tables, block_size=S, actual_seq_lengths_kv=[5, 9])
    norm = RMSNorm(512, 1e-6, torch.bfloat16)
    cache_before = [x.clone() for x in cache]
    with pytest.raises(RuntimeError, match="index values unique"):  # what clamping two padded rows gives
        sys.modules["torch_npu"].npu_kv_rmsnorm_rope_cache(
            torch.randn(2, 1, 1, 576).bfloat16(), norm.weight, *(torch.ones(2, 1, 1, 64).bfloat16(),) * 2,
            torch.tensor([0, 0]), cache.k_pe, cache.kv_c, epsilon=1e-6, cache_mode="PA")
    assert all(torch.equal(a, b) for a, b in zip(cache, cache_before))
    with pytest.raises(RuntimeError, match="no negative index"):
        sys.modules["torch_npu"].npu_scatter_nd_update_(torch.zeros(4, 2), torch.tensor([[-1]]), torch.ones(1, 2))


def test_the_npu_block_sizes_and_an_engine_default_of_128(monkeypatch):
    npu_ops.install(monkeypatch)
    assert choose_block_size([NpuMLA()]) == 128 and choose_block_size([NpuPaged()]) == 128
    assert choose_block_size([NpuPaged()], 64) == 64
    with pytest.raises(ValueError, match="block_size=16 is not taken by the 'npu' attention backend"):
        choose_block_size([NpuMLA()], 16)
    with pytest.raises(ValueError, match="block_size=24 is not taken"):
        choose_block_size([NpuPaged()], 24)
    assert choose_block_size([]) == 16


SELECTION = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    import npu_ops
    from ascend_graph.attention import npu_limits
    release = tuple(int(x) for x in sys.argv[2].split("."))
    torch.utils.rename_privateuse1_backend("npu")
    sys.modules["torch_npu"] = npu_ops.module(release)
    npu_limits.OPS_NAMESPACE = npu_ops.namespace(release)
    from ascend_graph.attention import select_attention_backend
    from ascend_graph.attention.base import AttentionShape
    from ascend_graph.compile import detect_platform
    from ascend_graph.models import DeepseekConfig
    def mla(h, c, r):
        return AttentionShape(h, 1, 128 + r, c, r, 128)
    small = DeepseekConfig.small()
    shapes = {"small": mla(small.num_attention_heads, small.kv_lora_rank, small.qk_rope_head_dim),
              "v2-lite": mla(16, 512, 64), "v3": mla(128, 512, 64)}
    names = {k: [select_attention_backend("mla", "npu", d, shape=s).name for d in (torch.bfloat16, torch.float32)]
             for k, s in shapes.items()}
    names["llama-small"] = [select_attention_backend("paged", "npu", d, shape=AttentionShape(4, 2, 16)).name
                            for d in (torch.float16, torch.float32)]
    print(names, detect_platform(torch.device("npu", 0)))
""")


@pytest.mark.parametrize("release,v2_lite", [("7.1", "reference"), ("7.3", "npu")])
def test_selected_on_an_npu_device_only_for_shapes_the_operators_take(release, v2_lite):
    """In a process whose privateuse1 device is named npu and where torch_npu imports (the
    stand-in): the built-in small model's MLA goes to reference; V2-Lite's 16 heads from 7.3 on."""
    out = subprocess.run([sys.executable, "-c", SELECTION, str(Path(__file__).parent), release], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str({"small": ["reference", "reference"], "v2-lite": [v2_lite, "reference"],
                                      "v3": ["npu", "reference"], "llama-small": ["npu", "reference"]}) + " npu"


def test_a_named_npu_backend_refusing_the_layer_says_why(monkeypatch):
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
    npu_ops.install(monkeypatch, V72)
    model = DeepseekForCausalLM(DeepseekConfig.small(num_hidden_layers=2), dtype=torch.bfloat16)
    assert model.backends()["attention"] != "npu"
    with pytest.raises(ValueError, match=r"'npu' cannot take this layer: the fused attention takes kv_lora_rank 512 "
                                         r"and qk_rope_head_dim 64 with query_rope, this layer has 32 and 8"):
        model.select_backends(attention="npu")
    big = DeepseekForCausalLM(DeepseekConfig.small(num_hidden_layers=2, num_attention_heads=32, kv_lora_rank=512,
                                                   qk_rope_head_dim=64), dtype=torch.bfloat16)
    assert big.select_backends()["attention"] == "npu"
    assert NpuMLA.refuses(AttentionShape(16, 1, 192, 512, 64, 128)) == (
        "the fused attention with query_rope takes (32, 64, 128) query heads on torch_npu 7.2, this layer has 16")


MLA_NPU = {"num_attention_heads": 32, "kv_lora_rank": 512, "qk_rope_head_dim": 64}  # heads every release takes


def _twin_models(kind, dtype, **sizes):
    """The same seeded weights twice: in ``dtype`` on the npu backend, in float64 on the reference."""
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
    from ascend_graph.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if kind == "mla":
        model = DeepseekForCausalLM(DeepseekConfig.small(num_hidden_layers=2, **sizes))
    else:
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **sizes))
    oracle = copy.deepcopy(model).double().eval()
    oracle.select_backends(attention="reference")
    model = model.to(dtype).eval()
    model.select_backends(attention="npu")
    return model, oracle


@pytest.mark.filterwarnings(ALIASING)
@pytest.mark.parametrize("kind,sizes,place", [("mla", MLA_NPU, "standin-7.1"), ("mla", MLA_NPU, "standin-7.3"),
                                              ("llama", {}, "standin-7.1"),
                                              pytest.param("mla", MLA_NPU, "npu", marks=needs_npu)],
                         ids=["mla-v1-write", "mla-v2-write", "gqa", "mla-npu"])
def test_a_model_on_the_npu_backend_follows_the_float64_model_step_by_step(monkeypatch, kind, sizes, place):
    """Prefills, then batched decodes crossing a block boundary, teacher-forced with the float64
    model's greedy tokens: the npu backend's logits stay within bf16 error of the oracle's."""
    from ascend_graph.config import GraphConfig
    from ascend_graph.runner import GraphRunner
    from runner_helpers import Schedule

    dev = _place(place, monkeypatch)
    model, oracle = _twin_models(kind, torch.bfloat16, **sizes)
    model = model.to(dev)
    assert model.select_backends(attention="npu")["attention"] == "npu"
    geometry = dict(num_blocks=8, max_model_len=2 * S)
    runner = GraphRunner(model, GraphConfig(enabled=False), **geometry, block_size=None)
    ref_runner = GraphRunner(oracle, GraphConfig(enabled=False), **geometry, block_size=S)
    assert runner.block_size == S  # the backend's default
    sched, worst = Schedule(num_blocks=8, block_size=S, seed=1), 0.0
    for s, p in enumerate([[5, 9, 2] * 40, [7] * 100 + [3, 4], [11, 12]]):
        entry = sched.add(s, p, new_tokens=30)
        ref, out = ref_runner.execute([entry]), runner.execute([entry]).cpu()
        worst = max(worst, ((out.double() - ref).abs().max() / ref.abs().max()).item())
        sched.advance([s], [entry], ref)
    for _ in range(30):  # the 120-token prompt crosses the 128-token block inside these steps
        entries = sched.decode_entries()
        if not entries:
            break
        ids = sorted(sched.next_token)
        ref, out = ref_runner.execute(entries), runner.execute(entries).cpu()
        worst = max(worst, ((out.double() - ref).abs().max() / ref.abs().max()).item())
        sched.advance(ids, entries, ref)
    assert worst < 0.05, worst
    # these layers' head sizes (MLA 16 + 64 / value 16, GQA 16) are none TND documents: each of
    # the three prefills ran in torch, counted per layer under that reason, and shown
    (reason, calls), = runner.stats.to_dict()["attention_fallbacks"].items()
    assert calls == 3 and reason.startswith("torch: TND takes query head size 192"), reason
    decodes = [kw for kw in _calls("npu_fused_infer_attention_score") if kw["block_table"] is not None]
    assert decodes and all(len(kw["actual_seq_lengths_kv"]) == kw["query"].shape[0] for kw in decodes)
    assert any(S in range(min(kw["actual_seq_lengths_kv"]), max(kw["actual_seq_lengths_kv"]) + 2) for kw in decodes)
    if kind == "mla":
        assert _calls("npu_kv_rmsnorm_rope_cache_v2" if place == "standin-7.3" else "npu_kv_rmsnorm_rope_cache")


@pytest.mark.filterwarnings(ALIASING)
@pytest.mark.parametrize("backend,kind,place", [
    ("torchair", "mla", "standin-7.1"), ("torchair", "mla", "standin-7.3"), ("npugraph_ex", "mla", "standin-7.3"),
    ("torchair", "llama", "standin-7.1"), ("npugraph_ex", "llama", "standin-7.3"),
    pytest.param("torchair", "mla", "npu", marks=needs_npu),
    pytest.param("npugraph_ex", "mla", "npu", marks=needs_npu)])
def test_graph_mode_on_the_npu_backends_writes_the_caches_and_equals_eager(monkeypatch, backend, kind, place):
    """The runner as on an NPU (fake torchair / npugraph_ex compiling through AOTAutograd as
    torchair does, the stand-in operators inside): every decode step's logits equal the eager
    runner's, and the graph's cache writes reach the runner's own cache tensors (the same
    objects and addresses throughout) equal to the eager runner's caches; one compile per
    capture size, none after warm-up, while every row's context length changes at every step."""
    import ascend_graph.compile as backends
    from npu_fakes import install_fake_npu
    from ascend_graph.config import GraphConfig
    from ascend_graph.runner import GraphRunner
    from runner_helpers import Schedule

    fake = None
    if place != "npu":
        fake = install_fake_npu(monkeypatch)  # then the operators' stand-in as torch_npu, over the fakes' empty one
        monkeypatch.setattr(backends, "detect_platform", lambda device: "npu")
    # the v1 write returns its caches: AOTAutograd's first-call check warns, or raises where $CI is set
    monkeypatch.setattr(torch._functorch.config, "error_on_custom_op_aliasing", False)
    dev = _place(place, monkeypatch)
    model, _ = _twin_models(kind, torch.bfloat16, **(MLA_NPU if kind == "mla" else {}))
    model = model.to(dev)
    close = {} if fake else {"atol": 2e-2, "rtol": 2e-2}  # the same graph, or GE's own kernels
    geometry = dict(num_blocks=8, max_model_len=2 * S)
    config = GraphConfig(enabled=True, backend=backend, capture_sizes=(1, 2, 4), max_batch_size=4)
    runner, eager = GraphRunner(model, config, **geometry), GraphRunner(model, GraphConfig(enabled=False), **geometry)
    caches, addresses = runner.kv_caches, [t.data_ptr() for c in runner.kv_caches for t in c]
    sched = Schedule(num_blocks=8, block_size=S, seed=2)
    for s, p in enumerate([[5, 9, 2] * 40, [7] * 20, [11, 12, 13]]):
        entry = sched.add(s, p, new_tokens=(14, 9, 5)[s])
        logits = runner.execute([entry])
        torch.testing.assert_close(logits, eager.execute([entry]), **close)
        sched.advance([s], [entry], logits)
    npu_ops.RUNS.clear()
    steps = 0
    while sched.next_token:
        ids, entries = sorted(sched.next_token), sched.decode_entries()
        logits = runner.execute(entries)
        torch.testing.assert_close(logits, eager.execute(entries), **close)
        sched.advance(ids, entries, logits)
        steps += 1
    for ours, theirs in zip(runner.kv_caches, eager.kv_caches):  # every live block as eager wrote it
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a[NULL_BLOCK + 1:], b[NULL_BLOCK + 1:], **close)
    assert runner.kv_caches is caches and [t.data_ptr() for c in runner.kv_caches for t in c] == addresses
    stats = runner.stats
    assert stats.graph_steps == steps and stats.recompiles == 0
    if fake is None:
        return  # the real operators' runs are not recorded
    assert len(fake.calls["aot_graphs"]) == 3 and stats.compiles == 3 + len(fake.calls["restarts"])
    if kind == "mla":  # each layer's write in each functionalized graph: v1 kept by its read outputs, v2 functional
        write = "npu_kv_rmsnorm_rope_cache_v2_functional" if _release(place) >= V72 else "npu_kv_rmsnorm_rope_cache"
        assert all(g.code.count(f".{write}.default(") == 2 for g in fake.calls["aot_graphs"])
    graph_lengths = {tuple(r) for r in npu_ops.RUNS if len(r) in (1, 2, 4)}
    assert len(graph_lengths) >= steps  # new lengths every step, the 128-token block crossed among them
    assert any(max(r) > S for r in graph_lengths) and any(0 in r for r in graph_lengths)  # padded rows read nothing


def test_where_torch_refuses_the_v1_writes_aliased_returns_graph_mode_falls_back_loudly(monkeypatch):
    """torch_npu 7.1's write returns the caches it was given; where AOTAutograd's first-call check
    raises on that (``error_on_custom_op_aliasing``, on wherever $CI is set), every capture size
    runs eagerly with the same logits, each failure kept in ``compile_errors`` and warned."""
    import ascend_graph.compile as backends
    from npu_fakes import install_fake_npu
    from ascend_graph.config import GraphConfig
    from ascend_graph.runner import GraphCompileWarning, GraphRunner
    from runner_helpers import Schedule

    install_fake_npu(monkeypatch)
    monkeypatch.setattr(backends, "detect_platform", lambda device: "npu")
    monkeypatch.setattr(torch._functorch.config, "error_on_custom_op_aliasing", True)
    dev = _place("standin-7.1", monkeypatch)
    model = _twin_models("mla", torch.bfloat16, **MLA_NPU)[0].to(dev)
    geometry = dict(num_blocks=4, max_model_len=2 * S)
    runner = GraphRunner(model, GraphConfig(enabled=True, backend="torchair", capture_sizes=(1, 2)), **geometry)
    eager = GraphRunner(model, GraphConfig(enabled=False), **geometry)
    sched = Schedule(num_blocks=4, block_size=S, seed=3)
    entry = sched.add(0, [5, 9, 2] * 4, new_tokens=3)
    logits = runner.execute([entry])
    torch.testing.assert_close(logits, eager.execute([entry]))
    sched.advance([0], [entry], logits)
    with pytest.warns(GraphCompileWarning, match="may not alias any inputs"):
        entries = sched.decode_entries()
        torch.testing.assert_close(runner.execute(entries), eager.execute(entries))
    assert runner.stats.graph_steps == 0 and runner.stats.eager_steps["compile_failed"] == 1
    assert all("may not alias" in e for e in runner.stats.compile_errors.values()) and runner.stats.compile_errors
