"""The Engine-vs-vLLM benchmark's own logic, without vLLM: arguments, step timing, token checks, JSON.

Oracles: per-step times worked out by hand from a fake clock; token differences placed by hand.
The full run (vLLM in its venv, both models) is a benchmark, ``python -m benchmarks.vllm_peer``.
"""

import importlib.util
import json
import os
import sys
import time

import pytest
import torch

from benchmarks import vllm_peer, vllm_peer_rows, vllm_peer_sides, vllm_peer_worker, vllm_plugin_env
from benchmarks.vllm_peer_sides import decode_ms_per_step, interleaved_decode


def test_arguments_default_to_every_model_dtype_and_batch():
    args = vllm_peer.parse_args(["--vllm-python", "/x/python"])
    assert (args.models, args.dtypes, args.batches) == (["tiny", "v2lite"], ["float32", "bfloat16"], [1, 8, 32])
    assert args.json.endswith(os.path.join("benchmarks", "results", "vllm_peer.json"))
    assert (args.sides, args.capacity, args.graph_before) == (["vllm", "vllm_graph", "engine"], 8, None)


def test_arguments_take_comma_separated_lists():
    args = vllm_peer.parse_args(["--vllm-python", "p", "--models", "v2lite", "--dtypes", "bfloat16",
                                 "--batches", "1,32", "--json", "out.json"])
    assert (args.models, args.dtypes, args.batches, args.json) == (["v2lite"], ["bfloat16"], [1, 32], "out.json")


@pytest.mark.parametrize("argv", [[], ["--models", "huge"], ["--dtypes", "float16"], ["--batches", "0"],
                                  ["--new-tokens", "1"]])
def test_arguments_refuse_what_cannot_run(argv, capsys):
    with pytest.raises(SystemExit):
        vllm_peer.parse_args((["--vllm-python", "p"] if argv else []) + argv)


def test_decode_step_is_the_extra_time_of_the_extra_tokens():
    # 11 new tokens took 1.5 s, 1 new token 0.5 s: 10 decode steps in 1.0 s
    assert decode_ms_per_step(1.5, 0.5, 11) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="new_tokens"):
        decode_ms_per_step(1.0, 0.5, 1)


class FakeSide:
    """A side whose generations take ``prefill_s`` plus ``step_s[i]`` per token after the first,
    ``i`` counting its full (more than one token) generations; ``log`` records every call."""

    def __init__(self, name: str, prefill_s: float, step_s: list[float], log: list) -> None:
        self.name, self.prefill_s, self.step_s, self.full_runs, self.log = name, prefill_s, step_s, 0, log

    def __call__(self, batch: int, new_tokens: int) -> tuple[float, list[list[int]]]:
        self.log.append((self.name, new_tokens))
        step = self.step_s[self.full_runs] if new_tokens > 1 else 0.0
        self.full_runs += new_tokens > 1
        return self.prefill_s + step * (new_tokens - 1), [[7] * new_tokens] * batch


def test_interleaved_decode_takes_each_sides_median_round_after_a_warm_up():
    # warm-up at 1 s per step (ignored), then rounds at 20, 10 and 40 ms per step: median 20
    log = []
    sides = {"a": FakeSide("a", 0.3, [1.0, 0.020, 0.010, 0.040], log),
             "b": FakeSide("b", 0.1, [1.0, 0.005, 0.005, 0.006], log)}
    out = interleaved_decode(sides, batch=2, new_tokens=5, rounds=3)
    assert out["a"]["round_ms"] == pytest.approx([20.0, 10.0, 40.0]) and out["a"]["ms_per_step"] == pytest.approx(20.0)
    assert out["b"]["ms_per_step"] == pytest.approx(5.0)
    assert out["a"]["round_s"][0] == pytest.approx([0.3, 0.3 + 4 * 0.020])
    assert out["a"]["tokens"] == [[7] * 5] * 2 and out["a"]["tokens_stable"]


class FakeVllmSide(FakeSide):
    """A ``FakeSide`` whose generations spend ``forward_share`` of their time in the model's forward."""

    def __init__(self, *args, forward_share: float) -> None:
        super().__init__(*args)
        self.forward_share, self.forward_seconds = forward_share, None

    def __call__(self, batch: int, new_tokens: int) -> tuple[float, list[list[int]]]:
        seconds, tokens = super().__call__(batch, new_tokens)
        self.forward_seconds = seconds * self.forward_share
        return seconds, tokens


def test_a_side_that_times_its_forward_gets_the_forward_share_of_each_round():
    # 20 and 40 ms per step, 3/4 of every generation in the forward: 15 and 30 ms; the other side none
    log = []
    sides = {"a": FakeVllmSide("a", 0.3, [1.0, 0.020, 0.040], log, forward_share=0.75),
             "b": FakeSide("b", 0.1, [1.0, 0.005, 0.005], log)}
    out = interleaved_decode(sides, batch=1, new_tokens=5, rounds=2)
    assert out["a"]["forward_round_ms"] == pytest.approx([15.0, 30.0]) and "forward_round_ms" not in out["b"]
    row = vllm_peer.compare("tiny", "float32", 1, {"vllm": out["a"], "vllm_graph": out["b"]})
    assert row["forward_ms"] == {"vllm": pytest.approx(22.5)} and row["own_ms"] == {"vllm": pytest.approx(7.5)}
    assert vllm_peer_rows.render_split([row]) == []  # only one side split: nothing to set against it
    both = vllm_peer.compare("tiny", "float32", 1, {"vllm": out["a"], "vllm_graph": out["a"]})
    assert vllm_peer_rows.render_split([both])[2] == "| tiny | float32 | 1 | 22.50 | 22.50 | 1.00x | 7.50 | 7.50 |"
    merged = vllm_peer.merge_rounds(out, out)
    assert merged["a"]["forward_round_ms"] == pytest.approx([15.0, 30.0] * 2) and "forward_round_ms" not in merged["b"]


@pytest.mark.xdist_group("vllm")  # vLLM imported here: its environment changes stay in one worker
def test_the_vllm_worker_times_vllms_calls_of_the_model_forward(monkeypatch):
    """The worker's wrapper of vLLM's ``GPUModelRunner._model_forward`` (the name vLLM 0.32 calls)
    passes calls through and adds their seconds up."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("ASCEND_GRAPH_REQUIRE_VLLM"):
            pytest.fail("no vLLM in this interpreter: pip install 'ascend-graph[vllm]'")
        pytest.skip("no vLLM in this interpreter")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def forward(runner, x):
        time.sleep(0.02)
        return x + 1

    monkeypatch.setattr(GPUModelRunner, "_model_forward", forward)  # restored after the test
    counter = type("Counter", (), {"forward_seconds": 0.0})()
    vllm_peer_worker.time_model_forward(counter)
    assert GPUModelRunner._model_forward(None, 1) == 2 and GPUModelRunner._model_forward(None, 2) == 3
    # two 20 ms sleeps; the upper bound is a deadline (a generous margin for a loaded shared host),
    # against a counter that adds other time (e.g. clock readings), not a timing
    assert 0.04 <= counter.forward_seconds < 30.0


def test_a_stalled_one_token_generation_does_not_count_as_the_prefill():
    """Each round's 1-token time is the faster of its two 1-token generations: a host stall in the
    timed one (50 ms against 4) would make the round's step time negative."""
    calls = []

    def side(batch, new_tokens):
        calls.append(new_tokens)
        stalled = new_tokens == 1 and len(calls) == 3  # after the warm-up and the switch: round 1's timed one
        return (0.050 if stalled else 0.004) + 0.001 * (new_tokens - 1), [[7] * new_tokens] * batch

    out = interleaved_decode({"a": side}, batch=1, new_tokens=5, rounds=2)
    assert out["a"]["round_ms"] == pytest.approx([1.0, 1.0]) and out["a"]["round_s"][0][0] == pytest.approx(0.004)


def test_interleaved_decode_alternates_which_side_goes_first():
    log = []
    sides = {"a": FakeSide("a", 0.0, [0.0] * 4, log), "b": FakeSide("b", 0.0, [0.0] * 4, log)}
    interleaved_decode(sides, batch=1, new_tokens=3, rounds=3)
    warm_up, rounds = log[:2], [log[i:i + 6] for i in range(2, len(log), 6)]
    assert warm_up == [("a", 3), ("b", 3)]
    assert [[name for name, _ in r] for r in rounds] == [list("aaabbb"), list("bbbaaa"), list("aaabbb")]
    assert all([n for _, n in r] == [1, 1, 3, 1, 1, 3] for r in rounds)  # untimed 1, timed 1, timed 3


def test_interleaved_decode_times_a_probe_once_a_round_after_the_sides():
    log = []
    sides = {"a": FakeSide("a", 0.0, [0.0] * 3, log)}
    probe_s = []
    interleaved_decode(sides, batch=1, new_tokens=3, rounds=2, probe=lambda: log.append(("probe", 0)), probe_s=probe_s,
                       probe_pause_s=0.0)
    assert [name for name, _ in log] == ["a"] + ["a", "a", "a", "probe", "probe", "probe"] * 2 and len(probe_s) == 2


def test_a_batch_one_row_gets_the_floor_of_its_bytes_at_the_read_ceiling_of_its_rounds():
    """Floor = bytes / (ceiling bytes / fastest ceiling round); stock's ms over it, also round by
    round where the rounds pair up; other rows untouched."""
    from ascend_graph.models import DeepseekForCausalLM
    from benchmarks.roofline import batch_one_bytes

    ceiling = {"how": "a read loop", "bytes": 10 ** 9, "round_s": [0.05, 0.04, 0.08]}  # fastest 0.04: 25 GB/s
    row = {"model": "tiny", "dtype": "bfloat16", "batch": 1, "ms": {"vllm": 2.0}}
    out = vllm_peer.with_floor(row, ceiling, context=48)
    meta = DeepseekForCausalLM(vllm_peer.MODELS["tiny"](), dtype=torch.bfloat16, device="meta", init_weights=False)
    floor_ms = batch_one_bytes(meta, 48)["total"] / 25e9 * 1e3
    assert out["floor"]["floor_ms"] == pytest.approx(floor_ms) and out["floor"]["max_vs_vllm"] == pytest.approx(2.0 / floor_ms)
    assert out["floor"]["read_how"] == "a read loop" and "floor" not in row
    assert "round_max_vs_vllm" not in out["floor"]  # no stock rounds to pair with the ceiling's
    paired = vllm_peer.with_floor({**row, "round_ms": {"vllm": [2.0, 3.0, 4.0]}}, ceiling, context=48)["floor"]
    at = [floor_ms * s / 0.04 for s in ceiling["round_s"]]  # each round's floor at its own ceiling
    assert paired["round_max_vs_vllm"] == pytest.approx([2.0 / at[0], 3.0 / at[1], 4.0 / at[2]])
    assert "(its rounds" in vllm_peer_rows.render_floors([{**row, "floor": paired}])[0]
    assert "graph_max_vs_vllm" not in paired
    assert "at most" not in vllm_peer_rows.render_floors([{**row, "floor": paired}])[0]
    split = vllm_peer.with_floor({**row, "own_ms": {"vllm": 1.5, "vllm_graph": 0.5}}, ceiling, context=48)["floor"]
    assert split["graph_own_ms"] == 0.5 and split["graph_max_vs_vllm"] == pytest.approx(2.0 / (0.5 + floor_ms))
    assert "vLLM+graph at most" in vllm_peer_rows.render_floors([{**row, "floor": split}])[0]
    assert "round_graph_max_vs_vllm" not in split  # no rounds to pair
    rounds = {**row, "own_ms": {"vllm_graph": 0.5}, "round_ms": {"vllm": [2.0, 3.0, 4.0], "vllm_graph": [1.0, 1.5, 2.0]},
              "forward_round_ms": {"vllm_graph": [0.6, 1.0, 1.4]}}  # own work 0.4, 0.5, 0.6 ms
    by_round = vllm_peer.with_floor(rounds, ceiling, context=48)["floor"]["round_graph_max_vs_vllm"]
    assert by_round == pytest.approx([2.0 / (0.4 + at[0]), 3.0 / (0.5 + at[1]), 4.0 / (0.6 + at[2])])
    assert vllm_peer.with_floor({**row, "batch": 8}, ceiling, context=48) == {**row, "batch": 8}
    assert vllm_peer.with_floor(row, None, context=48) is row
    assert "batch 1 floor, tiny bfloat16" in vllm_peer_rows.render_floors([out, row])[0]


def test_rounds_are_shared_between_restarts_and_merged_across_them():
    assert vllm_peer.split_rounds(5, 2) == [3, 2] and vllm_peer.split_rounds(4, 4) == [1] * 4
    first = {"a": {"round_ms": [10.0, 30.0], "round_s": [[0.1, 0.2]] * 2, "tokens": [[1, 2]], "tokens_stable": True,
                   "ms_per_step": 20.0}}
    second = {"a": {"round_ms": [12.0], "round_s": [[0.1, 0.3]], "tokens": [[1, 2]], "tokens_stable": True,
                    "ms_per_step": 12.0}}
    merged = vllm_peer.merge_rounds(vllm_peer.merge_rounds(None, first), second)["a"]
    assert merged["round_ms"] == [10.0, 30.0, 12.0] and merged["ms_per_step"] == 12.0
    assert len(merged["round_s"]) == 3 and merged["tokens_stable"]
    other = {"a": {**second["a"], "tokens": [[1, 3]]}}  # a restarted side made other tokens
    assert not vllm_peer.merge_rounds(first, other)["a"]["tokens_stable"]


def test_restarts_are_checked_against_the_rounds(capsys):
    base = ["--vllm-python", "p"]
    assert vllm_peer.parse_args(base + ["--rounds", "4", "--restarts", "2"]).restarts == 2
    for bad in (["--restarts", "0"], ["--rounds", "2", "--restarts", "3"]):
        with pytest.raises(SystemExit):
            vllm_peer.parse_args(base + bad)
        assert "--restarts must be between 1 and --rounds" in capsys.readouterr().err


def test_interleaved_decode_notices_tokens_changing_between_rounds():
    calls = iter(range(100))
    out = interleaved_decode({"a": lambda batch, n: (0.0, [[next(calls)] * n])}, batch=1, new_tokens=3, rounds=2)
    assert not out["a"]["tokens_stable"]


def test_equal_tokens_have_no_difference():
    assert vllm_peer.first_difference([[1, 2], [3, 4]], [[1, 2], [3, 4]]) is None


def test_first_difference_names_request_position_and_both_tokens():
    vllm = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    engine = [[1, 2, 3], [4, 5, 0], [7, 0, 9]]
    assert vllm_peer.first_difference(vllm, engine) == {"request": 1, "position": 2, "vllm": 6, "side": 0,
                                                         "requests_differing": 2}


def test_first_difference_of_a_shorter_output_points_past_its_end():
    assert vllm_peer.first_difference([[1, 2, 3]], [[1, 2]]) == {"request": 0, "position": 2, "vllm": 3,
                                                                  "side": None, "requests_differing": 1}


def side(ms: float, tokens: list[list[int]]) -> dict:
    return {"ms_per_step": ms, "round_ms": [ms], "round_s": [[0.1, 0.1 + ms]], "tokens": tokens,
            "tokens_stable": True}


def test_a_row_claims_a_ratio_only_where_the_tokens_agree():
    row = vllm_peer.compare("tiny", "float32", 8, {"vllm": side(6.0, [[1, 2]]), "vllm_graph": side(4.0, [[1, 2]]),
                                                   "engine": side(3.0, [[1, 5]])})
    assert row["ms"] == {"vllm": 6.0, "vllm_graph": 4.0, "engine": 3.0}
    graph, engine = row["vs_vllm"]["vllm_graph"], row["vs_vllm"]["engine"]
    assert graph["ratio"] == pytest.approx(1.5) and graph["tokens_equal"] and graph["first_difference"] is None
    assert engine["ratio"] is None and not engine["tokens_equal"] and engine["first_difference"]["position"] == 1
    assert "vllm" not in row["vs_vllm"] and "capacity" not in row and "before_after" not in row
    head, _, line = vllm_peer.render([row])
    assert head == ("| model | dtype | batch | vLLM ms | vLLM+graph ms | Engine ms | vLLM / vLLM+graph | vLLM / Engine "
                    "| tokens equal to vLLM |")
    assert line == ("| tiny | float32 | 8 | 6.00 | 4.00 | 3.00 | 1.50x (1.50-1.50) | — "
                    "| vLLM+graph: yes; Engine: no (request 0, token 1) |")


def test_a_ratio_comes_with_the_range_of_its_rounds_own_ratios():
    """The median of each side's rounds gives the ratio; the rounds paired as they ran give the range."""
    stock = {**side(6.0, [[1]]), "round_ms": [6.0, 9.0, 5.0]}
    graph = {**side(5.0, [[1]]), "round_ms": [4.0, 10.0, 5.0]}
    row = vllm_peer.compare("tiny", "float32", 1, {"vllm": stock, "vllm_graph": graph})
    cmp = row["vs_vllm"]["vllm_graph"]
    assert cmp["ratio"] == pytest.approx(6.0 / 5.0)
    assert cmp["round_ratios"] == pytest.approx([1.5, 0.9, 1.0])
    assert vllm_peer_rows.ratio_cell(cmp) == "1.20x (0.90-1.50)"
    near_ties = {**cmp, "ratio": None, "ratio_near_ties": 1.2}
    assert vllm_peer_rows.ratio_cell(near_ties) == "1.20x (near-ties; 0.90-1.50)"


def test_capacity_and_before_after_are_measured_against_vllm_graph():
    # 8x the cache: 2.2 ms against 2.0 (1.10x slower); the older checkout 2.5 ms (after / before 0.80x)
    timed = {"vllm": side(3.0, [[1, 2]]), "vllm_graph": side(2.0, [[1, 2]]),
             "vllm_graph_before": side(2.5, [[1, 2]]), "vllm_graph_8x": side(2.2, [[1, 3]])}
    row = vllm_peer.compare("tiny", "bfloat16", 1, timed)
    assert row["capacity"] == {"multiplier": 8, "ratio": pytest.approx(1.1), "tokens_equal": False}
    assert row["before_after"] == {"ratio": pytest.approx(0.8), "tokens_equal": True}
    assert row["vs_vllm"]["vllm_graph_8x"]["ratio"] is None  # its tokens differ from vLLM's too
    head, _, line = vllm_peer.render([row])
    assert ("| vLLM+graph before ms | vLLM+graph 8x cache ms | vLLM / vLLM+graph | 8x cache / 1x "
            "| after / before |") in head
    assert "| 1.50x (1.50-1.50) | 1.10x | 0.80x |" in line and line.endswith("; 8x = 1x: no |")


def test_side_names_and_labels():
    assert vllm_peer.capacity_side(8) == "vllm_graph_8x"
    assert vllm_peer_rows.label("vllm_graph_8x") == "vLLM+graph 8x cache"
    assert [vllm_peer_rows.label(s) for s in ("vllm", "vllm_graph", "engine")] == ["vLLM", "vLLM+graph", "Engine"]


def test_result_json_holds_rows_settings_machine_and_every_sides_versions():
    args = vllm_peer.parse_args(["--vllm-python", "p", "--models", "tiny", "--batches", "1,8"])
    row = vllm_peer.compare("tiny", "float32", 1, {"vllm": side(4.0, [[1]]), "engine": side(2.0, [[1]])})
    about = {"tiny/float32": {"vllm": {"init_s": 30.0, "torch_threads": 2, "versions": {"vllm": "0.32.0"}},
                              "engine": {"init_s": 20.0}}}
    out = json.loads(json.dumps(vllm_peer.result_json(args, vllm_peer.Settings(), [row], about)))
    assert out["benchmark"] == "vllm_peer" and out["rows"][0]["vs_vllm"]["engine"]["ratio"] == pytest.approx(2.0)
    assert {"cpu", "cores", "torch", "when"} <= set(out["conditions"])
    assert out["versions"]["vllm_side"] == {"vllm": "0.32.0"} and "torch" in out["versions"]["engine_side"]
    assert out["models"]["tiny"]["kv_lora_rank"] + out["models"]["tiny"]["qk_rope_head_dim"] == 576
    assert out["settings"]["block_size"] == 16 and "ratio" in out["note"]
    assert out["sides"] == {"tiny/float32": {"vllm": {"init_s": 30.0, "torch_threads": 2}, "engine": {"init_s": 20.0}}}
    assert out["compared"]["capacity"] == 8 and out["compared"]["graph_before"] is None
    assert out["compared"]["additional_config"]["torchair_graph_config"] == {"enabled": True,
                                                                            "graph_batch_sizes": [1, 8]}


def test_the_v2lite_slice_has_v2_lite_widths_and_vllm_cpu_mla_head():
    c = vllm_peer.MODELS["v2lite"]()
    assert (c.hidden_size, c.num_attention_heads, c.kv_lora_rank + c.qk_rope_head_dim) == (2048, 16, 576)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size) == (64, 6, 2, 1408)
    assert (c.num_hidden_layers, c.first_k_dense_replace) == (2, 1)


def test_vllm_env_keeps_this_project_off_the_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/work/somewhere")
    env = vllm_peer_sides.vllm_env("/tmp/cache", 2)
    assert "PYTHONPATH" not in env
    assert (env["VLLM_ENABLE_V1_MULTIPROCESSING"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "nobind")
    assert (env["VLLM_CACHE_ROOT"], env["OMP_NUM_THREADS"]) == ("/tmp/cache", "2")
    assert env["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"  # stdout carries the worker's answers


def test_a_missing_vllm_python_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no such executable"):
        vllm_peer_sides.check_vllm_python(str(tmp_path / "python"))


def test_a_python_without_vllm_is_named_with_its_error(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'vllm'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SystemExit, match="cannot import vllm: ModuleNotFoundError"):
        vllm_peer_sides.check_vllm_python(str(fake))


def fake_python(tmp_path, body: str) -> str:
    """An executable standing in for the vLLM venv's python: runs ``body`` (Python), whatever
    the arguments."""
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\nimport json, sys\n{body}\n")
    script.chmod(0o755)
    return str(script)


SPEC = {"dtype": "float32", "threads": 1}


def test_vllm_side_reads_answers_between_log_lines(tmp_path):
    python = fake_python(tmp_path, f"""
print("INFO a log line on stdout")
print({vllm_peer_worker.REPLY!r} + json.dumps({{"ready": True, "init_s": 1.5}}), flush=True)
for line in sys.stdin:
    r = json.loads(line)
    print("INFO generating")
    print({vllm_peer_worker.REPLY!r} + json.dumps({{"seconds": 0.25, "tokens": [[r["new_tokens"]]] * r["batch"]}}),
          flush=True)""")
    side = vllm_peer_sides.WorkerSide(python, SPEC, str(tmp_path))
    assert side.ready()["init_s"] == 1.5
    assert side(2, 5) == (0.25, [[5], [5]])
    side.close()
    assert "INFO a log line on stdout" in (tmp_path / "vllm_float32.log").read_text()


def test_the_engine_side_runs_in_a_worker_of_this_python_and_matches_the_eager_engine(tmp_path):
    """The Engine side is a subprocess too (started again with every start); its greedy tokens
    equal an eager Engine's here, and closing it checks that every decode step ran as a graph."""
    from checkpoints import SMALL_JSON, hf_named_tensors, write_checkpoint

    from ascend_graph.config import GraphConfig
    from ascend_graph.engine import Engine
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM

    model = tmp_path / "model"
    model.mkdir()
    write_checkpoint(model, hf_named_tensors(DeepseekForCausalLM(DeepseekConfig.from_dict(SMALL_JSON), seed=3)))
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    spec = {"model": str(model), "dtype": "float32", "batches": [2], "max_model_len": 64, "threads": 1,
            "kv_cache_memory_bytes": 1 << 20, "prompts": prompts}
    eager = Engine.from_pretrained(str(model), graph_config=GraphConfig(enabled=False), dtype=torch.float32,
                                   block_size=16, max_model_len=64, cache_memory_bytes=1 << 20)
    expected = eager.generate(prompts, 4, ignore_eos=True)
    side = vllm_peer_sides.engine_side(spec, str(tmp_path), vllm_peer.ROOT)
    try:
        assert side.ready()["init_s"] > 0
        seconds, tokens = side(2, 4)
        assert seconds > 0 and tokens == expected
    finally:
        side.close()
    stats = side.about["runner_stats"]
    assert stats["graph_steps"] == stats["decode_steps"] == 3 and stats["recompiles"] == 0
    assert (tmp_path / "engine_float32.log").exists()


def test_a_vllm_worker_that_dies_is_reported_with_its_log(tmp_path):
    python = fake_python(tmp_path, 'print("RuntimeError: Head dimension 80 is not supported by MLA"); sys.exit(3)')
    side = vllm_peer_sides.WorkerSide(python, SPEC, str(tmp_path))
    with pytest.raises(RuntimeError, match="(?s)exit 3.*Head dimension 80"):
        side.ready()


class FakeReferee:
    """Transformers' stand-in: fixed float32 logits at the last position; in bf16, an error of
    ``error`` at one generated position and a larger one inside the prompt (which must not count)."""

    def __init__(self, logits: dict[int, float], error: float) -> None:
        self.seen, self.ref, self.error = [], logits, error

    def logits(self, dtype, tokens):
        self.seen.append((dtype, tokens))
        out = torch.full((len(tokens), 8), -10.0)
        for t, v in self.ref.items():
            out[-1, t] = v
        if dtype == torch.bfloat16:
            out[0, 0] += 100.0  # a prompt position (prompt [20, 21]: only positions 1 on predict new tokens)
            out[-2, 3] += self.error
        return out


def test_the_referee_sees_the_prompt_and_the_tokens_both_sides_share():
    ref = FakeReferee({6: 4.03, 5: 4.02}, error=0.05)
    referee = vllm_peer.Referee("ckpt")
    referee.logits = ref.logits
    timed = {"vllm": side(1.0, [[1, 2], [3, 4, 6]]), "engine": side(1.0, [[1, 2], [3, 4, 5]])}
    out = vllm_peer.with_referee(vllm_peer.compare("tiny", "bfloat16", 2, timed), referee, [[10], [20, 21]], timed)
    assert ref.seen == [(torch.float32, [20, 21, 3, 4]), (torch.bfloat16, [20, 21, 3, 4])]
    engine = out["vs_vllm"]["engine"]
    verdict = engine["differences"][0]
    assert (verdict["request"], verdict["position"], verdict["vllm"], verdict["side"]) == (1, 2, 6, 5)
    assert verdict["argmax"] == 6 and verdict["near_tie"]
    assert verdict["gap"] == pytest.approx(0.01, abs=1e-5) and verdict["bf16_error"] == pytest.approx(0.05, abs=1e-5)
    assert engine["near_ties_only"] and engine["ratio"] is None and engine["ratio_near_ties"] == pytest.approx(1.0)
    same = {"vllm": side(1.0, [[1]]), "vllm_graph": side(1.0, [[1]])}
    row = vllm_peer.compare("tiny", "float32", 1, same)
    assert "differences" not in vllm_peer.with_referee(row, referee, [[10]], same)["vs_vllm"]["vllm_graph"]
    assert len(ref.seen) == 2


def test_a_difference_wider_than_bf16_error_gives_no_ratio():
    referee = vllm_peer.Referee("ckpt")
    referee.logits = FakeReferee({6: 4.5, 5: 4.0}, error=0.05).logits
    timed = {"vllm": side(2.0, [[1, 6]]), "vllm_graph": side(1.0, [[1, 5]])}
    out = vllm_peer.with_referee(vllm_peer.compare("tiny", "bfloat16", 1, timed), referee, [[10, 11]], timed)
    graph = out["vs_vllm"]["vllm_graph"]
    assert not graph["differences"][0]["near_tie"] and not graph["near_ties_only"]
    assert graph["ratio_near_ties"] is None and vllm_peer_rows.ratio_cell(graph) == vllm_peer.fmt(None)


def test_the_performance_doc_shows_a_run_with_its_command(tmp_path):
    from benchmarks import report

    near = vllm_peer.compare("tiny", "bfloat16", 8, {"vllm": side(3.0, [[1]]), "vllm_graph": side(2.0, [[2]]),
                                                     "vllm_graph_8x": side(2.0, [[2]])})
    near["vs_vllm"]["vllm_graph"].update(near_ties_only=True, ratio_near_ties=1.5)
    rows = [vllm_peer.compare("tiny", "float32", 1, {"vllm": side(2.0, [[1]]), "vllm_graph": side(1.0, [[1]]),
                                                     "vllm_graph_8x": side(1.1, [[1]])}), near]
    run = {"conditions": {"cpu": "CPU", "cores": 2, "torch": "2.13.0+cpu", "when": "2026-12-02 00:00:00"},
           "settings": {"threads": 2, "new_tokens": 32, "max_model_len": 256, "rounds": 5,
                        "kv_cache_memory_bytes": 128 << 20},
           "compared": {"capacity": 8}, "versions": {"vllm_side": {"vllm": "0.32.0"}},
           "command": "python -m benchmarks.vllm_peer X", "rows": rows}
    path = tmp_path / "vllm_peer.json"
    path.write_text(json.dumps(run))
    text = report.vllm_peer_markdown(str(path))
    assert ("| tiny | float32 | 1 | 2.00 | 1.00 | 1.10 | 2.00x (2.00-2.00) | 1.10x "
            "| vLLM+graph: yes; vLLM+graph 8x cache: yes |") in text
    assert "1.50x (near-ties; 1.50-1.50)" in text and "near-ties only" in text
    assert "`python -m benchmarks.vllm_peer X`" in text and "vLLM 0.32.0" in text
    assert "KV cache 128 MiB (8x: 1024 MiB)" in text


def test_the_plugin_entry_point_is_written_beside_the_checkout(tmp_path):
    path = vllm_plugin_env.pythonpath(str(tmp_path / "plugin"), "/src/checkout")
    assert path.split(os.pathsep) == ["/src/checkout", str(tmp_path / "plugin")]
    dist = tmp_path / "plugin" / "ascend_graph-0.1.0.dist-info"
    assert (dist / "entry_points.txt").read_text() == ("[vllm.general_plugins]\n"
                                                       "ascend_graph = ascend_graph.vllm:register\n")
    assert "Name: ascend-graph" in (dist / "METADATA").read_text()


def test_the_vllm_graph_side_captures_every_batch_and_never_times_eager():
    assert vllm_peer_sides.graph_config([8, 1, 32]) == {
        "torchair_graph_config": {"enabled": True, "graph_batch_sizes": [1, 8, 32]},
        "ascend_graph": {"fallback_on_compile_error": False}}
    vllm_peer_sides.check_graph_steps({"graph_steps": 10, "eager_steps": {"prefill": 3}})
    for stats in ({"graph_steps": 10, "eager_steps": {"prefill": 3, "oversize": 1}},
                  {"graph_steps": 0, "eager_steps": {"prefill": 3}}):
        with pytest.raises(RuntimeError, match="eagerly"):
            vllm_peer_sides.check_graph_steps(stats)


@pytest.mark.parametrize("argv, sides", [([], ["vllm", "vllm_graph", "engine"]),
                                         (["--sides", "engine,vllm_graph", "--capacity", "0"],
                                          ["vllm", "vllm_graph", "engine"]),
                                         (["--sides", "engine", "--capacity", "0"], ["vllm", "engine"])])
def test_sides_always_include_stock_vllm_in_a_fixed_order(argv, sides):
    assert vllm_peer.parse_args(["--vllm-python", "p"] + argv).sides == sides


@pytest.mark.parametrize("argv", [["--capacity", "1"], ["--sides", "engine"],
                                  ["--sides", "engine", "--capacity", "0", "--graph-before", "/old"]])
def test_comparisons_against_vllm_graph_need_that_side(argv):
    with pytest.raises(SystemExit):
        vllm_peer.parse_args(["--vllm-python", "p"] + argv)


def test_vllm_env_puts_only_the_given_path_on_the_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/work/somewhere")
    assert vllm_peer_sides.vllm_env("/tmp/cache", 2, "/src:/plugin")["PYTHONPATH"] == "/src:/plugin"


def test_a_results_machine_names_the_cpu_generation_where_it_was_recorded():
    from benchmarks import report

    c = {"cpu": "AMD EPYC", "cpu_flags": ["avx2", "fma"], "cores": 2}
    assert report.machine(c) == "AMD EPYC (avx2, fma), 2 cores"  # results from before cpu_id
    assert report.machine({**c, "cpu_id": "AuthenticAMD family 26 model 2"}) == (
        "AMD EPYC family 26 model 2 (avx2, fma), 2 cores")
