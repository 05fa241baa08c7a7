"""The graph runner: dispatch, padding, recompile and address checks, fallback, parity.

Oracles: the eager path of the same runner on the same caches (``compare_step``), and a
separate runner with graph mode off that follows the same schedule on its own caches.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from runner_helpers import (BLOCK_SIZE, NUM_BLOCKS, KernelCalls, Schedule, assert_graph_outputs_are_fresh,
                            make_runner, prefilled, small_model)

from ascend_graph.config import GraphConfig, InductorOptions
from ascend_graph.runner.parity import compare_step
from ascend_graph.runner import GraphCompileError, GraphCompileWarning, RecompileError, SequenceStep
from ascend_graph.runtime import StaticAddressError

SIZES = (1, 2, 4)


def graph_config(**kw) -> GraphConfig:
    base = dict(enabled=True, backend="aot_eager", capture_sizes=SIZES, max_batch_size=max(SIZES))
    return GraphConfig(**{**base, **kw})


def inductor_config(**kw) -> GraphConfig:
    """Inductor at capture sizes 1 and 4: a compiled step has a batch-1 form (one-row products as
    reductions) and one for 2-64 rows (``rows_mm``, whose row counts ``test_expert_rows`` covers);
    batches 2 and 3 run padded to 4. Each size is a compile of its own (25 s cold on a Zen 3)."""
    return graph_config(**{"backend": "inductor", "capture_sizes": (1, 4), "max_batch_size": 4, **kw})


def snapshot(runner) -> list[list[torch.Tensor]]:
    return [[t.clone() for t in cache] for cache in runner.kv_caches]


def assert_caches_equal(runner, saved) -> None:
    for cache, layer in zip(runner.kv_caches, saved):
        for t, s in zip(cache, layer):
            assert torch.equal(t, s)


def test_capture_records_per_size_whether_it_was_compiled_or_loaded_from_the_compile_cache(tmp_path):
    """Two runners on one model and one cache directory: the first compiles the size, the second
    loads it from Inductor's cache (precompile off: test_precompile has that path); the debug
    backend has no Inductor cache to ask."""
    model = small_model("llama", layers=1)
    config = graph_config(backend="inductor", capture_sizes=(2,), max_batch_size=2, compile_cache_dir=str(tmp_path),
                          inductor=InductorOptions(precompile=False))
    outcomes = []
    for _ in range(2):
        runner = make_runner(model, config)
        runner.capture(show_progress=False)
        assert runner.stats.compiles == 1 and runner.stats.capture[2]["seconds"] > 0
        outcomes.append(runner.stats.to_dict()["capture"]["2"]["compile_cache"])
    assert outcomes == ["miss", "hit"]
    debug = make_runner(model, graph_config(capture_sizes=(2,), max_batch_size=2))
    debug.capture(show_progress=False)
    assert debug.stats.capture[2]["compile_cache"] is None


@pytest.mark.parametrize("n", [1, 3, 4, 6])
def test_dispatch_graph_for_decode_within_sizes_and_eager_above(n):
    model = small_model("llama")
    runner, sched = make_runner(model, graph_config()), Schedule()
    prefilled(runner, sched, n, model.config.vocab_size)
    runner.execute(sched.decode_entries())
    assert runner.stats.eager_steps["prefill"] == n
    if n <= max(SIZES):
        assert runner.stats.graph_steps == 1 and runner.stats.eager_steps["oversize"] == 0
    else:
        assert runner.stats.graph_steps == 0 and runner.stats.eager_steps["oversize"] == 1


def decode_tensors(entries: list[SequenceStep], width: int, fill: int = 0) -> tuple[torch.Tensor, ...]:
    """``entries`` (decode rows) as vLLM hands them over: int32 token ids, lengths after the step
    and ``[n, width]`` block tables (columns past a row's blocks hold ``fill``), int64 slots."""
    tables = torch.full((len(entries), width), fill, dtype=torch.int32)
    for i, e in enumerate(entries):
        tables[i, :len(e.block_table)] = torch.tensor(list(e.block_table), dtype=torch.int32)
    slots = [e.block_table[e.num_cached // BLOCK_SIZE] * BLOCK_SIZE + e.num_cached % BLOCK_SIZE for e in entries]
    return (torch.tensor([e.token_ids[0] for e in entries], dtype=torch.int32),
            torch.tensor([e.num_cached + 1 for e in entries], dtype=torch.int32), tables, torch.tensor(slots))


@pytest.mark.parametrize("n", [1, 3, 4, 6])
def test_execute_decode_of_tensors_equals_execute_of_sequence_steps(n):
    """Two runners over one model follow one schedule, one through ``execute``, one through
    ``execute_decode``: equal logits, equal caches, equal counters (3 rows padded to the size-4
    graph, 6 oversize and eager)."""
    model = small_model("mla")
    runners = [make_runner(model, graph_config()) for _ in range(2)]
    scheds = [Schedule(), Schedule()]
    for runner, sched in zip(runners, scheds):
        prefilled(runner, sched, n, model.config.vocab_size)
    for _ in range(3):
        entries = scheds[0].decode_entries()
        assert entries == scheds[1].decode_entries()
        want = runners[0].execute(entries)
        got = runners[1].execute_decode(*decode_tensors(entries, runners[1].table_width))
        assert torch.equal(got, want)
        for sched, logits in zip(scheds, (want, got)):
            sched.advance(list(range(n)), entries, logits)
    assert_caches_equal(runners[1], snapshot(runners[0]))
    counters = [{k: v for k, v in r.stats.to_dict().items() if not k.startswith("capture")} for r in runners]
    assert counters[1] == counters[0]
    assert runners[1].stats.graph_steps == (3 if n <= max(SIZES) else 0)


def test_execute_decode_reads_only_the_blocks_each_length_needs():
    """Block tables narrower than the runner's (as wide as the longest row needs) and wider, with
    another row's written block past each row's blocks (vLLM's rows keep earlier requests' ids): the
    same logits as zero-filled full-width tables, each on the same caches (one step repeated
    writes the same entries)."""
    model = small_model("mla")
    runner, sched = make_runner(model, graph_config()), Schedule()
    prefilled(runner, sched, 3, model.config.vocab_size)
    entries = sched.decode_entries()
    ids, lens, tables, slots = decode_tensors(entries, runner.table_width)
    want = runner.execute_decode(ids, lens, tables, slots)
    needed = max(len(e.block_table) for e in entries)
    assert needed < runner.table_width
    narrow = tables[:, :needed].contiguous()
    wide = decode_tensors(entries, runner.table_width + 3, fill=entries[0].block_table[0])[2]
    for other in (narrow, wide):
        assert torch.equal(runner.execute_decode(ids, lens, other, slots), want)
    assert runner.stats.graph_steps == 3


def test_execute_decode_bad_input_raises_before_any_write():
    model = small_model("llama")
    runner, sched = make_runner(model, graph_config()), Schedule()
    prefilled(runner, sched, 2, 256)
    before = snapshot(runner)
    good = decode_tensors(sched.decode_entries(), runner.table_width)
    ids, lens, tables, slots = good
    null_slot, taken = slots.clone(), slots.clone()
    null_slot[0], taken[1] = 1, slots[0]
    far = tables.clone()
    far[0, 0] = NUM_BLOCKS
    bad = {
        r"token_ids\[1\]=256": (ids + torch.tensor([0, 256 - ids[1]], dtype=torch.int32), lens, tables, slots),
        r"token_ids must be an integer tensor": (ids.float(), lens, tables, slots),
        r"context_lens\[0\]=0 must lie in \[1, 64\]": (ids, lens * 0, tables, slots),
        r"context_lens must be an integer tensor .* got torch.int32 \[3\]": (ids, torch.cat([lens, lens[:1]]), tables, slots),
        r"slot_mapping\[0\]=1 lies in the reserved null block": (ids, lens, tables, null_slot),
        r"slot_mapping\[1\]=.* is also slot_mapping\[0\]": (ids, lens, tables, taken),
        r"slot_mapping\[0\]=.* is out of range": (ids, lens, tables, slots + NUM_BLOCKS * BLOCK_SIZE),
        r"slot_mapping must hold each row's slot": (ids, lens, tables, slots * 0 - 1),
        r"block_tables holds block ids in \[.*, 96\]": (ids, lens, far, slots),
        r"block_tables has 1 columns; the longest row needs": (ids, lens, tables[:, :1], slots),
        r"token_ids must be an integer tensor .* got torch.int32 \[\]": (ids[0], lens, tables, slots),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=message):
            runner.execute_decode(*args)
        assert_caches_equal(runner, before)
    assert runner.stats.graph_steps == 0


def test_execute_decode_runs_the_parity_check_at_the_configured_interval():
    model = small_model("llama")
    runner, sched = make_runner(model, graph_config(parity_interval=2)), Schedule()
    prefilled(runner, sched, 2, 256)
    for _ in range(4):
        entries = sched.decode_entries()
        sched.advance([0, 1], entries, runner.execute_decode(*decode_tensors(entries, runner.table_width)))
    assert runner.stats.graph_steps == 4
    assert runner.stats.parity_checks == 2 and runner.stats.parity_failures == 0


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_graph_logits_are_not_overwritten_by_the_next_step(backend):
    """3 rows in a size-4 graph, twice: the runner hands CPU graph logits out without a copy."""
    model = small_model("llama")
    runner, sched = make_runner(model, graph_config(backend=backend, capture_sizes=(4,), max_batch_size=4)), Schedule()
    prefilled(runner, sched, 3, model.config.vocab_size)
    assert not runner._copy_logits
    assert_graph_outputs_are_fresh(runner, sched, [0, 1, 2])


def test_mixed_batch_and_disabled_graph_mode_run_eager_with_reasons():
    model = small_model("llama")
    runner, sched = make_runner(model, graph_config()), Schedule()
    prefilled(runner, sched, 2, model.config.vocab_size)
    mixed = sched.decode_entries() + [sched.add(9, [1, 2, 3], 1)]
    runner.execute(mixed)
    assert runner.stats.eager_steps["mixed"] == 1 and runner.stats.graph_steps == 0

    off = make_runner(model, GraphConfig(enabled=False))
    sched = Schedule()
    prefilled(off, sched, 2, model.config.vocab_size)
    off.execute(sched.decode_entries())
    assert off.stats.eager_steps == {"prefill": 2, "disabled": 1} and off.stats.compiles == 0


def test_padded_rows_leave_live_blocks_untouched():
    model = small_model("llama")
    runner, sched = make_runner(model, graph_config()), Schedule()
    prefilled(runner, sched, 3, model.config.vocab_size)  # 3 rows run on the size-4 graph
    entries = sched.decode_entries()
    written = {e.block_table[e.num_cached // 4] for e in entries}
    before = snapshot(runner)
    runner.execute(entries)
    assert runner.stats.graph_steps == 1
    for cache, layer in zip(runner.kv_caches, before):
        for t, s in zip(cache, layer):
            for block in range(1, t.shape[0]):  # every block but the null block 0
                if block not in written:
                    assert torch.equal(t[block], s[block]), f"block {block} changed"


def test_padding_rows_after_a_larger_batch_do_not_replay_its_rows():
    """Size-2 graph: a batch of 2 (Z, X), then X's block goes to a new sequence Y, then Z alone
    runs padded. The padding row (row 1) must not repeat X's row: its write would land in Y's block."""
    model = small_model("llama")
    runner = make_runner(model, graph_config(capture_sizes=(2,), max_batch_size=2))
    x, y, z = [5, 6, 7], [9, 10, 11, 12], [13, 14, 15]
    for prompt, table in ((x, [1]), (z, [2])):
        runner.execute([SequenceStep(prompt, 0, [table[0]])])
    runner.execute([SequenceStep([16], 3, [2]), SequenceStep([8], 3, [1])])  # row 1: X writes slot 1*4 + 3
    runner.execute([SequenceStep(y, 0, [1])])  # X finished; Y's prefill fills block 1, slot 7 included
    before = snapshot(runner)
    runner.execute([SequenceStep([17], 4, [2, 3])])  # Z alone: one padding row, writes block 3 only
    assert runner.stats.graph_steps == 2
    for cache, layer in zip(runner.kv_caches, before):
        for t, saved in zip(cache, layer):
            assert torch.equal(t[1], saved[1]), "Y's block 1 was written by a padding row"


def test_long_run_has_no_recompiles_after_warmup_and_expected_split():
    model = small_model("llama")
    graph, eager = make_runner(model, graph_config()), make_runner(model, GraphConfig(enabled=False))
    graph.capture(show_progress=False)
    compiles_after_warmup = graph.stats.compiles
    sched, expected = Schedule(seed=0), {"graph": 0, "prefill": 0, "oversize": 0}
    next_id, sizes_seen = 0, set()
    for step in range(60):
        join = step < 45 and (not sched.next_token or sched.rng.random() < 0.4)
        if join:
            ids, entries = [next_id], [sched.add(next_id, sched.random_prompt(256), sched.rng.randint(2, 12))]
            next_id += 1
            expected["prefill"] += 1
        else:
            ids, entries = sorted(sched.next_token), sched.decode_entries()
            if not entries:
                continue
            expected["graph" if len(entries) <= max(SIZES) else "oversize"] += 1
            sizes_seen.add(len(entries))
        logits = graph.execute(entries)
        torch.testing.assert_close(logits, eager.execute(entries), atol=1e-4, rtol=1e-4)
        sched.advance(ids, entries, logits)
    stats = graph.stats
    assert stats.recompiles == 0 and stats.compiles == compiles_after_warmup == len(SIZES)
    assert stats.graph_steps == expected["graph"] and stats.graph_steps >= 20
    assert dict(stats.eager_steps) == {k: v for k, v in expected.items() if k != "graph" and v}
    assert {1, 2, 3, 4} <= sizes_seen and max(sizes_seen) > max(SIZES)


def test_recompile_after_warmup_raises_or_warns(caplog):
    model = small_model("llama")
    for policy in ("error", "warn"):
        runner, sched = make_runner(model, graph_config(on_recompile=policy)), Schedule()
        prefilled(runner, sched, 1, 256)
        runner.execute(sched.decode_entries())
        # A guarded Python attribute of the model changes: dynamo must compile the step again.
        runner.model.layers[0].self_attn.cfg = type(model.config)(rope_theta=5000.0)
        if policy == "error":
            with pytest.raises(RecompileError, match="compiled again after warm-up"):
                runner.execute(sched.decode_entries())
        else:
            with caplog.at_level(logging.WARNING, logger="ascend_graph.runner"):
                runner.execute(sched.decode_entries())
            assert runner.stats.recompiles == 1 and "compiled again" in caplog.text
        model = small_model("llama")


def failing_backend(gm, example_inputs, **kwargs):
    raise RuntimeError("simulated compiler failure")


def test_compile_failure_falls_back_to_eager_with_a_warning_naming_the_exception_or_raises():
    """Each failed size is a GraphCompileWarning with the compiler's exception (not dynamo's
    wrapper), counted, and kept per size in the stats; with the fallback off it raises, unwarned."""
    error = "RuntimeError: simulated compiler failure"
    model = small_model("llama")
    runner, sched = make_runner(model, graph_config(), backend=failing_backend), Schedule()
    with pytest.warns(GraphCompileWarning) as caught:
        runner.capture(show_progress=False)
    assert [str(w.message) for w in caught if w.category is GraphCompileWarning] == [
        f"compiling capture size {s} failed, that size runs eagerly: {error}" for s in (4, 2, 1)]
    assert runner.stats.compile_failures == len(SIZES) and runner.graph_sizes == ()
    assert runner.stats.to_dict()["compile_errors"] == {"4": error, "2": error, "1": error}
    prefilled(runner, sched, 2, 256)
    runner.execute(sched.decode_entries())
    assert runner.stats.eager_steps["compile_failed"] == 1 and runner.stats.graph_steps == 0

    strict = make_runner(model, graph_config(fallback_on_compile_error=False), backend=failing_backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphCompileWarning)
        with pytest.raises(GraphCompileError, match=f"capture size 4 failed: {error}"):
            strict.capture(show_progress=False)
    assert strict.stats.compile_errors == {4: error} and strict.stats.compile_failures == 1


def test_a_failed_shared_compile_warns_and_names_its_group():
    from test_compile_groups import config as group_config, fails_on_a_dynamic_batch

    runner = make_runner(small_model("llama"), group_config(), backend=fails_on_a_dynamic_batch)
    with pytest.warns(GraphCompileWarning, match="shared compile of sizes 2-4 failed, they compile one by one: "
                                                 "RuntimeError: simulated: no dynamic shapes here"):
        runner.capture(show_progress=False)
    assert runner.stats.to_dict()["compile_errors"] == {"2-4": "RuntimeError: simulated: no dynamic shapes here"}
    assert runner.graph_sizes == (1, 2, 4)


def test_moved_cache_tensor_is_detected_by_name():
    model = small_model("llama")
    runner, sched = make_runner(model, graph_config()), Schedule()
    prefilled(runner, sched, 1, 256)
    runner.kv_caches[1].v.data = torch.zeros_like(runner.kv_caches[1].v)
    with pytest.raises(StaticAddressError, match=r"kv_caches\[1\]\.v moved"):
        runner.execute(sched.decode_entries())


def test_bad_step_input_raises_before_any_write():
    model = small_model("llama")
    runner, sched = make_runner(model, graph_config()), Schedule()
    prefilled(runner, sched, 2, 256)
    before = snapshot(runner)
    good = sched.decode_entries()
    bad_batches = {
        "token_ids": [SequenceStep([256], good[0].num_cached, good[0].block_table)],
        "out of range": [SequenceStep([1], good[0].num_cached, [999] * len(good[0].block_table))],
        "max_model_len": [SequenceStep([1], 64, list(range(1, 18)))],
        "at least one": [],
    }
    for message, batch in bad_batches.items():
        with pytest.raises(ValueError, match=message):
            runner.execute(batch)
        assert_caches_equal(runner, before)


def test_parity_sampling_runs_at_the_configured_interval():
    model = small_model("llama")
    runner, sched = make_runner(model, graph_config(parity_interval=2)), Schedule()
    prefilled(runner, sched, 2, 256)
    for _ in range(5):
        entries = sched.decode_entries()
        sched.advance([0, 1], entries, runner.execute(entries))
    assert runner.stats.graph_steps == 5
    assert runner.stats.parity_checks == 2 and runner.stats.parity_failures == 0


@pytest.mark.parametrize("kind", ["llama", "mla", "mla_long_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_graph_equals_eager_for_every_size_and_between(kind, dtype):
    model = small_model(kind, dtype)
    runner = make_runner(model, inductor_config())
    sched = Schedule()
    prefilled(runner, sched, 4, model.config.vocab_size)
    for n in (1, 2, 3, 4):
        report = compare_step(runner, sched.decode_entries()[:n])
        assert report.ok and report.untouched_ok, report.summary()
    assert runner.stats.recompiles == 0


def test_inductor_graph_equals_eager_at_batches_that_run_the_wide_matmul_form():
    """bfloat16 at 21 and 32 rows: the compiled step's dense products run ``rows_mm``'s wide form
    (``ascend_graph/kernels/csrc/``; aten in eager), padded and full. A dense model: in the
    small MoE model, eager's own routing at 32 tokens has near-ties (0.0005 between the 2nd and
    3rd expert's score), and graph and eager differ past the bf16 tolerance there with aten too."""
    from ascend_graph import kernels

    model = small_model("llama", torch.bfloat16)
    runner = make_runner(model, graph_config(backend="inductor", capture_sizes=(32,), max_batch_size=32))
    sched = Schedule()
    prefilled(runner, sched, 32, model.config.vocab_size)
    with KernelCalls() as calls:
        for n in (21, 32):
            report = compare_step(runner, sched.decode_entries()[:n])
            assert report.ok and report.untouched_ok, report.summary()
    assert runner.stats.recompiles == 0
    rows_mm_rows = {x[0] for x in calls.shapes("rows_mm", 0)}
    assert rows_mm_rows == ({32} if kernels.available() else set())  # graph mode only, padded to 32


@pytest.mark.parametrize("attention", ["cpu_kernel", "reference"])
def test_inductor_graph_equals_eager_with_mla_attention_products_in_the_kernel(attention):
    """bfloat16 MLA decode at 1-4 rows, with a pass that takes this small model's products. The
    cpu_kernel attention backend runs ``decode_attention`` (scores of the latent and rope parts,
    softmax, values by the latent rows) over the cache blocks where they lie, in eager and graph
    steps alike, at batch 1 too. The reference
    backend multiplies gathered rows: compiled, the pass runs those products as ``expert_rows_mm``
    (one "expert" per sequence) and ``rows_bmm``, where aten's bf16 is native (where it is emulated,
    as on AVX2, they are float32 products: ``paging.float32_products``). Both: the output by ``W_UV`` and the queries by
    ``W_UK`` with ``expert_rows_mm`` (one "expert" per head) in the graph, aten's ``bmm`` in eager.
    Graph equals eager."""
    from ascend_graph import kernels
    from ascend_graph.attention.paging import aten_bf16_emulated

    paged = attention == "cpu_kernel"
    if paged and not kernels.available():
        pytest.skip("the CPU kernel does not build here")

    from ascend_graph.compile.inductor import InductorBackend, config_patches
    from ascend_graph.compile.passes.decode_matmul import DecodeMatmulPass
    from ascend_graph.compile.passes.inline_writes import INLINE_CACHE_WRITES

    model = small_model("mla", torch.bfloat16)
    model.select_backends(attention=attention)
    config = inductor_config()
    on = kernels.available()
    # this model's attention products are below batched_limits(): a pass that takes them
    small = DecodeMatmulPass(batched_min_elements=1)
    backend = InductorBackend({**config_patches(config, "cpu"), "post_grad_custom_post_pass": small},
                              inline_writes=INLINE_CACHE_WRITES["cpu"])
    runner = make_runner(model, config, backend=backend)
    sched = Schedule()
    prefilled(runner, sched, 4, model.config.vocab_size)
    runner.capture(show_progress=False)  # every size's warm-up runs before anything is counted
    with KernelCalls() as first:
        report = compare_step(runner, sched.decode_entries()[:1])  # batch 1: in place too, or aten's mm
    assert report.ok and report.untouched_ok, report.summary()
    pages = first.shapes("decode_attention", 2)
    assert len(pages) == (2 * model.config.num_hidden_layers if on and paged else 0), pages  # per layer, eager and graph
    with KernelCalls() as calls:
        for n in (2, 4):
            report = compare_step(runner, sched.decode_entries()[:n])
            assert report.ok and report.untouched_ok, report.summary()
    # each product's weight [X, N, K] (rows_mm's one "expert": [1, N, K]); rows_bmm's (x, w); decode_attention's
    # (k_cache width, q_rope width)
    weights = calls.shapes("expert_rows_mm", 1) + [(1, *w) for w in calls.shapes("rows_mm", 1)]
    kn = list(zip(calls.shapes("rows_bmm", 0), calls.shapes("rows_bmm", 1)))
    pages = {("decode_attention", k[-1], r[-1])
             for k, r in zip(calls.shapes("decode_attention", 2), calls.shapes("decode_attention", 1))}
    cfg = model.config
    heads, latent, nope, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    tokens = runner.table_width * runner.block_size  # the gathered rows of a sequence
    gathered_scores = {w for w in weights if w[0] in (2, 4) and w[1:] in ((tokens, latent), (tokens, rope))}
    # the gathered rows' products in the kernel; where aten's bf16 is emulated they are float32 (paging.by_rows)
    gathered_in_kernel = on and not paged and not aten_bf16_emulated()
    assert bool(gathered_scores) == gathered_in_kernel, weights
    assert pages == ({("decode_attention", latent, rope)} if on and paged else set()), pages
    by_w_uv = (heads, cfg.v_head_dim, latent) in weights  # the latent output by W_UV, one "expert" per head
    by_w_uk = (heads, latent, nope) in weights  # the queries by W_UK ([C, Dn] per head), likewise
    assert by_w_uv == on and by_w_uk == on, weights
    kinds = {"probs by kv_c" if w[1] == tokens else "other" for x, w in kn}
    assert kinds == ({"probs by kv_c"} if gathered_in_kernel else set()), kn
    assert runner.stats.recompiles == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_freezing_from_min_batch_folds_weights_and_equals_eager(dtype):
    """Sizes >= inductor.freezing_min_batch compile with the weights as graph constants (not
    inputs), smaller sizes with the weights as inputs; every size still equals eager."""
    from ascend_graph.compile import resolve_backend

    config = inductor_config(inductor=InductorOptions(freezing_min_batch=2))
    weights_as_inputs = []  # per compile: how many of the model's weights are graph inputs

    def recording(gm, example_inputs):
        weights = {id(p) for p in step_weights}
        weights_as_inputs.append(sum(id(x) in weights for x in example_inputs))
        return resolve_backend(config, "cpu")(gm, example_inputs)

    model = small_model("mla", dtype)
    # what the step reads: the parameters, kv_b_proj.weight as its derived w_uk_t / w_uv buffers
    step_weights = [p for n, p in model.named_parameters() if not n.endswith("kv_b_proj.weight")]
    step_weights += [b for n, b in model.named_buffers() if n.endswith((".w_uk_t", ".w_uv"))]
    runner = make_runner(model, config, backend=recording)
    sched = Schedule()
    prefilled(runner, sched, 4, model.config.vocab_size)
    for n in (1, 2, 3, 4):
        report = compare_step(runner, sched.decode_entries()[:n])
        assert report.ok and report.untouched_ok, report.summary()
    assert weights_as_inputs == [0, len(step_weights)]  # sizes 4, then 1
    assert runner.stats.recompiles == 0


def test_inductor_freezing_is_refused_off_cpu_before_anything_is_allocated():
    model = small_model("llama")
    with pytest.raises(ValueError, match="inductor.freezing_min_batch is for CPU runners; this one runs on meta"):
        make_runner(model, graph_config(inductor=InductorOptions(freezing_min_batch=2)), device="meta")


def test_torchair_contract_use_cached_graph_compiles_each_size_through_cache_compile(monkeypatch):
    """With torchair's graph cache on, each capture size goes to ``cache_compile`` as a module
    method with its own code name (no NPU here: platform and torchair are stand-ins)."""
    import ascend_graph.compile as backends
    import ascend_graph.compile.torchair as torchair_backend
    from ascend_graph.config import TorchairOptions

    handed = []

    def fake_cache_compile(method, config, *, dynamic):
        handed.append((method.__code__.co_name, isinstance(method.__self__, torch.nn.Module), config, dynamic))
        return method

    monkeypatch.setattr(backends, "detect_platform", lambda device: "npu")
    monkeypatch.setattr(torchair_backend, "cache_compile", fake_cache_compile)
    config = graph_config(backend="torchair", torchair=TorchairOptions(use_cached_graph=True))
    runner, sched = make_runner(small_model("llama"), config), Schedule()
    prefilled(runner, sched, 3, 256)
    runner.execute(sched.decode_entries())
    assert [name for name, _, _, _ in handed] == ["decode_step_4", "decode_step_2", "decode_step_1"]
    assert all(is_module and cfg is config and dynamic is True for _, is_module, cfg, dynamic in handed)
    assert runner.stats.graph_steps == 1
