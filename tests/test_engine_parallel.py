"""The Engine on several ranks of this host: tensor and data parallel, driven by rank 0.

This process is rank 0 of each multi-process engine (the ranks > 0 are spawned, gloo on
127.0.0.1, float32). One module fixture serves every request and keeps what each engine
returned; the tests read it against the oracle: the single-process ``Engine`` on the unsharded
model, graph mode off and on. The CLI runs as subprocesses: spawned, and under a torchrun-style
environment (two processes given ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from checkpoints import SMALL_JSON, hf_named_tensors, write_checkpoint
from distributed_ranks import free_ports
from runner_helpers import small_model

from ascend_graph.config import GraphConfig
from ascend_graph.engine import Engine
from ascend_graph.engine.ranks import INJECT_FAILURE_ENV, RankError, RankSet
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
from ascend_graph.models.named import named_model

pytestmark = pytest.mark.xdist_group("distributed")

PROMPTS = [[1, 5, 9, 3], [7, 2, 8], [4, 4, 190, 17, 3]]
NEW_TOKENS = 6
GRAPH = GraphConfig(enabled=True, backend="inductor", capture_sizes=(2,), max_batch_size=2)
EAGER = GraphConfig(enabled=False)
ENGINE_ARGS = {"max_model_len": 64, "rank_timeout_s": 120.0}
FAIL_DEADLINE_S = 30.0  # a rank's failure reaches rank 0 within this (rank 0 waits REPORT_GRACE_S at most)
V3_JSON = {**SMALL_JSON, "num_hidden_layers": 1, "first_k_dense_replace": 0}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_v2() -> DeepseekForCausalLM:
    """The seeded tiny DeepSeek V2 of one MoE layer (MLA, shared and routed experts; a layer compiles fast)."""
    return DeepseekForCausalLM(DeepseekConfig.small(num_hidden_layers=1, first_k_dense_replace=0)).eval()


def oracle(model, prompts=PROMPTS) -> dict:
    """The single-process engine's greedy tokens, graph mode off and on."""
    return {name: Engine(model, graph_config=config, max_model_len=64).generate(prompts, NEW_TOKENS,
                                                                                ignore_eos=True)
            for name, config in (("eager", EAGER), ("graph", GRAPH))}


def serve(model, graph: bool = True, **sizes) -> dict:
    """Greedy tokens of an engine on ``sizes`` ranks, a checked run (graph mode on), its counters."""
    with Engine(model, graph_config=GRAPH if graph else EAGER, **ENGINE_ARGS, **sizes) as engine:
        out = {"tokens": engine.generate(PROMPTS, NEW_TOKENS, ignore_eos=True),
               "one": engine.generate(PROMPTS[:1], NEW_TOKENS, ignore_eos=True), "stats": engine.stats}
        if graph:
            out["checked"], reports = engine.generate_checked(PROMPTS, NEW_TOKENS, ignore_eos=True)
            out["reports"], out["rank_parity"] = [r.ok for r in reports], engine.rank_parity
    return out


def checkpoint_then_failure(path) -> dict:
    """A TP=2 engine on a tiny V3 checkpoint (each rank reads its share), eager: its tokens, the
    oracle's, rank 0's heads; then rank 1 raises at its first step of the next call (the first
    call runs one prefill and NEW_TOKENS - 1 decode steps): what rank 0 raised, and when."""
    full = DeepseekForCausalLM(DeepseekConfig.from_dict(V3_JSON), seed=7).eval()
    write_checkpoint(path, hf_named_tensors(full), config=V3_JSON)
    out = {"want": Engine(full, graph_config=EAGER, max_model_len=64).generate(PROMPTS, NEW_TOKENS, ignore_eos=True)}
    os.environ[INJECT_FAILURE_ENV] = f"1:{NEW_TOKENS + 1}"
    try:
        engine = Engine.from_pretrained(path, graph_config=EAGER, dtype=torch.float32, tokenizer=None,
                                        tensor_parallel_size=2, **ENGINE_ARGS)
    finally:
        del os.environ[INJECT_FAILURE_ENV]
    try:
        out.update(tokens=engine.generate(PROMPTS, NEW_TOKENS, ignore_eos=True),
                   heads=engine.model.model.layers[0].self_attn.num_heads)
        start = time.monotonic()
        try:
            engine.generate(PROMPTS, NEW_TOKENS)
        except Exception as e:  # noqa: BLE001  (what rank 0 raised is the result)
            out.update(error=e, seconds=time.monotonic() - start, alive=[p.is_alive() for p in engine.ranks.procs])
    finally:
        engine.close()
    return out


@pytest.fixture(scope="module")
def runs(one_torch_thread, tmp_path_factory) -> dict:
    """Every engine's results. V2 runs with expert parallel under TP=2 and under DP=2 (its MoE
    all-reduces across the replicas, so an idle replica must still run each step); plain TP=2
    DeepSeek runs from a checkpoint below, and under the graph runner in
    tests/test_distributed.py. The tensor-parallel Llama runs eagerly (its graphs on two ranks:
    tests/test_distributed.py); a spawn and a compile cost 5-20 s each on a 2-core host."""
    v2, llama = tiny_v2(), small_model("llama")
    return {"v2_oracle": oracle(v2), "one_oracle": oracle(v2, PROMPTS[:1]), "llama_oracle": oracle(llama),
            "v2_tp": serve(v2, tensor_parallel_size=2, enable_expert_parallel=True),
            "llama_tp": serve(llama, False, tensor_parallel_size=2),
            "v2_dp": serve(v2, data_parallel_size=2, enable_expert_parallel=True),
            "failure": checkpoint_then_failure(tmp_path_factory.mktemp("v3_checkpoint"))}


@pytest.mark.parametrize("run, want", [("v2_tp", "v2_oracle"), ("llama_tp", "llama_oracle"), ("v2_dp", "v2_oracle")])
def test_greedy_tokens_on_two_ranks_equal_the_single_process_engine(runs, run, want) -> None:
    assert runs[want]["eager"] == runs[want]["graph"]  # the oracle agrees with itself
    assert runs[run]["tokens"] == runs[want]["eager"]
    assert runs[run].get("checked", runs[want]["eager"]) == runs[want]["eager"]


@pytest.mark.parametrize("run", ["v2_tp", "v2_dp"])
def test_stats_hold_every_ranks_graph_counters(runs, run) -> None:
    ranks = runs[run]["stats"]["ranks"]
    assert len(ranks) == 2
    for counters in ranks:
        assert counters["graph_steps"] > 0 and counters["recompiles"] == 0 and counters["compile_failures"] == 0
    assert ranks[0]["graph_steps"] == runs[run]["stats"]["graph_steps"]


@pytest.mark.parametrize("run", ["v2_tp", "v2_dp"])
def test_checked_steps_are_reported_by_every_rank(runs, run) -> None:
    reports, by_rank = runs[run]["reports"], runs[run]["rank_parity"]
    assert reports and all(reports) and len(by_rank) == len(reports)
    for step in by_rank:
        assert [s["rank"] for s in step] == [0, 1]
        assert all(s["ok"] and s["untouched_ok"] for s in step)


def test_an_idle_data_parallel_replica_lets_the_other_finish(runs) -> None:
    assert runs["v2_dp"]["one"] == runs["one_oracle"]["eager"]
    # the replica without a request ran every step of that call on padding (its experts' all-reduces)
    idle = [r["idle_steps"] for r in runs["v2_dp"]["stats"]["ranks"]]
    assert sorted(idle)[0] == 0 and sorted(idle)[1] >= NEW_TOKENS, idle


def test_a_checkpoint_engine_gives_each_rank_its_share(runs) -> None:
    failure = runs["failure"]
    assert failure["heads"] == V3_JSON["num_attention_heads"] // 2
    assert failure["tokens"] == failure["want"]


def test_a_rank_that_fails_is_named_by_rank_zero_within_a_deadline(runs) -> None:
    failure = runs["failure"]
    assert isinstance(failure.get("error"), RankError), failure.get("error")
    assert failure["error"].rank == 1 and "rank 1" in str(failure["error"])
    assert INJECT_FAILURE_ENV in str(failure["error"])
    assert failure["seconds"] < FAIL_DEADLINE_S and not any(failure["alive"])


@pytest.mark.parametrize("sizes, message", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an int >= 1"),
    ({"data_parallel_size": -1}, "data_parallel_size must be an int >= 1"),
    ({"tensor_parallel_size": 3}, "num_attention_heads=4 does not split across tensor_parallel_size=3"),
    ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, "enable_expert_parallel"),
    ({"data_parallel_size": 2, "rank_timeout_s": 0}, "rank_timeout_s must be a number of seconds > 0"),
])
def test_bad_sizes_are_refused_before_any_rank_starts(sizes, message, monkeypatch) -> None:
    def no_rank_may_start(*args, **kwargs):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(RankSet, "__init__", no_rank_may_start)
    model = small_model("llama") if sizes.get("enable_expert_parallel") else tiny_v2()
    with pytest.raises(ValueError, match=message):
        Engine(model, graph_config=EAGER, **{**ENGINE_ARGS, **sizes})


CLI_ARGS = ["generate", "--prompt-ids", "1,5,9,3", "--prompt-ids", "7,2,8", "--max-new-tokens", "5",
            "--no-graph", "--json", "--no-progress", "--tensor-parallel-size", "2", "--max-model-len", "64"]


def cli_oracle() -> list[list[int]]:
    model, _ = named_model("small")
    return Engine(model, graph_config=EAGER, max_model_len=64).generate([[1, 5, 9, 3], [7, 2, 8]], 5)


def _cli(env: dict, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ascend_graph.cli", *CLI_ARGS], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", **env}, **kwargs)


def test_cli_generate_on_ranks_it_spawns_and_under_an_external_launcher(one_torch_thread) -> None:
    """``ascend-graph generate --tensor-parallel-size 2`` spawning its rank 1, and (at the same
    time) started twice with torchrun's environment, rank 1 serving rank 0's steps."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0]), "WORLD_SIZE": "2"}
    procs = [_cli({}), *(_cli({**env, "RANK": str(rank)}) for rank in (1, 0))]
    (spawned, err), (out1, err1), (out0, err0) = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], err + err0 + err1
    assert out1 == ""  # rank 1 served rank 0's steps, printed nothing
    want = cli_oracle()
    for out in (spawned, out0):
        result = json.loads(out)
        assert [o["tokens"] for o in result["outputs"]] == want
        assert len(result["ranks"]) == 2 and result["model"]["tensor_parallel_size"] == 2
