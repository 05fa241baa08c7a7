"""How the runner compiles on an Ascend NPU: torchair GE and npugraph_ex, as contracts.

No NPU here: ``npu_fakes`` stands in for torch_npu, torchair and npugraph_ex and records what
they are handed, and the runner is told its device is an NPU (``detect_platform`` patched, in
these tests only). The fakes compile through AOTAutograd as torchair does and run the
functionalized graph, so whole runner steps run on the CPU; the oracle is a runner with graph
mode off on the same model and schedule.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from npu_fakes import install_fake_npu
from runner_helpers import Schedule, make_runner, small_model
from torch.utils._pytree import tree_leaves

import ascend_graph.compile as backends
from ascend_graph.compile import resolve_backend
from ascend_graph.compile.recipe import mark_step_inputs_static
from ascend_graph.config import GraphConfig, NpugraphExOptions, TorchairOptions
from ascend_graph.kv_cache import KVCache

SIZES = (1, 2, 4)
RECAPTURE = "recapture_due_to_mutated_input_change_"


def npu_config(backend: str, **kw) -> GraphConfig:
    return GraphConfig(enabled=True, backend=backend, capture_sizes=SIZES, max_batch_size=max(SIZES), **kw)


class Recorder:
    """What the runner hands torch: ``torch.compile``'s keywords, each compiled step's call
    arguments, and the tensors given to ``mark_static`` / ``mark_static_address`` (by id)."""

    def __init__(self, monkeypatch) -> None:
        self.compile_kwargs: list[dict] = []
        self.step_args: list[tuple] = []
        self.marked_at_first_call: list[set[int]] = []
        self.static: set[int] = set()
        self.static_address: set[int] = set()
        compile_, mark, mark_address = torch.compile, torch._dynamo.mark_static, torch._dynamo.mark_static_address

        def compile_step(fn, **kwargs):
            self.compile_kwargs.append(kwargs)
            compiled = compile_(fn, **kwargs)

            def call(*args):
                if not any(a[0] is fn for a in self.step_args):
                    self.marked_at_first_call.append(set(self.static))
                self.step_args.append((fn, args))
                return compiled(*args)
            return call

        def mark_static(t, *args, **kwargs):
            self.static.add(id(t))
            return mark(t, *args, **kwargs)

        def mark_static_address(t, *args, **kwargs):
            self.static_address.add(id(t))
            return mark_address(t, *args, **kwargs)

        monkeypatch.setattr(torch, "compile", compile_step)
        monkeypatch.setattr(torch._dynamo, "mark_static", mark_static)
        monkeypatch.setattr(torch._dynamo, "mark_static_address", mark_static_address)


@pytest.fixture
def npu(monkeypatch):
    """Fake NPU packages; the runner believes it runs on an NPU."""
    fake = install_fake_npu(monkeypatch)
    monkeypatch.setattr(backends, "detect_platform", lambda device: "npu")
    monkeypatch.setitem(torch._dynamo.utils.counters, "npugraph_ex", Counter())
    return fake


def compiled_once_per_size(runner, npu) -> bool:
    """One AOTAutograd graph per capture size and no recompile; ``RunnerStats.compiles`` also
    counts each time dynamo restarted a compile from inside AOTAutograd (a Python float it
    specializes under ``dynamic=True``: once per process for a step's code, as on torchair)."""
    return (len(npu.calls["aot_graphs"]) == len(SIZES) and runner.stats.recompiles == 0
            and runner.stats.compiles == len(SIZES) + len(npu.calls["restarts"]))


def run_against_eager(runner, eager, new_tokens: tuple[int, ...] = (8, 6, 3)) -> list[int]:
    """Prefill a sequence per ``new_tokens`` entry, then decode until each has that many new
    tokens (3 rows, then 2, then 1 by default); every step's logits equal the eager runner's.
    Returns the batch sizes decoded; contexts grow by one per step."""
    sched, sizes = Schedule(seed=1), []
    for s, count in enumerate(new_tokens):
        entry = sched.add(s, sched.random_prompt(256), count)
        logits = runner.execute([entry])
        torch.testing.assert_close(logits, eager.execute([entry]))
        sched.advance([s], [entry], logits)
    while sched.next_token:
        ids, entries = sorted(sched.next_token), sched.decode_entries()
        logits = runner.execute(entries)
        torch.testing.assert_close(logits, eager.execute(entries), atol=1e-5, rtol=1e-5)
        sched.advance(ids, entries, logits)
        sizes.append(len(entries))
    return sizes


# --- torchair GE ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_ge_steps_equal_eager_with_one_compile_per_size_across_context_lengths(npu, monkeypatch, kind):
    record = Recorder(monkeypatch)
    model = small_model(kind)
    runner, eager = make_runner(model, npu_config("torchair")), make_runner(model, GraphConfig(enabled=False))
    sizes = run_against_eager(runner, eager)
    assert {1, 2, 3} <= set(sizes) and runner.stats.graph_steps == len(sizes)
    assert compiled_once_per_size(runner, npu) and len(npu.calls["ge_graphs"]) == runner.stats.compiles
    assert record.compile_kwargs == [{"backend": record.compile_kwargs[0]["backend"], "fullgraph": True,
                                      "dynamic": True}] * len(SIZES)
    (config,) = npu.calls["backend"]
    assert (config.mode, config.experimental_config.frozen_parameter, config.experimental_config.enable_view_optimize,
            config.experimental_config.tiling_schedule_optimize) == ("max-autotune", True, True, True)
    assert npu.calls["set_compile_mode"] == [{"jit_compile": False}]
    assert runner.stats.to_dict()["recaptures"] == 0


def test_ge_marks_every_tensor_of_the_step_static_before_its_compile(npu, monkeypatch):
    """Each tensor a compiled step is called with (ids, positions, slot mapping, block tables,
    context lengths, both tensors of each layer's cache) was marked before that step first ran."""
    record = Recorder(monkeypatch)
    model = small_model("mla")
    runner, eager = make_runner(model, npu_config("torchair")), make_runner(model, GraphConfig(enabled=False))
    run_against_eager(runner, eager, (4, 3, 2))
    first_calls = {}
    for fn, args in record.step_args:
        first_calls.setdefault(fn, args)
    assert len(first_calls) == len(SIZES) == len(record.marked_at_first_call)
    for (ids, positions, kv_caches, meta), marked in zip(first_calls.values(), record.marked_at_first_call):
        assert kv_caches is runner.kv_caches and all(isinstance(c, tuple) for c in kv_caches)
        step_tensors = [ids, positions, meta.slot_mapping, meta.decode.block_tables, meta.decode.context_lens]
        cache_tensors = [t for cache in runner.kv_caches for t in (cache.kv_c, cache.k_pe)]
        leaves = [x for x in tree_leaves((ids, positions, kv_caches, meta)) if isinstance(x, torch.Tensor)]
        assert {id(t) for t in leaves} == {id(t) for t in step_tensors + cache_tensors}
        assert {id(t) for t in leaves} <= marked
    assert {id(t) for cache in runner.kv_caches for t in cache} <= record.static_address


def test_ge_cached_graph_compiles_with_dynamic_true(npu):
    config = npu_config("torchair", torchair=TorchairOptions(use_cached_graph=True))
    model = small_model("llama")
    runner, eager = make_runner(model, config), make_runner(model, GraphConfig(enabled=False))
    sizes = run_against_eager(runner, eager)
    assert [kwargs["dynamic"] for _, kwargs in npu.calls["cache_compile"]] == [True] * len(SIZES)
    assert runner.stats.graph_steps == len(sizes) and not runner.stats.compile_errors


def test_step_inputs_need_tuple_caches():
    caches = [KVCache(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)), [torch.zeros(2, 4, 1, 8)] * 2]
    with pytest.raises(TypeError, match=r"kv_caches\[1\] must be a tuple of tensors .*got list"):
        mark_step_inputs_static([torch.zeros(4)], caches)


# --- npugraph_ex ------------------------------------------------------------------------------


def test_npugraph_ex_steps_equal_eager_with_its_options_and_one_compile_per_size(npu, monkeypatch):
    record = Recorder(monkeypatch)
    model = small_model("llama")
    runner, eager = make_runner(model, npu_config("npugraph_ex")), make_runner(model, GraphConfig(enabled=False))
    sizes = run_against_eager(runner, eager)
    assert runner.stats.graph_steps == len(sizes) and compiled_once_per_size(runner, npu)
    assert len(npu.calls["npugraph_ex_graphs"]) == runner.stats.compiles
    assert npu.calls["npugraph_ex"] == [{"capture_limit": 64, "clone_input": False, "frozen_parameter": True,
                                         "force_eager": False}] * runner.stats.compiles
    assert [(k["fullgraph"], k["dynamic"]) for k in record.compile_kwargs] == [(True, True)] * len(SIZES)
    assert npu.calls["set_compile_mode"] == [{"jit_compile": False}] and npu.calls["backend"] == []
    assert {id(t) for cache in runner.kv_caches for t in cache} <= record.static_address
    assert {id(t) for cache in runner.kv_caches for t in cache} <= record.static


def test_npugraph_ex_options_are_handed_over_as_configured(npu):
    options = NpugraphExOptions(capture_limit=3, clone_input=True, frozen_parameter=False, force_eager=True,
                                use_graph_pool=True)
    backend = resolve_backend(npu_config("npugraph_ex", npugraph_ex=options), "npu")
    assert backend.func is npu.npugraph_ex
    assert backend.keywords == {"options": {"capture_limit": 3, "clone_input": True, "frozen_parameter": False,
                                            "force_eager": True, "use_graph_pool": npu.pool}}


def test_npugraph_ex_recaptures_since_capture_appear_in_runner_stats(npu):
    """npugraph_ex counts a recapture per graph when a mutated input's address changed; the
    runner reports those since its capture, not other counters nor counts from before."""
    counters = torch._dynamo.utils.counters["npugraph_ex"]
    counters[RECAPTURE + "graph_0"] = 5  # a graph of an earlier runner
    model = small_model("llama")
    runner, sched = make_runner(model, npu_config("npugraph_ex")), Schedule()
    for s in range(2):
        entry = sched.add(s, sched.random_prompt(256), new_tokens=10)
        sched.advance([s], [entry], runner.execute([entry]))
    runner.execute(sched.decode_entries())
    assert runner.stats.to_dict()["recaptures"] == 0
    counters[RECAPTURE + "graph_1"] += 2
    counters[RECAPTURE + "graph_0"] += 1
    counters["captured_graph_1"] += 3
    counters["recapture_due_to_global_limit_core_change_graph_1"] += 4
    runner.execute(sched.decode_entries())
    assert runner.stats.to_dict()["recaptures"] == 3


def test_npugraph_ex_is_refused_off_npu_before_anything_is_compiled(monkeypatch):
    record = Recorder(monkeypatch)
    with pytest.raises(ValueError, match="backend='npugraph_ex' needs a npu device, got a cpu device"):
        make_runner(small_model("llama"), npu_config("npugraph_ex"))
    assert record.compile_kwargs == []


def test_npugraph_ex_refuses_a_torch_compile_mode(npu):
    with pytest.raises(ValueError, match="mode='reduce-overhead' has no meaning for the 'npugraph_ex' backend"):
        resolve_backend(npu_config("npugraph_ex"), "npu", mode="reduce-overhead")


def test_npugraph_ex_without_torch_npu_or_its_backend_gives_a_clear_import_error(monkeypatch):
    install_fake_npu(monkeypatch, npugraph_ex=False)
    with pytest.raises(ImportError, match="registers no 'npugraph_ex' torch.compile backend"):
        resolve_backend(npu_config("npugraph_ex"), "npu")
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(ImportError, match=r"needs torch_npu .*CANN.*\(import torch_npu failed"):
        resolve_backend(npu_config("npugraph_ex"), "npu")


def test_report_shows_recaptures_only_when_there_are_some():
    from ascend_graph.cli.report import counter_lines
    from ascend_graph.runner import RunnerStats

    engine = {"requests": 1, "prompt_tokens": 4, "generated_tokens": 2, "prefill_steps": 1, "decode_steps": 1,
              "decode_batch_sizes": {1: 1}}
    stats = RunnerStats(graph_steps=1, recaptures=2)
    assert "| recaptures 2 |" in counter_lines({**stats.to_dict(), **engine})[0]
    assert "recaptures" not in counter_lines({**RunnerStats(graph_steps=1).to_dict(), **engine})[0]


# --- an option the installed torchair lacks ---------------------------------------------------


def lacking_tiling(npu) -> None:
    npu.torchair.experimental_options = {"frozen_parameter": False, "enable_view_optimize": False}


def test_torchair_default_option_it_lacks_warns_naming_it_and_compiles_without_it(npu):
    lacking_tiling(npu)
    with pytest.warns(RuntimeWarning, match=r"no experimental_config\.tiling_schedule_optimize "
                                            r"\(torchair\.tiling_schedule_optimize=True\): compiling without it"):
        resolve_backend(npu_config("torchair"), "npu")
    (config,) = npu.calls["backend"]
    assert not hasattr(config.experimental_config, "tiling_schedule_optimize")
    assert config.experimental_config.frozen_parameter is True


@pytest.mark.parametrize("options", [TorchairOptions(tiling_schedule_optimize=False),
                                     TorchairOptions(missing_options="error")], ids=["changed", "policy-error"])
def test_torchair_option_it_lacks_is_an_error_before_anything_compiles(npu, monkeypatch, options):
    record = Recorder(monkeypatch)
    lacking_tiling(npu)
    config = npu_config("torchair", torchair=options)
    with pytest.raises(ValueError, match=r"the installed torchair has no experimental_config\.tiling_schedule_optimize "
                                         r"\(torchair\.tiling_schedule_optimize=(True|False)\).*"
                                         r"missing_options='warn'"):
        make_runner(small_model("llama"), config).capture(show_progress=False)
    assert npu.calls["backend"] == [] and record.compile_kwargs == []


def test_torchair_missing_option_policy_warn_compiles_without_a_changed_option(npu):
    lacking_tiling(npu)
    options = TorchairOptions(tiling_schedule_optimize=False, missing_options="warn")
    with pytest.warns(RuntimeWarning, match=r"tiling_schedule_optimize=False\): compiling without it"):
        resolve_backend(npu_config("torchair", torchair=options), "npu")
    assert len(npu.calls["backend"]) == 1


def test_torchair_missing_options_is_checked_as_config():
    with pytest.raises(ValueError, match=r"torchair\.missing_options must be one of 'auto', 'error', 'warn'"):
        TorchairOptions(missing_options="ignore")
    assert GraphConfig.from_dict({"torchair": {"missing_options": "warn"}}).torchair.missing_options == "warn"
