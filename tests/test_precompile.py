"""Precompiled steps (``InductorOptions.precompile``): compiled once, saved under the compile cache,
loaded by a later process without a trace.

Oracles: the eager path of the same runner on the same caches (``compare_step``), and the cold
process's logits for the warm one. A second model of the same shapes and other weights loads the
same files and must compute with its own weights.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from runner_helpers import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, Schedule, make_runner, prefilled, small_model

from ascend_graph.compile import precompile
from ascend_graph.config import GraphConfig, InductorOptions
from ascend_graph.runner import GraphRunner, RecompileError
from ascend_graph.runner.groups import resolve_compile_options
from ascend_graph.runner.parity import compare_step

HERE = os.path.dirname(os.path.abspath(__file__))


def config(cache_dir: str) -> GraphConfig:
    return GraphConfig(enabled=True, backend="inductor", capture_sizes=(1, 2, 4), max_batch_size=4,
                       compile_cache_dir=cache_dir, inductor=InductorOptions(precompile=True))


def run(seed: int, cache_dir: str) -> dict:
    """A runner on ``small_model("mla")``, its parameters moved by seeded noise where ``seed`` is
    not 0 (same shapes, other weights): capture, then decode steps of 1 to 4 rows, each
    compared with eager; its counters and the last step's logits. One torch thread, in the
    test's process and a fresh one alike (eager prefill's sums depend on the thread count)."""
    torch.set_num_threads(1)
    model = small_model("mla")
    if seed:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.02)
    runner, sched = make_runner(model, config(cache_dir)), Schedule(seed=3)
    runner.capture(show_progress=False)
    prefilled(runner, sched, 4, model.config.vocab_size)
    for n in (1, 2, 3, 4, 2):
        report = compare_step(runner, sched.decode_entries()[:n])
        assert report.ok and report.untouched_ok, report.summary()
    logits = runner.execute(sched.decode_entries()[:3])
    stats = runner.stats
    return {"compiles": stats.compiles, "loaded": stats.packages_loaded, "recompiles": stats.recompiles,
            "cache": sorted({c["compile_cache"] for c in stats.capture.values()}), "logits": logits.tolist()}


def run_in_fresh_process(seed: int, cache_dir: str) -> dict:
    code = (f"import json, sys; sys.path[:0] = [{HERE!r}]; import test_precompile as t; "
            f"print('RESULT ' + json.dumps(t.run({seed}, {cache_dir!r})))")
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.mark.slow
def test_a_fresh_process_loads_the_steps_and_computes_what_the_cold_one_did(tmp_path):
    cold = run(0, str(tmp_path))
    assert (cold["compiles"], cold["loaded"], cold["cache"]) == (2, 0, ["miss"])  # size 1 and group 2-4
    files = os.listdir(tmp_path / "ascend_graph_precompiled")
    assert len(files) == 2 and all(f.endswith(".bin") for f in files)
    warm = run_in_fresh_process(0, str(tmp_path))
    assert (warm["compiles"], warm["loaded"], warm["recompiles"], warm["cache"]) == (0, 2, 0, ["hit"])
    assert warm["logits"] == cold["logits"]  # bit for bit
    other = run_in_fresh_process(1, str(tmp_path))  # same shapes, other weights: the same files
    assert (other["compiles"], other["loaded"]) == (0, 2)
    assert other["logits"] != cold["logits"]  # and its own weights (each step also equalled eager)


def test_other_cache_shapes_compile_their_own_steps(tmp_path):
    model = small_model("llama")
    first = make_runner(model, config(str(tmp_path)))
    first.capture(show_progress=False)
    other = GraphRunner(model, config(str(tmp_path)), num_blocks=NUM_BLOCKS // 2, block_size=BLOCK_SIZE,
                        max_model_len=MAX_MODEL_LEN)
    other.capture(show_progress=False)
    assert (other.stats.compiles, other.stats.packages_loaded) == (2, 0)
    assert len(os.listdir(tmp_path / "ascend_graph_precompiled")) == 4


def test_what_cannot_be_precompiled_compiles_as_a_plain_graph(tmp_path, monkeypatch, caplog):
    def refuse(compiled, inputs, inference):
        raise RuntimeError("simulated: cannot save this")

    model = small_model("llama")
    monkeypatch.setattr(precompile, "aot_compile", refuse)
    runner, sched = make_runner(model, config(str(tmp_path))), Schedule()
    runner.capture(show_progress=False)
    assert "precompiling decode_step_1" in caplog.text and runner.graph_sizes == (1, 2, 4)
    prefilled(runner, sched, 3, model.config.vocab_size)
    report = compare_step(runner, sched.decode_entries()[:3])
    assert report.ok and runner.stats.packages_loaded == 0 and runner.stats.compile_failures == 0


def test_precompile_is_refused_where_it_cannot_apply():
    for other in ({"aot": True}, {"freezing_min_batch": 2}):
        with pytest.raises(ValueError, match="inductor.precompile=True cannot be combined"):
            InductorOptions(precompile=True, **other)
    model = small_model("llama")
    with pytest.raises(ValueError, match=r"inductor.precompile=True compiles with Inductor.*backend='aot_eager'"):
        make_runner(model, GraphConfig(enabled=True, backend="aot_eager", capture_sizes=(1,), max_batch_size=1,
                                       inductor=InductorOptions(precompile=True)))
    with pytest.raises(ValueError, match="and a backend callable"):
        make_runner(model, GraphConfig(enabled=True, capture_sizes=(1,), max_batch_size=1,
                                       inductor=InductorOptions(precompile=True)), backend=lambda gm, inputs: gm)


def test_precompile_is_on_by_default_only_where_it_applies(tmp_path):
    """Default (``precompile=None``): on for a CPU runner's own Inductor backend, off for other
    backends, a backend callable, ``aot``, freezing and graph mode off; ``False`` turns it off."""
    model, cpu = small_model("llama"), torch.device("cpu")

    def resolved(callable_backend=None, **fields) -> bool:
        inductor = {k: fields.pop(k) for k in ("aot", "freezing_min_batch", "precompile") if k in fields}
        cfg = GraphConfig(**{"enabled": True, "capture_sizes": (1,), "max_batch_size": 1, **fields},
                          inductor=InductorOptions(**inductor))
        return resolve_compile_options(model, cfg, cpu, callable_backend).precompile

    assert resolved() and resolved(backend="inductor")
    assert not any([resolved(backend="aot_eager"), resolved(backend="eager"), resolved(aot=True),
                    resolved(freezing_min_batch=1), resolved(precompile=False), resolved(enabled=False),
                    resolved(lambda gm, inputs: gm)])
    runner = make_runner(model, GraphConfig(enabled=True, capture_sizes=(1,), max_batch_size=1,
                                            compile_cache_dir=str(tmp_path)))
    runner.capture(show_progress=False)  # the default backend on CPU is Inductor: the step is saved
    assert [f.startswith("decode_step_1-") for f in os.listdir(tmp_path / "ascend_graph_precompiled")] == [True]


def test_a_precompiled_step_whose_guards_fail_compiles_again_as_a_recompile(tmp_path, caplog):
    """A guarded attribute of the model changes after warm-up: the precompiled step's guards fail,
    and the step compiles again through the runner's backend, which counts it as a recompile
    (raised or warned by ``on_recompile``); the new graph computes what eager does."""
    for policy in ("error", "warn"):
        model = small_model("llama")
        cfg = GraphConfig(enabled=True, backend="inductor", capture_sizes=(2,), max_batch_size=2,
                          compile_cache_dir=str(tmp_path), on_recompile=policy)
        runner, sched = make_runner(model, cfg), Schedule()
        prefilled(runner, sched, 2, model.config.vocab_size)
        runner.execute(sched.decode_entries())
        assert runner.stats.compiles + runner.stats.packages_loaded == 1 and runner.stats.recompiles == 0
        model.layers[0].self_attn.cfg = type(model.config)(rope_theta=5000.0)
        if policy == "error":
            with pytest.raises(RecompileError, match="compiled again after warm-up"):
                runner.execute(sched.decode_entries())
            continue
        with caplog.at_level(logging.WARNING):
            report = compare_step(runner, sched.decode_entries())
        assert report.ok and report.untouched_ok, report.summary()
        assert runner.stats.recompiles == 1 and "guards failed" in caplog.text


def test_a_runner_built_under_inference_mode_precompiles_and_loads_its_steps(tmp_path):
    """As vLLM's worker builds it: caches and buffers are inference tensors, which the step writes
    in inference mode; its files are its own (the mode is part of the key), and a second runner
    loads them and computes what eager does."""
    model = small_model("llama")
    with torch.inference_mode():
        counts = []
        for _ in range(2):
            runner, sched = make_runner(model, config(str(tmp_path))), Schedule(seed=4)
            assert runner.kv_caches[0].k.is_inference()
            runner.capture(show_progress=False)
            prefilled(runner, sched, 3, model.config.vocab_size)
            for n in (1, 3, 2):
                report = compare_step(runner, sched.decode_entries()[:n])
                assert report.ok and report.untouched_ok, report.summary()
            counts.append((runner.stats.compiles, runner.stats.packages_loaded, runner.stats.recompiles))
    assert counts == [(2, 0, 0), (0, 2, 0)]  # size 1 and group 2-4
    outside = make_runner(model, config(str(tmp_path)))  # the same shapes outside inference mode: other files
    outside.capture(show_progress=False)
    assert (outside.stats.compiles, outside.stats.packages_loaded) == (2, 0)
    assert len(os.listdir(tmp_path / "ascend_graph_precompiled")) == 4
