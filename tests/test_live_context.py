"""The live-context benchmarks' pure parts: the sweep's arithmetic, its JSON's shape, its targets
and tables, the before/after table, and the caches it fills. No timing is asserted: every figure
below is hand-made, and every expected value is worked out by hand from it."""

import json

import pytest
import torch

from benchmarks import before_after, report, tables
from benchmarks.common import linear_fit
from benchmarks.live_context import medians, model_case, round_ratios, width_ratios
from benchmarks.models import decode_rows, filled_tables
from benchmarks.targets import targets


def lc_run() -> dict:
    """Two cases: the small model's step flat in max_model_len, the V2-Lite slice's 1.3x at 32768
    for batch 8 (1.05x for batch 1); context sweeps on the line 1 ms + 2 µs per token."""
    def case(model, dtype, ratio_8):
        width = [{"batch": b, "step_s": {"256": 0.010, "4096": 0.010 * (1 + (r - 1) / 2), "32768": 0.010 * r},
                  "ratio": {"256": 1.0, "4096": 1 + (r - 1) / 2, "32768": r},
                  "round_ratios": {"4096": [1.0, 1.0, 1.0], "32768": [r - 0.2, r, 1.1]}}
                 for b, r in ((1, 1.05), (8, ratio_8))]
        steps = {str(c): 0.001 + 2e-6 * c for c in (64, 256, 1024)}
        fit = {**linear_fit([64, 256, 1024], list(steps.values())), "cache_bytes_per_token": 1152,
               "copy_bytes_per_s": 20e9, "context_bytes_per_s": 8 * 1152 / 2e-6}
        return {"model": model, "dtype": dtype, "backends": {"attention": "cpu_kernel"}, "width": width,
                "context": {"batch": 8, "max_model_len": 1024, "step_s": steps, "fit": fit}}
    return {"widths": [256, 4096, 32768], "context": 256, "sizes": [1, 8], "contexts": [64, 256, 1024],
            "context_batch": 8, "rounds": 3, "block_size": 16,
            "cases": {"small_float32": case("small", "float32", 1.0),
                      "v2_lite_slice_bfloat16": case("v2_lite_slice", "bfloat16", 1.3)}}


def test_a_line_fits_itself_and_a_bent_one_leaves_its_residuals():
    exact = linear_fit([64, 256, 1024], [1.064, 1.256, 2.024])  # 1 + 0.001 x
    assert exact["slope"] == pytest.approx(1e-3) and exact["intercept"] == pytest.approx(1.0)
    assert exact["r2"] == pytest.approx(1.0) and exact["rms_residual"] == pytest.approx(0, abs=1e-12)
    bent = linear_fit([0, 1, 2], [0, 2, 2])  # least squares: 1/3 + x; residuals -1/3, 2/3, -1/3
    assert bent["slope"] == pytest.approx(1.0) and bent["intercept"] == pytest.approx(1 / 3)
    assert bent["residuals"] == pytest.approx([-1 / 3, 2 / 3, -1 / 3])
    assert bent["rms_residual"] == pytest.approx((2 / 9) ** 0.5)
    assert bent["max_relative_residual"] == pytest.approx(1.0)  # -1/3 where the line is at 1/3
    assert bent["r2"] == pytest.approx(1 - (6 / 9) / (8 / 3))


def test_width_ratios_are_over_the_narrowest_table_whatever_the_key_order():
    assert width_ratios({"32768": 3.0, "256": 2.0, "4096": 2.2}) == pytest.approx(
        {"256": 1.0, "4096": 1.1, "32768": 1.5})
    assert round_ratios({"256": [1.0, 2.0], "4096": [1.5, 2.0]}, "256") == {"4096": [1.5, 1.0]}


def test_cases_name_a_model_and_its_dtype():
    case = model_case("small_bfloat16")
    assert (case.name, case.dtype, case.context) == ("small", torch.bfloat16, 64)
    assert model_case("v2_lite_slice_bfloat16", quick=True).config.kv_lora_rank == 512


def test_medians_nest_what_before_after_flattens():
    nested = medians(lc_run())
    assert nested["small_float32"]["width"]["8"]["32768"] == pytest.approx(0.010)
    assert set(nested["v2_lite_slice_bfloat16"]["context"]) == {"64", "256", "1024"}
    turn = {"live_context": nested}
    table = before_after.compare({"old": [turn], "new": [turn]})
    assert table["live_context/v2_lite_slice_bfloat16/width/8/32768"]["new_over_old"] == pytest.approx(1.0)
    assert len(table) == 2 * (2 * 3 + 3)


def test_width_targets_take_each_case_at_its_worst_batch():
    rows = {t["target"]: t for t in targets({"live_context": lc_run()}) if t["part"] == "live_context"}
    v2 = rows["decode step, V2-Lite slice, bfloat16, context 256: t(max_model_len 32768) / t(256), worst batch"]
    assert v2["value"] == pytest.approx(1.3) and v2["met"] is False and v2["at_most"]
    assert (v2["limits"]["rounds"], v2["limits"]["rounds_at_goal"]) == (3, 2)  # 1.1, 1.3, 1.1 against 1.15
    small = rows["decode step, small model, float32, context 256: t(max_model_len 32768) / t(256), worst batch"]
    assert small["value"] == pytest.approx(1.05) and small["met"] is True
    absent = [t for t in targets({}) if t["part"] == "live_context"]
    assert len(absent) == 1 and absent[0]["met"] is None


def test_op_alone_target_is_its_share_of_copy_bandwidth():
    op = {"bfloat16": {"ms": 10.0, "live_cache_bytes": 75e6, "bytes_per_s": 7.5e9, "copy_bytes_per_s": 20e9,
                       "share_of_copy_bandwidth": 0.375}}
    step = {"step": "tuple (kv_c, k_pe)", "mode": "compiled", "num_blocks": 256, "median_ms": 20.0,
            "bytes_per_s": 2e9, "share_of_copy_bandwidth": 0.1}
    row = next(t for t in targets({"attention": {"op_alone": op, "rows": [step], "capacity_ratio": {}}})
               if t["target"].startswith("decode_attention op alone"))
    assert row["value"] == 0.375 and row["met"] is False


def test_tables_give_the_width_ratios_and_the_fit_per_case():
    lines = tables.live_context({"live_context": lc_run()})
    text = "\n".join(lines)
    assert "| V2-Lite slice, bfloat16 | 8 | 10.00 | 11.50 | 13.00 | 1.15 | 1.30 |" in text
    # slope 2 µs per token over batch 8: 250 ns per token per row; intercept 1 ms; r2 1
    assert "| small model, float32 | 8 | 1024 | 1.13 | 1.51 | 3.05 | 250.0 | 1.00 | 1.000 |" in text
    assert tables.live_context({}) == []


def test_before_after_table_shows_both_sides_ratios(tmp_path):
    old = {"live_context": {"small_float32": {"width": {"8": {"256": 0.002, "32768": 0.166}},
                                              "context": {"64": 0.01, "256": 0.01, "1024": 0.01}}}}
    new = {"live_context": {"small_float32": {"width": {"8": {"256": 0.002, "32768": 0.0021}},
                                              "context": {"64": 0.001, "256": 0.0014, "1024": 0.003}}}}
    run = {"conditions": {"cpu": "a CPU", "cores": 2, "torch": "2.13.0+cpu", "when": "2026-12-02 00:00:00"},
           "trees": {"old": "/tmp/old", "new": "/tmp/new"}, "commits": {"old": "b8430cc", "new": "44eed24"},
           "attention": "32,2048", "turns": {"old": [old], "new": [new]}, "table": before_after.compare(
               {"old": [old], "new": [new]}),
           "backends": {"old": {"small_float32": {"attention": "reference"}},
                        "new": {"small_float32": {"attention": "cpu_kernel"}}}}
    path = tmp_path / "before_after.json"
    path.write_text(json.dumps(run))
    text = report.before_after_markdown(str(path))
    assert "| small model, float32 | 8 | 32768 | 166.00 | 2.10 | 0.01 | 83.00 | 1.05 |" in text
    assert "| small model, float32 | before | 10.00 | 10.00 | 10.00 | 0.00 |" in text
    assert "before small model, float32 `reference`; after small model, float32 `cpu_kernel`" in text


class _TinyRunner:
    """What ``filled_tables`` reads of a runner: its block size and caches."""

    def __init__(self, caches, block_size):
        self.kv_caches, self.block_size = caches, block_size


def test_filled_tables_write_every_live_slot_and_no_other():
    from ascend_graph.engine.block_manager import BlockManager
    from ascend_graph.kv_cache import MLACacheSpec, allocate_kv_caches

    caches = allocate_kv_caches([MLACacheSpec(8, 4, torch.float32)] * 2, num_blocks=10, block_size=4)
    tables = filled_tables(_TinyRunner(caches, 4), BlockManager(10, 4), n=2, context=6)
    assert [len(t) for t in tables] == [2, 2]
    for cache in caches:
        for t in cache:
            written = t.flatten(2).abs().sum(-1) != 0  # [N, S]
            for table in tables:
                assert written[table[0]].all() and written[table[1], :2].all() and not written[table[1], 2:].any()
            others = [b for b in range(10) if b not in {*tables[0], *tables[1]}]
            assert not written[others].any()  # the null block included
            for table in tables:  # one entry per row, on each of its tokens
                rows = t[list(table)].flatten(0, 1)[:6]
                assert torch.equal(rows, rows[:1].expand_as(rows))
            assert not torch.equal(t[tables[0][0], 0], t[tables[1][0], 0])
    steps = decode_rows(tables, 5, 4, vocab=100)
    assert [(s.num_cached, list(s.block_table)) for s in steps] == [(4, list(t)) for t in tables]
    assert [list(s.block_table) for s in decode_rows(tables, 4, 4, 100)] == [list(t[:1]) for t in tables]


def test_attention_table_gives_the_op_against_the_products_before_it():
    dims = {"batch": 32, "context": 2048, "kv_lora_rank": 512, "rope": 64, "dtype": "bfloat16"}
    op = {"bfloat16": {"ms": 10.0, "live_cache_bytes": 75.5e6, "bytes_per_s": 7.55e9, "copy_bytes_per_s": 20e9,
                       "share_of_copy_bandwidth": 0.3775}}
    vs = {"live": {"max_model_len": 2048, "ms": 10.0, "before_ms": 8.0, "after_over_before": 1.25,
                   "quartiles": [1.2, 1.3]},
          "wide": {"max_model_len": 32768, "ms": 10.0, "before_ms": 128.0, "after_over_before": 0.078,
                   "quartiles": [0.07, 0.08]}}
    text = "\n".join(tables.attention({"attention": {
        "conditions": {"dims": dims}, "copy_bytes_per_s": 20e9, "rows": [], "capacity_ratio": {}, "op_alone": op,
        "op_against_before": vs}}))
    assert "| bfloat16 | 10.00 | 76 | 7.55 | 20.0 | 0.38 |" in text
    assert "| 2048 | 10.00 | 8.00 | 1.25 | 1.20–1.30 |" in text and "| 32768 | 10.00 | 128.00 | 0.08 | 0.07–0.08 |" in text
