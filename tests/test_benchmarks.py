"""What keeps the benchmark figures honest: a ratio and its range come from samples of the same
rounds, and the committed results render into docs/performance.md and the README's block."""

from __future__ import annotations

import statistics

import pytest

from benchmarks import report
from benchmarks.common import ratio_of_rounds


def test_a_ratio_and_its_range_come_from_the_same_rounds():
    samples = {"eager": [4.0, 6.0, 5.0], "graph": [2.0, 2.0, 1.0]}
    r = ratio_of_rounds(samples, "eager", "graph")
    assert r["ratio"] == statistics.median(samples["eager"]) / statistics.median(samples["graph"])
    assert (r["min"], r["max"], r["rounds"]) == (2.0, 5.0, 3)  # each round's two samples, taken back to back
    with pytest.raises(ValueError, match="same rounds"):
        ratio_of_rounds({"eager": [4.0, 6.0], "graph": [2.0]}, "eager", "graph")


def test_the_committed_results_render_one_column_per_machine_within_300_lines():
    ms = report.machines()
    assert ms, "no results file under benchmarks/results"
    doc = report.render_doc(ms)
    assert len(doc.splitlines()) <= 300
    head = next(line for line in doc.splitlines() if line.startswith("| ratio |"))
    assert head.count("|") == len(ms) + 2  # the ratio's name, then one column per machine
    for key in ms:
        assert f"`benchmarks/results/{key}.json`" in doc  # each column's conditions
    block = report.readme_block(ms)
    assert len(block.splitlines()) <= 12 and "docs/performance.md" in block
    assert "/work/" not in doc and "/root/" not in doc  # no machine's paths
