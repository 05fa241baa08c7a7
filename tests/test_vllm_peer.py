"""What keeps ``benchmarks.vllm_peer``'s ratios honest, without vLLM: every side timed in the same
interleaved rounds, a ratio only where the tokens agree (or differ at certified near-ties), a
graph side that ran eagerly or a side that died reported as such, never as a figure.

Oracles: per-step times worked out by hand from a fake clock; token differences placed by hand.
The run itself is a benchmark, ``python -m benchmarks.vllm_peer``.
"""

import sys

import pytest
import torch

from benchmarks import vllm_peer, vllm_worker
from benchmarks.vllm_peer import decode_ms_per_step, interleaved_decode


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


def test_interleaved_decode_notices_tokens_changing_between_rounds():
    calls = iter(range(100))
    out = interleaved_decode({"a": lambda batch, n: (0.0, [[next(calls)] * n])}, batch=1, new_tokens=3, rounds=2)
    assert not out["a"]["tokens_stable"]


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
    assert vllm_peer.ratio_cell(cmp) == "1.20x (0.90-1.50)"
    near_ties = {**cmp, "ratio": None, "ratio_near_ties": 1.2}
    assert vllm_peer.ratio_cell(near_ties) == "1.20x (near-ties; 0.90-1.50)"


def fake_python(tmp_path, body: str) -> str:
    """An executable standing in for vLLM's python: runs ``body`` (Python), whatever
    the arguments."""
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\nimport json, sys\n{body}\n")
    script.chmod(0o755)
    return str(script)


SPEC = {"dtype": "float32", "threads": 1}


def test_a_vllm_worker_that_dies_is_reported_with_its_log(tmp_path):
    python = fake_python(tmp_path, 'print("RuntimeError: Head dimension 80 is not supported by MLA"); sys.exit(3)')
    side = vllm_worker.WorkerSide(python, SPEC, str(tmp_path))
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
    assert graph["ratio_near_ties"] is None and vllm_peer.ratio_cell(graph) == vllm_peer.fmt(None)


def test_the_vllm_graph_side_captures_every_batch_and_never_times_eager():
    assert vllm_peer.graph_config([8, 1, 32]) == {
        "torchair_graph_config": {"enabled": True, "graph_batch_sizes": [1, 8, 32]},
        "ascend_graph": {"fallback_on_compile_error": False}}
    vllm_worker.check_graph_steps({"graph_steps": 10, "eager_steps": {"prefill": 3}})
    for stats in ({"graph_steps": 10, "eager_steps": {"prefill": 3, "oversize": 1}},
                  {"graph_steps": 0, "eager_steps": {"prefill": 3}}):
        with pytest.raises(RuntimeError, match="eagerly"):
            vllm_worker.check_graph_steps(stats)



def test_a_tp_row_states_its_read_floor_and_all_reduces_against_a_hand_count():
    """The bound of a TP=2 row: one rank's bytes (counted here by hand from the tiny model's widths)
    x 2 at the read rate, plus 2 all-reduces per layer at the timed cost."""
    row = vllm_peer.compare("tiny", "float32", 1, {"vllm": side(10.0, [[1]]), "vllm_graph": side(8.0, [[1]])})
    row["own_ms"] = {"vllm_graph": 3.0}
    ceiling = {"bytes": 1e9, "round_s": [0.5, 0.25], "how": "fake"}  # 4 GB/s at the fastest round
    out = vllm_peer.with_tp_floor(row, ceiling, context=10, tp=2, all_reduce_ms=0.5)["tp_floor"]
    c = vllm_peer.MODELS["tiny"]()
    e, heads, v, r, ckv = c.hidden_size, c.num_attention_heads // 2, c.v_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    qk = c.qk_nope_head_dim + r
    attention = e * heads * qk + e * (ckv + r) + ckv * heads * (c.qk_nope_head_dim + v) + heads * v * e + ckv + 2 * e
    dense = 3 * e * (c.intermediate_size // 2)
    # the router (replicated), top-k routed experts and the shared experts, each expert's rank half
    moe = e * c.n_routed_experts + c.num_experts_per_tok * 3 * e * c.moe_intermediate_size // 2 \
        + 3 * e * c.n_shared_experts * c.moe_intermediate_size // 2
    weights = 2 * attention + dense + moe + e + e * c.vocab_size + e  # layers, embedding row, head, final norm
    cache = 2 * 10 * (ckv + r)  # the row's latent and rope entries of both layers
    assert out["rank_bytes"] == pytest.approx(4 * (weights + cache), rel=0.01)
    assert out["floor_ms"] == pytest.approx(2 * out["rank_bytes"] / 4e9 * 1e3)
    assert out["all_reduces_per_step"] == 4 and out["all_reduce_ms"] == pytest.approx(2.0)
    assert out["graph_over_own_and_floor"] == pytest.approx(8.0 / (3.0 + out["floor_ms"]))
    assert out["graph_over_own_floor_all_reduces"] == pytest.approx(8.0 / (3.0 + out["floor_ms"] + 2.0))
    assert "all-reduces x 0.500 ms" in vllm_peer.render_tp_floors([{**row, "tp_floor": out}])[0]


def test_tp_runs_have_no_engine_side_and_threads_shared_out():
    args = vllm_peer.parse_args(["--tp", "2", "--threads", "2"])
    assert args.sides == ["vllm", "vllm_graph"]
    with pytest.raises(SystemExit):
        vllm_peer.parse_args(["--tp", "2", "--threads", "3"])
