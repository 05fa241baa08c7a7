"""AOTInductor packages of the decode step (``GraphConfig.inductor.aot``, CPU).

Oracle: the eager path of the same runner on the same caches (``compare_step``): logits, the
written cache slots, and every block the step must not touch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from runner_helpers import (BLOCK_SIZE, MAX_MODEL_LEN, KernelCalls, Schedule, assert_graph_outputs_are_fresh,
                            make_runner, small_model)

from ascend_graph.compile.aot_inductor import PACKAGE_SUBDIR, inductor_options, package_key
from ascend_graph.config import GraphConfig, InductorOptions
from ascend_graph.runner.parity import compare_step
from ascend_graph.runner import GraphRunner

SIZES = (1, 2)
# pytest-xdist (the README's test command runs a worker per core): this module's tests share one
# compiled runner (``compiled``, a module fixture): keep them on one worker, compiled once
pytestmark = pytest.mark.xdist_group("aot_inductor")


def aot_config(cache_dir, **kw) -> GraphConfig:
    base = dict(enabled=True, backend="inductor", capture_sizes=SIZES, max_batch_size=max(SIZES),
                inductor=InductorOptions(aot=True), compile_cache_dir=str(cache_dir))
    return GraphConfig(**{**base, **kw})


def decoding_runner(config: GraphConfig):
    """A bfloat16 MLA + MoE runner with two sequences prefilled (eagerly), ready to decode."""
    model = small_model("mla", torch.bfloat16)
    runner, sched = make_runner(model, config), Schedule()
    for s in range(2):
        entry = sched.add(s, sched.random_prompt(model.config.vocab_size), new_tokens=100)
        sched.advance([s], [entry], runner.execute([entry]))
    return model, runner, sched


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """One runner that compiled a package per capture size, and its cache directory."""
    cache_dir = tmp_path_factory.mktemp("aoti")
    model, runner, sched = decoding_runner(aot_config(cache_dir))
    runner.capture(show_progress=False)  # every test, run alone too, finds the packages written
    return cache_dir, model, runner, sched


def check_every_size(runner, sched) -> None:
    for n in (1, 2):
        report = compare_step(runner, sched.decode_entries()[:n])
        assert report.ok and report.untouched_ok, report.summary()


def test_packages_equal_eager_for_every_size(compiled):
    cache_dir, _, runner, sched = compiled
    check_every_size(runner, sched)
    assert runner.graph_sizes == SIZES
    assert (runner.stats.compiles, runner.stats.packages_loaded) == (2, 0)
    packages = sorted(os.listdir(os.path.join(cache_dir, PACKAGE_SUBDIR)))
    assert [p.split("-")[0] for p in packages] == ["decode_step_1", "decode_step_2"]
    assert all(p.endswith(".pt2") for p in packages)  # no partial package left behind


def test_a_package_calls_the_projects_kernel_where_it_runs(compiled):
    """At 2 rows the package multiplies as the Inductor backend's graphs do: the dense products in
    ``rows_mm``, the MoE's experts in ``expert_rows_mm`` (as eager does)."""
    from ascend_graph import kernels

    _, model, runner, sched = compiled
    with KernelCalls() as found:
        report = compare_step(runner, sched.decode_entries()[:2])  # eager, then the package
    assert report.ok, report.summary()
    # (op, its weight's first dimension: experts, or a rows_mm weight's N)
    calls = [(op, shapes[1][0]) for op, shapes in found.found if op in ("rows_mm", "expert_rows_mm")]
    kn = found.shapes("rows_bmm", 0)
    cfg = model.config
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    if kernels.available():
        experts = cfg.n_routed_experts
        assert calls.count(("expert_rows_mm", experts)) == 2 * 2 * moe_layers  # gate/up and down, eager and package
        assert [n for n, _ in calls].count("rows_mm") > 0
        # this model's attention products are below batched_limits(): aten's, as in the
        # Inductor backend's graphs (tests/test_runner.py runs them in the kernel)
        assert calls.count(("expert_rows_mm", 2)) == 0 and kn == []
    else:
        assert calls == [] and kn == []


def test_package_logits_are_not_overwritten_by_the_next_step(compiled):
    _, _, runner, sched = compiled
    assert_graph_outputs_are_fresh(runner, sched, [0, 1])


def test_a_second_runner_loads_the_packages_without_compiling(compiled):
    cache_dir = compiled[0]
    _, runner, sched = decoding_runner(aot_config(cache_dir))
    runner.capture(show_progress=False)
    assert (runner.stats.compiles, runner.stats.packages_loaded) == (0, 2)
    check_every_size(runner, sched)


def test_a_fresh_process_loads_the_packages_without_compiling(compiled):
    """What a restarted server does: a new interpreter, the same model and cache directory."""
    script = f"""
import sys, json, torch
torch.set_num_threads({torch.get_num_threads()})  # part of the package key, as in the compiling process
sys.path.insert(0, {os.path.dirname(__file__)!r})
import test_aot_inductor as t
_, runner, sched = t.decoding_runner(t.aot_config({str(compiled[0])!r}))
runner.capture(show_progress=False)
t.check_every_size(runner, sched)
print(json.dumps([runner.stats.compiles, runner.stats.packages_loaded]))
"""
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [0, 2]


def test_the_package_runs_on_the_models_own_weights(compiled):
    """An in-place weight update reaches the next graph step: the package holds no copy."""
    _, model, runner, sched = compiled
    entries = sched.decode_entries()[:2]
    before = compare_step(runner, entries).graph_logits
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    try:
        report = compare_step(runner, entries)
        assert report.ok, report.summary()
        assert not torch.allclose(report.graph_logits, before, atol=0.1)
    finally:
        with torch.no_grad():
            model.lm_head.weight.div_(1.5)


def test_a_different_cache_geometry_gets_a_different_package(tmp_path):
    """The package key covers the step's input shapes (here the number of cache blocks), the
    model's weights' shapes and the thread count; the same runner twice gives the same key."""
    def key(runner):
        ids, pos, meta = runner._views(1)
        return package_key(runner._step, (ids, pos, runner.kv_caches, meta), inductor_options(runner.config, "cpu"))

    config = aot_config(tmp_path)
    model = small_model("mla", torch.bfloat16)
    same = key(make_runner(model, config))
    assert key(make_runner(model, config)) == same
    assert key(GraphRunner(model, config, num_blocks=200, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)) != same
    assert key(make_runner(small_model("mla", torch.float32), config)) != same
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # Inductor's kernels are generated for the thread count
    try:
        assert key(make_runner(model, config)) != same
    finally:
        torch.set_num_threads(threads)


USER_MODEL = """import torch


def scale(x):
    return x * {scale}


class UserModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = {{"hidden": 4}}
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return {body}
"""


def user_model(folder, **source) -> torch.nn.Module:
    """``UserModel`` of module ``user_model`` from ``folder/user_model.py``, written from ``USER_MODEL``."""
    folder.mkdir()
    (folder / "user_model.py").write_text(USER_MODEL.format(**source))
    spec = importlib.util.spec_from_file_location("user_model", folder / "user_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.UserModel()


def test_the_package_key_covers_the_models_code_and_config_not_only_its_class_name(tmp_path):
    """Edits of a model file that keep its module, class name and config (another forward, or
    another helper beside the class) give another key, as another config does; the same model
    twice, and the same file in another directory, give the same key."""
    key = lambda model: package_key(model, (torch.zeros(2, 4),), {})  # noqa: E731
    base = {"scale": 2, "body": "scale(self.proj(x))"}
    first = user_model(tmp_path / "first", **base)
    assert key(first) == key(first) == key(user_model(tmp_path / "copy", **base))
    assert key(user_model(tmp_path / "forward", scale=2, body="scale(self.proj(x)).relu()")) != key(first)
    assert key(user_model(tmp_path / "helper", scale=3, body=base["body"])) != key(first)
    other = user_model(tmp_path / "config", **base)
    other.config = {"hidden": 5}
    assert key(other) != key(first)


def test_the_package_key_covers_the_rank_and_the_parallel_layout(tmp_path, monkeypatch):
    """Each rank of a parallel layout has its own compiled steps (its share's shapes, its groups'
    collectives, whose path vLLM's workers name: ``vllm/parallel.py``): ranks, layouts and
    collective paths never share a file."""
    from ascend_graph.distributed import ParallelConfig, ParallelState
    from ascend_graph.distributed import state as state_module

    model = user_model(tmp_path / "m", scale=2, body="scale(self.proj(x))")
    keys = set()
    tp2 = ParallelConfig(tensor_parallel_size=2)
    for config, rank, path in ((ParallelConfig(), 0, "torch.distributed"), (tp2, 0, "torch.distributed"),
                               (tp2, 1, "torch.distributed"), (ParallelConfig(data_parallel_size=2), 1, "torch.distributed"),
                               (tp2, 1, "vllm 0.32.0 tp:0 torch.distributed"), (tp2, 1, "vllm 0.32.0 tp:0 shm")):
        monkeypatch.setattr(state_module._Holder, "state", ParallelState(config=config, rank=rank, collectives=path))
        keys.add(package_key(model, (torch.zeros(2, 4),), {}))
    assert len(keys) == 6


def test_bad_aot_inductor_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="inductor.aot=True cannot be combined with inductor.freezing_min_batch"):
        aot_config(tmp_path, inductor=InductorOptions(aot=True, freezing_min_batch=2))
    with pytest.raises(TypeError, match="inductor.aot must be a bool"):
        GraphConfig.from_dict({"inductor": {"aot": "yes"}})
    model = small_model("llama")
    with pytest.raises(ValueError, match="inductor.aot=True is for CPU runners; this one runs on meta"):
        make_runner(model, aot_config(tmp_path), device="meta")
    with pytest.raises(ValueError, match="inductor.aot=True compiles with Inductor.*backend='aot_eager'"):
        make_runner(model, aot_config(tmp_path, backend="aot_eager"))
