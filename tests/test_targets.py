"""The benchmark report's target rows: each judged against the issue's goal, on hand-made results.

The suite's numbers vary from run to run; what must not vary is how a number is judged. The goals
below are the issue's own (``graph >= 3x eager`` at batch 1 on the small model, peak RSS at most
1.1x eager's, the MoE layer within 2x of its roofline).
"""

from benchmarks.report import markdown
from benchmarks.targets import targets


CONDITIONS = {"torch": "2.13.0+cpu", "python": "3.11", "cpu": "a CPU", "cores": 2, "torch_threads": 1,
              "when": "today"}


def by_name(rows: list[dict], prefix: str) -> dict:
    return next(r for r in rows if r["target"].startswith(prefix))


def small_run(speedup: float) -> dict:
    return {"decode_small": {"rows": [{"batch": 1, "speedup": speedup}]}}


def test_a_part_that_did_not_run_is_neither_met_nor_missed():
    rows = targets({})
    assert rows and all(r["met"] is None and r["value"] is None for r in rows)
    assert "| not run |" in markdown({"conditions": CONDITIONS})


def test_at_least_and_at_most_goals_are_judged_on_their_side():
    assert by_name(targets(small_run(3.2)), "small model: graph / eager step time, batch 1")["met"] is True
    assert by_name(targets(small_run(2.9)), "small model: graph / eager step time, batch 1")["met"] is False
    memory = {"model": "v2_lite_slice", "peak_ratio": 1.2}
    assert by_name(targets({"memory": memory}), "peak RSS")["met"] is False
    assert by_name(targets({"memory": {**memory, "peak_ratio": 1.05}}), "peak RSS")["met"] is True


def test_a_miss_that_rounds_to_the_goal_is_printed_with_three_decimals():
    moe = {"tokens": 32, "experts_used": 59, "bytes": 1_000_000_000, "copy_bytes_per_s": 20e9,
           "compiled decode (now)": {"ms": 100.06, "GB_per_s": 1e9 / 0.10006 / 1e9}}
    row = by_name(targets({"moe_forms": {"rows": [moe]}}), "V2-Lite MoE layer alone")
    assert row["met"] is False and 0.4995 < row["value"] < 0.5
    assert "| ≥ 0.5 | 0.500 | **no** |" in markdown({"conditions": CONDITIONS, "moe_forms": {"rows": [moe]}})


def test_the_moe_bound_names_the_few_row_kernel_gap_only_when_it_was_measured():
    moe = {"tokens": 32, "experts_used": 59, "bytes": 1_000_000_000, "copy_bytes_per_s": 20e9,
           "compiled decode (now)": {"ms": 100.0, "GB_per_s": 10.0}}
    few = [{"rows": 1, "aten_bytes_per_s": 9e9, "kernel_bytes_per_s": 26e9},
           {"rows": 3, "aten_bytes_per_s": 12.7e9, "kernel_bytes_per_s": 23.6e9}]
    bound = by_name(targets({"moe_forms": {"rows": [moe]}, "compute": {"few_rows": few}}), "V2-Lite MoE")["bound"]
    assert "3-row products over plain row-major bf16 weights stream at 12.7 GB/s with aten and 23.6 GB/s" in bound
    before = {**moe, "compiled decode, _grouped_mm (before)": {"ms": 180.0, "GB_per_s": 1e9 / 0.18 / 1e9}}
    assert "as before: 180.0 ms, ratio 0.28)" in by_name(targets({"moe_forms": {"rows": [before]}}), "V2-Lite MoE")["bound"]
    assert "row-major" not in by_name(targets({"moe_forms": {"rows": [moe]}}), "V2-Lite MoE")["bound"]


def v2_run() -> dict:
    """Batch 1 streams 750 MB in 30 ms (25 GB/s); batches 8 and 32 with their matmuls timed alone."""
    def row(batch, graph_s, total, routed, **more):
        return {"batch": batch, "graph_s": graph_s, "eager_s": 2 * graph_s, "speedup": 2.0, "copy_bytes_per_s": 20e9,
                "bytes": {"total": total, "routed_experts": routed}, **more}
    return {"decode_v2": {"rows": [
        row(1, 0.030, 750e6, 100e6, transformers_s=0.090, graph_vs_transformers=3.0,
            round_ratios={"eager": [2.4, 2.6, 2.55], "transformers": [2.9, 3.1, 3.0]}),
        row(8, 0.100, 1000e6, 300e6, transformers_s=0.240, graph_vs_transformers=2.4, matmuls_s=0.070),
        row(32, 0.200, 1200e6, 500e6, matmuls_s=0.150, graph_frozen_s=0.180, matmuls_packed_s=0.100)]},
        "compute": {"rows": [{"batch": 32, "step_flops": 24e9, "bf16_matmul_flops_per_s": 120e9,
                              "bf16_packed_matmul_flops_per_s": 150e9}]}}


def attention_run(floor_ms: float, floor_share: float) -> dict:
    """Decode attention at V2-Lite dims, batch 32, context 2048: the compiled step at 0.1 of copy
    bandwidth, and the floor (aten's matmuls over KV gathered beforehand) as given."""
    dims = {"batch": 32, "context": 2048, "heads": 16, "rope": 64, "kv_lora_rank": 512}
    return {"conditions": {"dims": dims}, "capacity_ratio": {"tuple (kv_c, k_pe)/compiled": 1.05},
            "rows": [{"step": "tuple (kv_c, k_pe)", "mode": "compiled", "num_blocks": 256, "bytes_per_s": 2e9,
                      "share_of_copy_bandwidth": 0.1},
                     {"step": "floor: matmuls over pre-gathered KV (eager)", "mode": "probe", "num_blocks": 256,
                      "median_ms": floor_ms, "share_of_copy_bandwidth": floor_share}]}


def test_a_missed_batch_8_goal_states_what_it_leaves_for_the_routed_experts():
    row = by_name(targets(v2_run()), "V2-Lite slice: graph / transformers, batch 8")
    # 240 ms / 3 = 80 ms allowed; the other matmuls take 70 ms; 300 MB in the 10 ms left is 30 GB/s
    assert row["met"] is False
    assert ("take 70 ms, which leaves 10 ms of the goal's 80 ms for the 300 MB of routed experts: 30 GB/s, "
            "against the 25.0 GB/s at which the batch-1 graph step streams its weights") in row["bound"]


def test_a_rate_or_share_under_the_printed_precision_is_not_printed_as_zero():
    """A Zen 3 run left 675 ms for 311 MB (0.46 GB/s) and its attention floor reached 0.004 of copy
    bandwidth: "0 GB/s" and "reach 0.00" said neither."""
    run = v2_run()
    run["decode_v2"]["rows"][1]["transformers_s"] = 30.0  # 10 s allowed: 300 MB in 9.93 s left
    row = by_name(targets(run), "V2-Lite slice: graph / transformers, batch 8")
    assert "for the 300 MB of routed experts: 0.03 GB/s," in row["bound"]
    bound = by_name(targets({"attention": attention_run(900.0, 0.0042)}), "decode attention b32")["bound"]
    assert "beforehand (aten's) reach 0.0042" in bound


def test_batch_32_matmuls_alone_past_twice_the_roofline_are_named_as_such():
    row = by_name(targets(v2_run()), "V2-Lite slice batch 32: roofline time / step time")
    # roofline 1200 MB / 20 GB/s = 60 ms: the goal allows 120 ms; the matmuls alone take 150 ms
    assert row["met"] is False and abs(row["value"] - 0.3) < 1e-9
    assert "take 150 ms, more than the 120 ms the goal allows the whole step" in row["bound"]


def test_the_frozen_batch_32_row_is_bounded_by_its_pre_packed_matmuls():
    row = by_name(targets(v2_run()), "V2-Lite slice batch 32: roofline time / step time, freezing on")
    # 120 ms allowed; the pre-packed matmuls take 100 ms; 500 MB in the 20 ms left is 25 GB/s
    assert row["met"] is False and abs(row["value"] - 60 / 180) < 1e-9
    assert ("(oneDNN, these weights pre-packed), take 100 ms, which leaves 20 ms of the goal's 120 ms for the 500 MB "
            "of routed experts: 25 GB/s, against the 25.0 GB/s") in row["bound"]


def test_a_floor_just_past_the_allowance_is_printed_with_a_decimal():
    run = v2_run()
    run["decode_v2"]["rows"][2]["matmuls_s"] = 0.1201  # the goal allows 120 ms
    row = by_name(targets(run), "V2-Lite slice batch 32: roofline time / step time (within 2x)")
    assert "take 120.1 ms, more than the 120.0 ms the goal allows the whole step" in row["bound"]


def test_a_batch_1_row_counts_the_rounds_that_met_the_goal():
    rows = targets(v2_run())
    eager = by_name(rows, "V2-Lite slice: graph / eager, batch 1")["bound"]
    hf = by_name(rows, "V2-Lite slice: graph / transformers, batch 1")["bound"]
    assert "(graph and eager timed back to back) the ratio ran 2.40-2.60, at the goal or above in 2 of 3 rounds" in eager
    assert "(graph and transformers timed back to back) the ratio ran 2.90-3.10, at the goal or above in 2 of 3" in hf


def test_a_batch_1_row_is_bounded_by_the_read_ceiling_timed_in_its_rounds():
    run = v2_run()
    run["decode_v2"]["rows"][0].update(read_bytes_per_s=30e9, read_how="a read loop")
    eager = by_name(targets(run), "V2-Lite slice: graph / eager, batch 1")["bound"]
    # 750 MB at 30 GB/s: 25 ms; eager takes 60 ms, so at most 2.40; the 30 ms step is at 25 / 30
    assert ("at one core's read ceiling (30.0 GB/s in the same rounds, a read loop) its 750 MB take 25.0 ms: the ratio "
            "would be at most 2.40 with nothing else in the step, which runs at 0.83 of that ceiling") in eager
    assert "read ceiling" not in by_name(targets(v2_run()), "V2-Lite slice: graph / eager, batch 1")["bound"]


def test_a_floor_within_a_tenth_of_a_millisecond_of_the_allowance_leaves_nothing():
    run = v2_run()
    run["decode_v2"]["rows"][2]["matmuls_s"] = 0.119997  # the goal allows 120 ms
    row = by_name(targets(run), "V2-Lite slice batch 32: roofline time / step time (within 2x)")
    assert "take 120.0 ms, all of the 120.0 ms the goal allows the whole step" in row["bound"]
    assert "GB/s, against" not in row["bound"]


def test_a_floor_just_short_of_the_allowance_prints_what_it_leaves_with_a_decimal():
    run = v2_run()
    run["decode_v2"]["rows"][2]["matmuls_s"] = 0.1197  # the goal allows 120 ms
    row = by_name(targets(run), "V2-Lite slice batch 32: roofline time / step time (within 2x)")
    assert "take 119.7 ms, which leaves 0.3 ms of the goal's 120.0 ms for the 500 MB of routed experts: 1667 GB/s" \
        in row["bound"]


def test_a_floor_timed_in_the_compiled_forms_says_so_and_gives_the_aten_figure():
    run = v2_run()
    run["decode_v2"]["rows"][1].update(matmuls_s=0.060, matmuls_aten_s=0.070, rows_mm_max_rows=8)
    row = by_name(targets(run), "V2-Lite slice: graph / transformers, batch 8")
    assert ("replayed alone in the same rounds (as the compiled step runs them: `rows_mm` up to 8 rows, aten "
            "beyond; all in aten they take 70.0 ms), take 60 ms, which leaves 20 ms of the goal's 80 ms") in row["bound"]


def test_the_batch_32_compute_bound_takes_the_kernels_rate_where_it_was_measured():
    run = v2_run()
    plain = by_name(targets(run), "V2-Lite slice batch 32: roofline time / step time (within 2x)")["bound"]
    assert plain.startswith("24.0 GFLOP at the measured bf16 matmul rate (120 GFLOP/s) take 200 ms")
    run["compute"]["rows"][0]["bf16_kernel_matmul_flops_per_s"] = 200e9
    rows = targets(run)
    bound = by_name(rows, "V2-Lite slice batch 32: roofline time / step time (within 2x)")["bound"]
    assert bound.startswith("24.0 GFLOP at the measured bf16 matmul rate of `rows_mm`, as the compiled step runs its "
                            "dense products (200 GFLOP/s; aten 120) take 120 ms vs 60 ms of memory traffic: "
                            "compute-bound, share at most 0.50 at that rate")
    # the frozen step multiplies pre-packed weights with oneDNN: its bound keeps that rate
    frozen = by_name(rows, "V2-Lite slice batch 32: roofline time / step time, freezing on")["bound"]
    assert frozen.startswith("24.0 GFLOP at the measured pre-packed matmul rate (150 GFLOP/s) take 160 ms")


def test_the_attention_bound_takes_the_best_rate_measured_aten_or_kernel():
    att = attention_run(30.0, 0.12)
    compute = {"rows": [{"batch": 32, "step_flops": 1.0, "bf16_matmul_flops_per_s": 150e9},
                        {"batch": 64, "step_flops": 1.0, "bf16_matmul_flops_per_s": 180e9,
                         "bf16_kernel_matmul_flops_per_s": 200e9}]}
    bound = by_name(targets({"attention": att, "compute": compute}), "decode attention b32")["bound"]
    # 2 * 32 * 16 * 2048 * (2 * 512 + 64) = 2.28 GFLOP; at 200 GFLOP/s 11.4 ms; 0.12 * 30 ms of bytes
    assert "its 2.28 GFLOP at the best measured bf16 matmul rate (200 GFLOP/s) take 11 ms, i.e. at most 0.32" in bound


def test_the_attention_table_states_the_batch_1_comparison_as_measured():
    dims = {"batch": 32, "context": 2048, "dtype": "bfloat16"}
    one = {"context": 16384, "num_blocks": 1088, "in_place_ms": 6.0, "gathered_ms": 10.25, "same_output": True}
    row = {"step": "tuple (kv_c, k_pe)", "mode": "compiled", "num_blocks": 256, "median_ms": 20.0,
           "bytes_per_s": 4e9, "share_of_copy_bandwidth": 0.2}
    attention = {"conditions": {"dims": dims}, "copy_bytes_per_s": 20e9, "rows": [row], "capacity_ratio": {},
                 "batch_1": one}
    text = markdown({"conditions": CONDITIONS, "attention": attention})
    assert ("Batch 1, context 16384 (1088 blocks), compiled: 6.00 ms reading the cache blocks in place, 10.25 ms over "
            "a gathered copy") in text and "the same output." in text
    attention["batch_1"] = {**one, "same_output": False}
    assert "not bit for bit" in markdown({"conditions": CONDITIONS, "attention": attention})
