"""The npu attention backends end to end on the CPU, over a stand-in for torch_npu's operators
(tests/npu_ops.py: their documented semantics in plain torch). Outputs against float64 oracles
on contiguous copies, cache writes against reference writes, and the exact arguments handed to
torch_npu. Nothing here ran on an NPU."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import npu_ops
from attention_cases import _assert_matches, _new_tokens, _slots, _tables, _write_prefix
from ascend_graph.attention import build_attention_metadata, choose_block_size
from ascend_graph.attention.npu import NpuMLA, NpuPaged, deinterleave
from ascend_graph.attention.oracle import dense_attention, naive_mla
from ascend_graph.kv_cache import KVCache, MLACache, NULL_BLOCK
from ascend_graph.layers import RMSNorm, apply_rope

S = 128  # the NPU's MLA block size
MAX_LEN = 1024


# .ci/npu_check sets ASCEND_GRAPH_REQUIRE_NPU=1: there a missing NPU fails the "npu" cases
REQUIRE_NPU = os.environ.get("ASCEND_GRAPH_REQUIRE_NPU") == "1"
needs_npu = pytest.mark.skipif(not (REQUIRE_NPU or npu_ops.npu_available()), reason="needs an Ascend NPU and torch_npu")
WHERE = ["standin", pytest.param("npu", marks=needs_npu)]


def _place(where, monkeypatch) -> torch.device:
    """The CPU over the stand-in, or an NPU over the real torch_npu (recorded)."""
    if where == "standin":
        npu_ops.install(monkeypatch)
        return torch.device("cpu")
    if not npu_ops.npu_available():
        pytest.fail("ASCEND_GRAPH_REQUIRE_NPU=1, but torch_npu does not import or sees no NPU")
    npu_ops.install_device(monkeypatch)
    return torch.device("npu")


@pytest.fixture(params=WHERE)
def dev(request, monkeypatch):
    return _place(request.param, monkeypatch)


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


@pytest.mark.parametrize("c,r,interleaved", [(512, 64, True), (32, 8, True), (32, 8, False)])
def test_mla_write_equals_the_reference_write_and_padding_touches_only_the_null_block(dev, c, r, interleaved):
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
    NpuMLA().write_latent(on_dev, kv_c.to(dev), k_pe.to(dev), norm.to(dev), cos.to(dev), sin.to(dev), slots.to(dev),
                          interleaved)
    written = _calls("npu_kv_rmsnorm_rope_cache")
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
    for now, old in zip(cache, before):  # every other slot bit-identical; padding only in null slot 0
        untouched = torch.ones(num_blocks * S, dtype=torch.bool)
        untouched[slots[live]] = False
        untouched[NULL_BLOCK * S] = False
        assert torch.equal(now.view(num_blocks * S, -1)[untouched], old.view(num_blocks * S, -1)[untouched])
    fused = written
    assert len(fused) == (1 if (c, r, interleaved) == (512, 64, True) else 0)
    if fused:  # the exact call: both tuple tensors in place, clamped int64 slots, PA mode
        kw = fused[0]
        assert kw["k_cache"] is on_dev.k_pe and kw["ckv_cache"] is on_dev.kv_c
        assert kw["cache_mode"] == "PA" and kw["epsilon"] == 1e-6 and not kw["is_output_kv"]
        assert kw["index"].tolist() == slots.clamp(min=0).tolist() and kw["index"].dtype == torch.int64
        assert kw["kv"].shape == (t, 1, 1, c + r) and kw["cos"].shape == (t, 1, 1, r)
        assert torch.equal(kw["cos"][:, 0, 0].float().cpu(), torch.cat((cos, cos), -1).to(dtype).float())


def test_the_query_rope_matches_the_cached_key_layout(monkeypatch):
    """Every score q_pe . k_pe is what the checkpoint's own rope gives (the permutation cancels)."""
    npu_ops.install(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, 3, 64, generator=gen, dtype=torch.float64), torch.randn(5, 1, 64, generator=gen, dtype=torch.float64)
    angles = torch.rand(5, 32, generator=gen, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    ref = (apply_rope(q, cos, sin) * apply_rope(k, cos, sin)).sum(-1)
    ours = (NpuMLA().rope_query(q, cos, sin, True) * deinterleave(apply_rope(k, cos, sin))).sum(-1)
    torch.testing.assert_close(ours, ref)
    assert not torch.allclose(NpuMLA().rope_query(q, cos, sin, True), apply_rope(q, cos, sin))  # a real permutation


@pytest.mark.parametrize("dims", [(4, 16, 8, 16, 32), (16, 128, 64, 128, 512)], ids=["small", "v2-lite"])
def test_mla_decode_and_prefill_equal_the_float64_oracle(dev, dims):
    h, dn, r, dv, c = dims
    gen = torch.Generator().manual_seed(2)
    dtype, num_blocks = torch.bfloat16, 24
    lens = [1, S, S + 1, 300, 77]
    tables = _tables(gen, lens, num_blocks, S)
    seqs = [(torch.randn(n, 1, c, generator=gen).to(dtype), torch.randn(n, 1, r, generator=gen).to(dtype)) for n in lens]
    cache = _mla_cache(num_blocks, c, r, dtype, dev)
    w_uk, w_uv = (torch.randn(h, d, c, generator=gen).div(math.sqrt(c)).to(dtype) for d in (dn, dv))
    on = lambda *ts: [t.to(dev) for t in ts]  # noqa: E731
    scale = 1 / math.sqrt(dn + r)
    # decode: each row's last token is the query; a padded row (context 0, null block) reads nothing
    _write_prefix(cache, tables, [on(*x) for x in seqs], lens, S)
    pos, meta = _meta(tables, [n - 1 for n in lens], [1] * len(lens), num_blocks, dev, width=MAX_LEN // S)
    from ascend_graph.attention.metadata import pad_decode
    _, meta = pad_decode(pos, meta, len(lens) + 2)
    q_nope = torch.randn(len(lens) + 2, h, dn, generator=gen).to(dtype)
    q_pe = torch.randn(len(lens) + 2, h, r, generator=gen).to(dtype)
    out = NpuMLA().decode(*on(q_nope, q_pe), cache, meta.decode, *on(w_uk, w_uv), scale).cpu()
    for i, (kv, pe) in enumerate(seqs):
        ref = naive_mla(q_nope[i:i + 1], q_pe[i:i + 1], kv[:, 0], pe[:, 0], w_uk, w_uv, scale)
        _close(out[i:i + 1], ref, 2e-2)
    assert torch.isfinite(out[len(lens):]).all()
    kw = _calls("npu_fused_infer_attention_score")[-1]
    assert kw["actual_seq_lengths_kv"] == lens + [0, 0] and kw["block_table"] is meta.decode.block_tables
    assert kw["input_layout"] == "BNSD" and kw["num_key_value_heads"] == 1 and kw["block_size"] == S
    assert kw["key"] is kw["value"] and kw["key"].data_ptr() == cache.kv_c.data_ptr()  # in place, no copy
    assert kw["key_rope"].data_ptr() == cache.k_pe.data_ptr() and kw["num_heads"] == h and kw["scale"] == scale

    # prefill with cached context: the new tokens after a cached prefix, bottom-right causal
    cached, new = [0, S - 3, 200], [5, 9, 100]
    ctx = [a + b for a, b in zip(cached, new)]
    tables = _tables(gen, ctx, num_blocks, S)
    seqs = [(torch.randn(n, 1, c, generator=gen).to(dtype), torch.randn(n, 1, r, generator=gen).to(dtype)) for n in ctx]
    cache = _mla_cache(num_blocks, c, r, dtype, dev)
    _write_prefix(cache, tables, [on(*x) for x in seqs], ctx, S)
    _, meta = _meta(tables, cached, new, num_blocks, dev)
    qn = torch.randn(sum(new), h, dn, generator=gen).to(dtype)
    qp = torch.randn(sum(new), h, r, generator=gen).to(dtype)
    out = NpuMLA().prefill(*on(qn, qp), cache, meta.prefill, *on(w_uk, w_uv), scale).cpu()
    start = 0
    for (kv, pe), q_len in zip(seqs, new):
        ref = naive_mla(qn[start:start + q_len], qp[start:start + q_len], kv[:, 0], pe[:, 0], w_uk, w_uv, scale)
        _close(out[start:start + q_len], ref, 2e-2)
        start += q_len
    kw = _calls("npu_fused_infer_attention_score")[-1]
    assert kw["input_layout"] == "TND" and kw["sparse_mode"] == 3 and kw["block_table"] is None
    assert kw["actual_seq_lengths"] == [5, 14, 114] and kw["actual_seq_lengths_kv"] == [5, 5 + S + 6, 5 + S + 6 + 300]


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2)])
def test_gqa_write_decode_and_prefill_equal_the_float64_oracle(dev, hq, hk):
    gen = torch.Generator().manual_seed(3)
    dtype, d, num_blocks = torch.float16, 32, 16
    lens = [1, S, S + 1, 250]
    tables = _tables(gen, lens, num_blocks, S)
    seqs = [(torch.randn(n, hk, d, generator=gen).to(dtype), torch.randn(n, hk, d, generator=gen).to(dtype)) for n in lens]
    cache = KVCache(torch.randn(num_blocks, S, hk, d, generator=gen).to(dtype),
                    torch.randn(num_blocks, S, hk, d, generator=gen).to(dtype))
    before = [x.clone() for x in cache]
    cache = KVCache(*(x.to(dev) for x in cache))
    backend, scale = NpuPaged(), 1 / math.sqrt(d)
    # write every token through the backend (npu_scatter_nd_update_), a padding slot among them
    slots = torch.tensor([s for t, n in zip(tables, lens) for s in _slots(t, 0, n, S)] + [-1])
    k_new = torch.cat([k for k, _ in seqs] + [torch.ones(1, hk, d, dtype=dtype)])
    v_new = torch.cat([v for _, v in seqs] + [torch.ones(1, hk, d, dtype=dtype)])
    backend.write(cache, k_new.to(dev), v_new.to(dev), slots.to(dev))
    for now, old, new in zip(cache, before, (k_new, v_new)):
        flat, flat_old = now.cpu().view(-1, hk, d), old.view(-1, hk, d)
        assert torch.equal(flat[slots[:-1]], new[:-1])
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots[:-1]] = False
        untouched[NULL_BLOCK * S] = False
        assert torch.equal(flat[untouched], flat_old[untouched])
        assert torch.equal(flat[NULL_BLOCK * S], new[-1])  # the padding row's write: the null block's slot 0
    pos, meta = _meta(tables, [n - 1 for n in lens], [1] * len(lens), num_blocks, dev, width=MAX_LEN // S)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    out = backend.decode(q.to(dev), cache, meta.decode, scale).cpu()
    for i, (k, v) in enumerate(seqs):
        _close(out[i:i + 1], dense_attention(q[i:i + 1], k, v, scale), 1e-2)
    kw = _calls("npu_fused_infer_attention_score")[-1]
    assert kw["input_layout"] == "BSH" and kw["num_heads"] == hq and kw["num_key_value_heads"] == hk
    assert kw["key"].data_ptr() == cache.k.data_ptr() and kw["value"].data_ptr() == cache.v.data_ptr()
    assert kw["actual_seq_lengths_kv"] == lens and kw["query"].shape == (len(lens), 1, hq * d)
    # prefill: the last 3 tokens of each sequence after their cached prefix
    _, meta = _meta(tables, [n - 3 if n > 3 else 0 for n in lens], [3 if n > 3 else n for n in lens], num_blocks, dev)
    new = [3 if n > 3 else n for n in lens]
    decodes = sum(1 for n in new if n == 1)
    q = torch.randn(sum(new[decodes:]), hq, d, generator=gen).to(dtype)
    out = backend.prefill(q.to(dev), cache, meta.prefill, scale).cpu()
    start = 0
    for (k, v), q_len in zip(seqs[decodes:], new[decodes:]):
        _close(out[start:start + q_len], dense_attention(q[start:start + q_len], k, v, scale), 1e-2)
        start += q_len


def test_the_npu_block_sizes_and_an_engine_default_of_128(dev):
    assert choose_block_size([NpuMLA()]) == 128 and choose_block_size([NpuPaged()]) == 128
    assert choose_block_size([NpuPaged()], 64) == 64
    with pytest.raises(ValueError, match="block_size=16 is not taken by the 'npu' attention backend"):
        choose_block_size([NpuMLA()], 16)
    with pytest.raises(ValueError, match="block_size=24 is not taken"):
        choose_block_size([NpuPaged()], 24)
    assert choose_block_size([]) == 16


def test_selected_automatically_on_an_npu_device(tmp_path):
    """In a process whose privateuse1 device is named npu and where torch_npu imports (the stand-in)."""
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        import npu_ops
        torch.utils.rename_privateuse1_backend("npu")
        sys.modules["torch_npu"] = npu_ops.module()
        from ascend_graph.attention import select_attention_backend
        from ascend_graph.compile import detect_platform
        names = [select_attention_backend(k, "npu", d).name for k in ("mla", "paged")
                 for d in (torch.bfloat16, torch.float16, torch.float32)]
        print(names, detect_platform(torch.device("npu", 0)))
    """)
    tests_dir = str(__import__("pathlib").Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", code, tests_dir], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("]")[0] + "]" == str(["npu", "npu", "reference"] * 2)
    assert out.stdout.strip().endswith("npu")


def _twin_models(kind, dtype, **sizes):
    """The same seeded weights twice: in ``dtype`` on the npu backend, in float64 on the reference."""
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
    from ascend_graph.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if kind == "mla":
        model = DeepseekForCausalLM(DeepseekConfig.small(num_hidden_layers=2, **sizes))
    else:
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **sizes))
    oracle = __import__("copy").deepcopy(model).double().eval()
    oracle.select_backends(attention="reference")
    model = model.to(dtype).eval()
    model.select_backends(attention="npu")
    return model, oracle


@pytest.mark.parametrize("kind,sizes", [("mla", {}), ("mla", {"kv_lora_rank": 512, "qk_rope_head_dim": 64}),
                                        ("llama", {})], ids=["mla-small", "mla-fused-write", "gqa"])
def test_a_model_on_the_npu_backend_follows_the_float64_model_step_by_step(dev, kind, sizes):
    """Prefills, then batched decodes crossing a block boundary, teacher-forced with the float64
    model's greedy tokens: the npu backend's logits stay within bf16 error of the oracle's."""
    from ascend_graph.config import GraphConfig
    from ascend_graph.runner import GraphRunner, SequenceStep
    from runner_helpers import Schedule

    model, oracle = _twin_models(kind, torch.bfloat16, **sizes)
    model = model.to(dev)
    model.select_backends(attention="npu")
    geometry = dict(num_blocks=8, max_model_len=2 * S)
    runner = GraphRunner(model, GraphConfig(enabled=False), **geometry, block_size=None)
    ref_runner = GraphRunner(oracle, GraphConfig(enabled=False), **geometry, block_size=S)
    assert runner.block_size == S  # the backend's default
    sched = Schedule(num_blocks=8, block_size=S, seed=1)
    prompts = [[5, 9, 2] * 40, [7] * 100 + [3, 4], [11, 12]]
    worst = 0.0
    for s, p in enumerate(prompts):
        entry = sched.add(s, p, new_tokens=30)
        ref, out = ref_runner.execute([entry]), runner.execute([entry]).cpu()
        worst = max(worst, ((out.double() - ref).abs().max() / ref.abs().max()).item())
        sched.advance([s], [entry], ref)
    fused = len(_calls("npu_kv_rmsnorm_rope_cache"))
    for _ in range(30):  # the 120-token prompt crosses the 128-token block inside these steps
        entries = sched.decode_entries()
        if not entries:
            break
        ids = sorted(sched.next_token)
        ref, out = ref_runner.execute(entries), runner.execute(entries).cpu()
        worst = max(worst, ((out.double() - ref).abs().max() / ref.abs().max()).item())
        sched.advance(ids, entries, ref)
    assert worst < 0.05, worst
    decodes = [kw for kw in _calls("npu_fused_infer_attention_score") if kw["block_table"] is not None]
    assert decodes and all(len(kw["actual_seq_lengths_kv"]) == kw["query"].shape[0] for kw in decodes)
    assert any(S in range(min(kw["actual_seq_lengths_kv"]), max(kw["actual_seq_lengths_kv"]) + 2) for kw in decodes)
    if sizes.get("kv_lora_rank") == 512:
        assert len(_calls("npu_kv_rmsnorm_rope_cache")) > fused


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("backend", ["torchair", "npugraph_ex"])
@pytest.mark.parametrize("kind,sizes", [("mla", {"kv_lora_rank": 512, "qk_rope_head_dim": 64}), ("llama", {})],
                         ids=["mla", "gqa"])
def test_graph_mode_on_the_npu_backends_equals_eager_with_no_recompile_across_lengths(monkeypatch, where, backend,
                                                                                       kind, sizes):
    """The runner as on an NPU (fake torchair / npugraph_ex running dynamo's graph as it is, the
    stand-in operators inside it): every decode step's logits equal the eager runner's on the same
    schedule; one compile per capture size, none after warm-up, while every row's context length
    changes at every step (the fused attention's host lengths stay symbolic)."""
    import ascend_graph.compile as backends
    from npu_fakes import install_fake_npu
    from ascend_graph.config import GraphConfig
    from ascend_graph.runner import GraphRunner
    from runner_helpers import Schedule

    if where == "standin":
        install_fake_npu(monkeypatch)  # then the operators' stand-in as torch_npu, over the fakes' empty one
        monkeypatch.setattr(backends, "detect_platform", lambda device: "npu")
    dev = _place(where, monkeypatch)
    model, _ = _twin_models(kind, torch.bfloat16, **sizes)
    model = model.to(dev)
    model.select_backends(attention="npu")
    close = {} if where == "standin" else {"atol": 2e-2, "rtol": 2e-2}  # the same graph, or GE's own kernels
    geometry = dict(num_blocks=8, max_model_len=2 * S)
    config = GraphConfig(enabled=True, backend=backend, capture_sizes=(1, 2, 4), max_batch_size=4)
    runner, eager = GraphRunner(model, config, **geometry), GraphRunner(model, GraphConfig(enabled=False), **geometry)
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
    stats = runner.stats
    assert stats.graph_steps == steps and stats.compiles == 3 and stats.recompiles == 0
    if where == "npu":
        return  # the real operators' runs are not recorded
    graph_lengths = {tuple(r) for r in npu_ops.RUNS if len(r) in (1, 2, 4)}
    assert len(graph_lengths) >= steps  # new lengths every step, the 128-token block crossed among them
    assert any(max(r) > S for r in graph_lengths) and any(0 in r for r in graph_lengths)  # padded rows read nothing
