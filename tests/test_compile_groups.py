"""Compile groups (``InductorOptions.dynamic_batch``): capture sizes of 2 rows and more share one
compile with a dynamic batch dimension, size 1 compiles alone.

Oracles: the eager path of the same runner on the same caches (``compare_step``), a runner with
graph mode off following the same schedule, and a cold runner's logits for the warm one.
"""

from __future__ import annotations

import pytest
import torch
from runner_helpers import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, Schedule, make_runner, prefilled, small_model

from ascend_graph.config import GraphConfig, InductorOptions
from ascend_graph.runner import GraphRunner
from ascend_graph.runner.groups import CompileGroup, compile_groups, dynamic_batch_default
from ascend_graph.runner.parity import compare_step


def config(**kw) -> GraphConfig:
    base = dict(enabled=True, backend="aot_eager", capture_sizes=(1, 2, 4), max_batch_size=4,
                inductor=InductorOptions(dynamic_batch=True))
    return GraphConfig(**{**base, **kw})


def test_sizes_of_two_rows_and_more_form_one_group_and_size_one_stays_alone():
    assert compile_groups((1, 2, 4, 8), True) == {1: CompileGroup(1, 1), 2: CompileGroup(2, 8),
                                                 4: CompileGroup(2, 8), 8: CompileGroup(2, 8)}
    assert compile_groups((1, 4), True) == {1: CompileGroup(1, 1), 4: CompileGroup(4, 4)}
    assert all(not g.dynamic for g in compile_groups((1, 2, 4, 8), False).values())


def test_default_shares_a_compile_only_for_a_cpu_inductor_runner_without_bf16_weights():
    cpu = torch.device("cpu")
    fp32, bf16 = small_model("mla", layers=1), small_model("mla", torch.bfloat16, layers=1)
    inductor = GraphConfig(enabled=True, backend="inductor", capture_sizes=(1, 2, 4), max_batch_size=4)
    assert dynamic_batch_default(fp32, inductor, cpu, backend_given=False)
    assert not dynamic_batch_default(bf16, inductor, cpu, backend_given=False)  # decode_matmul picks by rows
    assert not dynamic_batch_default(fp32, inductor, cpu, backend_given=True)
    assert not dynamic_batch_default(fp32, config(inductor=InductorOptions()), cpu, backend_given=False)
    for options in (InductorOptions(aot=True), InductorOptions(freezing_min_batch=2)):
        other = GraphConfig(enabled=True, backend="inductor", capture_sizes=(1, 2, 4), max_batch_size=4,
                            inductor=options)
        assert not dynamic_batch_default(fp32, other, cpu, backend_given=False)


def test_dynamic_batch_is_refused_with_aot_or_freezing_and_off_cpu():
    for other in ({"aot": True}, {"freezing_min_batch": 2}):
        with pytest.raises(ValueError, match="inductor.dynamic_batch=True cannot be combined"):
            InductorOptions(dynamic_batch=True, **other)
    with pytest.raises(ValueError, match="dynamic_batch=True is for CPU runners; this one runs on meta"):
        make_runner(small_model("llama"), config(), device="meta")


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_long_run_compiles_each_group_once_with_zero_recompiles_and_equals_eager(kind):
    model = small_model(kind)
    graph, eager = make_runner(model, config()), make_runner(model, GraphConfig(enabled=False))
    graph.capture(show_progress=False)
    assert graph.stats.compiles == 2 and graph.graph_sizes == (1, 2, 4)
    assert {s: c["compile_group"] for s, c in graph.stats.capture.items()} == {1: "1", 2: "2-4", 4: "2-4"}
    sched, sizes_seen = Schedule(seed=1), set()
    for s in range(4):
        entry = sched.add(s, sched.random_prompt(model.config.vocab_size), new_tokens=40)
        sched.advance([s], [entry], graph.execute([entry]))
        eager.execute([entry])
    for step in range(24):
        entries = sched.decode_entries()[:1 + step % 4]  # 1, 2, 3 (padded to 4), 4 rows in turn
        ids = sorted(sched.next_token)[:len(entries)]
        logits = graph.execute(entries)
        torch.testing.assert_close(logits, eager.execute(entries), atol=1e-4, rtol=1e-4)
        sched.advance(ids, entries, logits)
        sizes_seen.add(len(entries))
    assert sizes_seen == {1, 2, 3, 4}
    assert graph.stats.graph_steps == 24 and graph.stats.compiles == 2 and graph.stats.recompiles == 0


def fails_on_a_dynamic_batch(gm, example_inputs, **kwargs):
    """A backend that cannot compile symbolic shapes (as a model choosing by row count cannot)."""
    if any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.find_nodes(op="placeholder")):
        raise RuntimeError("simulated: no dynamic shapes here")
    return gm.forward


def test_a_group_that_fails_to_compile_falls_back_to_a_compile_per_size():
    model = small_model("llama")
    runner, sched = make_runner(model, config(), backend=fails_on_a_dynamic_batch), Schedule()
    runner.capture(show_progress=False)
    # size 1, the failed shared attempt, then 4 and 2 alone: every size has a graph
    assert (runner.stats.compiles, runner.stats.compile_failures) == (4, 1) and runner.graph_sizes == (1, 2, 4)
    assert {s: c["compile_group"] for s, c in runner.stats.capture.items()} == {1: "1", 2: "2", 4: "4"}
    prefilled(runner, sched, 3, model.config.vocab_size)
    for n in (2, 3):
        report = compare_step(runner, sched.decode_entries()[:n])
        assert report.ok and report.untouched_ok, report.summary()
    assert runner.stats.recompiles == 0 and runner.stats.eager_steps["compile_failed"] == 0


def test_inductor_group_equals_eager_and_a_warm_start_loads_it_with_identical_logits(tmp_path):
    """Cold: the group compiles (a miss); warm, a fresh runner on the same cache directory loads
    it from Inductor's own cache (a hit; precompile off, test_precompile has that path) and gives
    the cold runner's logits bit for bit; other cache shapes miss."""
    model = small_model("mla")
    cfg = GraphConfig(enabled=True, backend="inductor", capture_sizes=(2, 4), max_batch_size=4,
                      compile_cache_dir=str(tmp_path),  # dynamic_batch=None: on for this fp32 model
                      inductor=InductorOptions(precompile=False))
    logits, outcomes = [], []
    for _ in range(2):
        runner, sched = make_runner(model, cfg), Schedule(seed=2)
        runner.capture(show_progress=False)
        assert runner.stats.compiles == 1 and runner.compile_groups[2] == CompileGroup(2, 4)
        outcomes.append({c["compile_cache"] for c in runner.stats.capture.values()})
        prefilled(runner, sched, 4, model.config.vocab_size)
        for n in (2, 3, 4):
            report = compare_step(runner, sched.decode_entries()[:n])
            assert report.ok and report.untouched_ok, report.summary()
        logits.append(runner.execute(sched.decode_entries()[:3]))
        assert runner.stats.recompiles == 0 and runner.stats.compiles == 1
    assert outcomes == [{"miss"}, {"hit"}] and torch.equal(logits[0], logits[1])
    other = GraphRunner(model, cfg, num_blocks=NUM_BLOCKS // 2, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
    other.capture(show_progress=False)
    assert {c["compile_cache"] for c in other.stats.capture.values()} == {"miss"}
