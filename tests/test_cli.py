"""The ``ascend-graph`` command, run in-process through ``main(argv)``.

Small settings keep it quick: two capture sizes on the aot_eager backend (Inductor itself is
covered by the runner and engine parity tests), a few short requests, one timing round.
"""

from __future__ import annotations

import json

import pytest
import torch

from ascend_graph.cli import build_parser, commands, main, report
from ascend_graph.runner import GraphCompileWarning

QUICK = ["--backend", "aot_eager", "--capture-sizes", "1,2", "--max-model-len", "64", "--no-progress", "--json"]


def run_json(capsys, argv: list[str]) -> tuple[int, dict]:
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def test_help_explains_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    for command in ("demo", "generate", "parity", "bench"):
        assert command in out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "alternating rounds" in capsys.readouterr().out


def test_demo_json_reports_capture_throughput_parity_and_counters(capsys):
    code, r = run_json(capsys, ["demo", *QUICK, "--num-requests", "3", "--max-new-tokens", "6", "--rounds", "1"])
    assert code == 0
    assert set(r["capture"]) == {"1", "2"} and all(c["seconds"] > 0 for c in r["capture"].values())
    assert all(c["compile_cache"] is None for c in r["capture"].values()) and r["capture_start"] is None
    t = r["throughput"]
    assert t["graph"]["tokens_per_s"] > 0 and t["eager"]["tokens_per_s"] > 0
    # the JSON rounds the speedup to 2 decimals
    ratio = t["graph"]["tokens_per_s"] / t["eager"]["tokens_per_s"]
    assert t["speedup"] == pytest.approx(ratio, rel=0.02, abs=0.005)
    p = r["parity"]
    assert p["ok"] and p["tokens_identical"] and p["checked_run_tokens_identical"] and p["checked_run_tokens_agree"]
    assert p["tokens_agree"] and p["first_differences"] == []
    assert 0 <= p["max_logit_diff"] < 1e-4 and p["logit_rows_compared"] == sum(r["requests"]["new_tokens"])
    assert p["compare_step"]["checks"] > 0 and p["compare_step"]["failures"] == 0
    assert p["compare_step"]["max_cache_diff"] is not None and p["compare_step"]["untouched_ok"]
    c = r["counters"]
    assert c["graph_steps"] > 0 and c["recompiles"] == 0 and c["compiles"] == 2
    assert r["eager_counters"]["graph_steps"] == 0 and r["eager_counters"]["eager_steps"]["disabled"] > 0


def test_demo_reports_its_decode_step_at_its_live_context_and_near_max_model_len(capsys):
    code, r = run_json(capsys, ["demo", *QUICK, "--num-requests", "3", "--max-new-tokens", "6", "--rounds", "1"])
    assert code == 0
    req = r["requests"]
    assert req["live_context"] == commands.decode_contexts(req["prompt_lens"], req["new_tokens"])
    d = r["decode_step"]
    assert (d["max_model_len"], d["block_table_blocks"], d["rows"]) == (64, 4, 2)  # 64 tokens in blocks of 16
    near, workload = d["near_max_model_len"], d["workload_context"]
    assert near["live_context"]["max"] == 63 and near["live_context"]["min"] == 64 - d["new_tokens"] + 1
    assert workload["live_context"]["max"] < near["live_context"]["min"]
    assert near["ms_per_step"] > 0 and workload["ms_per_step"] > 0
    assert d["near_max_over_workload"] == pytest.approx(near["ms_per_step"] / workload["ms_per_step"], abs=0.01)


def test_decode_contexts_count_the_rows_each_request_decodes():
    # 4 prompt tokens and 3 new: the first from prefill, then decodes at 5 and 6 tokens; 1 new: none
    assert commands.decode_contexts([4, 10], [3, 1]) == {"min": 5, "max": 6, "mean": 5.5, "rows": 2}
    assert commands.decode_contexts([4], [1]) == {"min": None, "max": None, "mean": None, "rows": 0}


def test_width_sweep_is_over_the_base_engine():
    times = {"eager": {"tokens_per_s": 1.0, "ms_per_step": 9.0}, "graph": {"tokens_per_s": 5.0, "ms_per_step": 2.0},
             "graph@4096": {"tokens_per_s": 4.0, "ms_per_step": 2.5}}
    assert commands.width_sweep(times, 512) == {"512": {"tokens_per_s": 5.0, "ms_per_step": 2.0, "over_base": 1.0},
                                                "4096": {"tokens_per_s": 4.0, "ms_per_step": 2.5, "over_base": 1.25}}


def test_demo_with_aot_inductor_loads_its_packages_on_the_second_run(capsys, tmp_path):
    argv = ["demo", "--backend", "inductor", "--aot-inductor", "--compile-cache-dir", str(tmp_path),
            "--capture-sizes", "2", "--max-model-len", "64", "--no-progress", "--json", "--num-requests", "2",
            "--max-new-tokens", "4", "--rounds", "1"]
    for compiles, loaded, start in ((1, 0, "cold"), (0, 1, "warm")):
        code, r = run_json(capsys, argv)
        assert code == 0 and r["parity"]["ok"] and r["parity"]["compare_step"]["failures"] == 0
        c = r["counters"]
        assert (c["compiles"], c["packages_loaded"]) == (compiles, loaded) and c["graph_steps"] > 0
        assert r["capture"]["2"]["compile_cache"] == ("miss" if compiles else "hit") and r["capture_start"] == start


@pytest.mark.parametrize("outcomes, start", [(["miss", "miss"], "cold"), (["hit", "hit"], "warm"),
                                             (["hit", "bypass"], "mixed"), (["miss", "bypass"], "cold"),
                                             ([None, None], None)])
def test_demo_capture_table_names_each_sizes_cache_outcome_and_the_start(outcomes, start):
    capture = {str(s): {"seconds": 1.5, "memory_bytes": 0, "compile_cache": o} for s, o in zip((1, 2), outcomes)}
    lines = report.capture_lines(capture)
    assert report.capture_start(capture) == start
    assert lines[-1].split()[:2] == ["total", "3.00"] and (f"({start} start)" in lines[-1]) == (start is not None)
    assert [line.split()[-1] for line in lines[2:4]] == [o or "-" for o in outcomes]


@pytest.mark.parametrize("flag, precompile", [([], None), (["--precompile"], True), (["--no-precompile"], False)])
def test_precompile_flags_set_the_option_and_leave_its_default_alone_otherwise(flag, precompile):
    args = build_parser().parse_args(["demo", *QUICK, *flag])
    assert commands.graph_config(args, graph=True).inductor.precompile is precompile


def test_aot_inductor_on_another_backend_exits_2_naming_it(capsys):
    assert main(["demo", *QUICK, "--aot-inductor"]) == 2
    assert "inductor.aot=True compiles with Inductor" in capsys.readouterr().err


def test_parity_on_the_builtin_model_passes(capsys):
    code, r = run_json(capsys, ["parity", *QUICK, "--model", "small-v3", "--num-requests", "3",
                                "--max-new-tokens", "5"])
    assert code == 0 and r["ok"] and r["tokens_identical"]
    assert len(r["steps"]) == r["summary"]["checks"] > 0
    assert all(s["ok"] and s["untouched_ok"] for s in r["steps"])


def test_speculative_parity_and_generate_on_small_v3_with_its_mtp_layer(capsys):
    """--num-speculative-tokens 2: every verify step's logits and its MTP drafts, and every draft
    chain step's (with the MTP layer's cache), graph against eager; and generate's tokens those of
    decoding without it."""
    code, r = run_json(capsys, ["parity", *QUICK, "--model", "small-v3", "--num-requests", "3",
                                "--max-new-tokens", "5", "--num-speculative-tokens", "2"])
    assert code == 0 and r["ok"] and r["tokens_identical"] and r["summary"]["checks"] > 0
    spec = r["counters"]["speculative"]
    assert spec["num_speculative_tokens"] == 2 and spec["verify_steps"] > 0 and spec["drafted_tokens"] > 0
    kinds = [s["kind"] for s in r["steps"]]
    assert kinds.count("draft") == r["summary"]["draft_checks"] == spec["draft_chain"]["graph_steps"] > 0
    assert kinds.count("decode") > 0
    argv = ["generate", *QUICK, "--model", "small-v3", "--prompt-ids", "1,2,3", "--prompt-ids", "9,8,7,6,5",
            "--max-new-tokens", "6"]
    _, plain = run_json(capsys, argv)
    _, drafted = run_json(capsys, [*argv, "--num-speculative-tokens", "1"])
    assert [o["tokens"] for o in drafted["outputs"]] == [o["tokens"] for o in plain["outputs"]]
    assert drafted["counters"]["speculative"]["verify_steps"] == drafted["counters"]["decode_steps"] > 0


def test_parity_in_bfloat16_on_inductor_passes_where_graph_and_eager_round_apart(capsys):
    """small-v3 in bfloat16, Inductor: fused kernels round otherwise than eager's op-by-op bfloat16,
    so logits differ by a few hundredths (each as close to a float64 run as the other; parity.py),
    and a separate eager run may pick the other token at a near-tie, or continue from other
    experts after a router's near-tie that the checked graph run reproduced. Under the former
    per-element tolerance 2 of these 32 steps failed, and the differing tokens failed the run."""
    code, r = run_json(capsys, ["parity", "--model", "small-v3", "--dtype", "bfloat16", "--backend", "inductor",
                                "--capture-sizes", "1,4", "--no-progress", "--json"])
    assert code == 0 and r["ok"] and r["tokens_agree"]
    assert r["summary"]["checks"] == 32 and all(s["ok"] and s["untouched_ok"] for s in r["steps"])
    assert all(f["near_tie"] or f["after_routing_near_tie"] for f in r["first_differences"])


def test_parity_fails_with_exit_code_1_when_the_graph_is_wrong(capsys, monkeypatch):
    def off_by_a_little(gm, example_inputs, **kwargs):
        def run(*args):
            return tuple(o + 1e-2 if o.is_floating_point() else o for o in gm(*args))
        return run

    make_engine = commands.make_engine

    def skewed(model, args, graph, *a, **kw):
        return make_engine(model, args, graph, *a, **({"backend": off_by_a_little} if graph else {}), **kw)

    monkeypatch.setattr(commands, "make_engine", skewed)
    code, r = run_json(capsys, ["parity", *QUICK, "--num-requests", "2", "--max-new-tokens", "3"])
    assert code == 1 and not r["ok"] and r["summary"]["failures"] == r["summary"]["checks"] > 0
    assert r["summary"]["max_logit_diff"] == pytest.approx(1e-2, rel=1e-3)


@pytest.mark.parametrize("command, extra", [
    ("demo", ["--num-requests", "3", "--max-new-tokens", "4", "--rounds", "1"]),
    ("generate", ["--prompt-ids", "1,2,3", "--prompt-ids", "9,8,7,6,5", "--max-new-tokens", "4"]),
    ("parity", ["--num-requests", "3", "--max-new-tokens", "4"]),
])
def test_a_size_that_fails_to_compile_is_shown_in_the_report_and_the_json(command, extra, monkeypatch):
    """The graph engine's size 2 fails to compile (``test_engine.fails_at_two_rows``): the
    readable report names the size and the exception, the JSON counters carry it, the run goes on."""
    from test_engine import fails_at_two_rows

    make_engine = commands.make_engine

    def failing(model, args, graph, *a, **kw):
        return make_engine(model, args, graph, *a, **({"backend": fails_at_two_rows} if graph else {}), **kw)

    monkeypatch.setattr(commands, "make_engine", failing)
    args = build_parser().parse_args([command, *QUICK, *extra])
    with pytest.warns(GraphCompileWarning, match="capture size 2 failed"):
        result, text, code = getattr(commands, f"run_{command}")(args)
    error = "RuntimeError: simulated compiler failure at 2 rows"
    assert code == 0 and result["counters"]["compile_errors"] == {"2": error}
    assert result["counters"]["compile_failures"] == 1 and result["counters"]["eager_steps"]["compile_failed"] > 0
    assert f"WARNING: 1 graph compile(s) failed" in text and f"\n  size 2: {error}" in text


def test_generate_from_token_ids_graph_equals_no_graph(capsys):
    argv = ["generate", *QUICK, "--prompt-ids", "1,2,3", "--prompt-ids", "9,8,7,6,5", "--max-new-tokens", "5"]
    code, graph = run_json(capsys, argv)
    assert code == 0 and [len(o["tokens"]) for o in graph["outputs"]] == [5, 5]
    assert graph["counters"]["graph_steps"] > 0
    code, eager = run_json(capsys, [*argv, "--no-graph"])
    assert [o["tokens"] for o in eager["outputs"]] == [o["tokens"] for o in graph["outputs"]]
    assert eager["counters"]["graph_steps"] == 0
    code, sampled = run_json(capsys, [*argv, "--no-graph", "--temperature", "1", "--seed", "4"])
    assert code == 0 and [len(o["tokens"]) for o in sampled["outputs"]] == [5, 5]


def test_bench_json_rows_per_batch_size_and_output_file(capsys, tmp_path):
    out = tmp_path / "bench.json"
    code, r = run_json(capsys, ["bench", *QUICK, "--batch-sizes", "1,2", "--prompt-len", "4", "--new-tokens", "4",
                                "--rounds", "1", "--output", str(out)])
    assert code == 0 and [row["batch"] for row in r["rows"]] == [1, 2]
    assert all(row["graph"]["tokens_per_s"] > 0 and row["eager"]["ms_per_step"] > 0 for row in r["rows"])
    assert json.loads(out.read_text())["rows"] == r["rows"]


def test_bench_max_model_len_sweep_times_wider_tables_beside_the_base(capsys):
    code, r = run_json(capsys, ["bench", *QUICK, "--batch-sizes", "1,2", "--prompt-len", "4", "--new-tokens", "4",
                                "--rounds", "1", "--max-model-len-sweep", "256,64"])
    assert code == 0 and r["settings"]["max_model_len_sweep"] == [64, 256]
    for row in r["rows"]:
        assert row["live_context"] == {"min": 5, "max": 7, "mean": 6.0, "rows": 3 * row["batch"]}
        sweep = row["max_model_len_sweep"]
        assert set(sweep) == {"64", "256"} and sweep["64"]["over_base"] == 1.0
        assert sweep["64"]["ms_per_step"] == row["graph"]["ms_per_step"]
        assert sweep["256"]["over_base"] == pytest.approx(sweep["256"]["ms_per_step"] / row["graph"]["ms_per_step"],
                                                          abs=1e-3)
    assert main(["bench", *QUICK, "--prompt-len", "4", "--new-tokens", "4", "--max-model-len-sweep", "6"]) == 2
    assert "exceeds max_model_len 6" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["demo", "--capture-sizes", "0,2"], "expected comma-separated positive integers, got '0,2'"),
    (["demo", "--max-new-tokens", "many"], "expected a positive integer, got 'many'"),
    (["demo", "--backend", "tpu"], "invalid choice: 'tpu'"),
    (["bench", "--max-model-len-sweep", "4096,0"], "expected comma-separated positive integers, got '4096,0'"),
    (["generate", "--prompt-ids", "1,x"], "expected comma-separated token ids, got '1,x'"),
])
def test_bad_flag_values_stop_with_a_usage_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "/nowhere", "--prompt-ids", "1"], "neither a built-in model"),
    (["generate", "--no-graph", "--prompt-ids", "1,999"], "request 0: token id 999 at position 1 is outside"),
    (["generate", "--no-graph"], "give at least one --prompt-ids or --prompt"),
    (["generate", "--no-graph", "--prompt", "hello"], "needs a tokenizer"),
])
def test_bad_requests_exit_2_with_the_engine_error(capsys, argv, message):
    assert main([*argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_main_restores_torch_threads(capsys):
    before = torch.get_num_threads()
    main(["generate", "--no-graph", "--prompt-ids", "1,2", "--max-new-tokens", "2", "--threads", "1", "--json"])
    assert torch.get_num_threads() == before


def test_an_attention_fallback_is_shown_beside_the_compile_failures():
    """``RunnerStats.attention_fallbacks`` (an NPU prefill the fused operator does not take ran
    in torch) is a WARNING line of the reports, as a failed compile is."""
    reason = "torch: TND takes query head size 192 (value 128/192) on torch_npu 7.1, this layer has 80 (value 16)"
    lines = report.compile_failure_lines({"attention_fallbacks": {reason: 3}, "compile_errors": {},
                                          "compile_failures": 0})
    assert lines == [f"WARNING: attention ran a slower form 3 time(s) per layer: {reason}"]
    assert report.compile_failure_lines({"attention_fallbacks": {}, "compile_errors": {}}) == []
