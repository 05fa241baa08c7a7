"""What keeps the benchmark figures honest: a ratio and its range come from samples of the same
rounds, and the committed results render into docs/performance.md and the README's block."""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import statistics

import pytest
import torch

from benchmarks import report
from benchmarks.common import ratio_of_rounds


def test_a_ratio_and_its_range_come_from_the_same_rounds():
    samples = {"eager": [4.0, 6.0, 5.0], "graph": [2.0, 2.0, 1.0]}
    r = ratio_of_rounds(samples, "eager", "graph")
    assert r["ratio"] == statistics.median(samples["eager"]) / statistics.median(samples["graph"])
    assert (r["min"], r["max"], r["rounds"]) == (2.0, 5.0, 3)  # each round's two samples, taken back to back
    with pytest.raises(ValueError, match="same rounds"):
        ratio_of_rounds({"eager": [4.0, 6.0], "graph": [2.0]}, "eager", "graph")


def test_the_committed_results_render_one_column_per_machine_within_380_lines():
    ms = report.machines()
    assert ms, "no results file under benchmarks/results"
    doc = report.render_doc(ms)
    assert len(doc.splitlines()) <= 380
    head = next(line for line in doc.splitlines() if line.startswith("| ratio |"))
    assert head.count("|") == len(report.headline_machines(ms)) + 2  # the ratio's name, then a column per machine
    suites = {k for k, d in ms.items() if "decode_small" in d or "vllm_peer" in d}
    assert suites <= set(report.headline_machines(ms))  # a one-part file (multi_device) has no headline column
    for key in ms:
        assert f"`benchmarks/results/{key}.json`" in doc  # each column's conditions
    block = report.readme_block(ms)
    assert len(block.splitlines()) <= 12 and "docs/performance.md" in block
    assert "/work/" not in doc and "/root/" not in doc  # no machine's paths
    with open(report.DOC) as f:
        assert f.read() == doc, "docs/performance.md is stale: run python -m benchmarks.report --readme README.md"
    with open(os.path.join(report.ROOT, "README.md")) as f:
        assert block in f.read(), "the README's perf block is stale: run python -m benchmarks.report --readme README.md"


def test_every_ascend_graph_op_the_code_names_is_defined():
    """An op removed while a benchmark or example still calls it fails here, not when the suite
    reaches it."""
    for module in ("ascend_graph.kernels.ops", "ascend_graph.attention.live", "ascend_graph.moe.experts",
                   "ascend_graph.kv_cache", "ascend_graph.kernels.triton_attention"):  # the modules defining ops
        importlib.import_module(module)
    named = {name for folder in ("ascend_graph", "benchmarks", "examples")
             for path in pathlib.Path(report.ROOT, folder).rglob("*.py")
             for name in re.findall(r"torch\.ops\.ascend_graph\.(\w+)", path.read_text(encoding="utf-8"))}
    assert {"rows_mm", "decode_attention", "write_slots"} <= named
    assert sorted(n for n in named if not hasattr(torch.ops.ascend_graph, n)) == []


@pytest.mark.parametrize("module", sorted(p.stem for p in pathlib.Path(report.ROOT, "benchmarks").glob("*.py")
                                          if p.stem != "__init__"))
def test_every_benchmark_module_imports(module):
    importlib.import_module(f"benchmarks.{module}")


@pytest.mark.xdist_group("distributed")
def test_the_multi_device_benchmark_runs_tp2_against_tp1_with_equal_tokens():
    """A smoke run of ``benchmarks.multi_device``: both worlds decode the small model (the eager
    graph backend: no compile), TP=2's greedy tokens equal the unsharded model's, and the profiler
    sees the two all_reduces per layer a TP step holds."""
    from benchmarks import multi_device

    res = multi_device.measure("small", (2,), rounds=1, calls=1, quick=True, backend="eager", greedy_steps=2,
                               gloo_rounds=1, gloo_calls=2, one_thread=False, timeout_s=120)
    row, = res["rows"]
    assert res["tokens_equal"] and row["tokens"]["ranks_equal"] and row["tokens"]["tp1_threads_equal"]
    assert row["collectives"]["all_reduces_profiled"] == res["all_reduces_per_step"] == 2 * res["layers"]
    assert row["tp2_over_tp1"]["rounds"] == 1 and row["tp1_ms"] > 0 and row["tp2_ms"] > 0
    assert row["gloo"]["step"]["bytes"] == 2 * res["hidden"] * 4  # [2, hidden] float32
