"""Expert-parallel MoE with tensor- or data-parallel attention (DeepSeek V2/V3).

Two ranks are spawned once for the module (gloo on 127.0.0.1, float32) and run TP=2 + EP and
DP=2 + EP (``distributed_ep.ep_checks``); the tests read each rank's results against the
single-process unsharded model's eager runner, run here on the same rows. The rest runs in this
process: the sentinel forms of every MoE backend, the loader, and bad input (shapes only: the
groups need no process group to build, and the errors come before any collective).
"""

from __future__ import annotations

import pytest
import torch

from checkpoints import SMALL_JSON, hf_named_tensors, write_checkpoint
from distributed_ep import (DP_CAPTURE, DP_PROMPTS, MIXED_PROMPT, TP_GRAPH_VERSIONS, VERSIONS, dp_decode,
                            ep_checks, modes_for)
from distributed_ranks import free_ports, greedy_decode, run_ranks, small_deepseek
from runner_helpers import make_runner

from ascend_graph.config import GraphConfig
from ascend_graph.distributed import Group, dp_step
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM, load_deepseek
from ascend_graph.models import loader as loader_module
from ascend_graph.moe import MoE, RoutedExperts, select_moe_backend
from ascend_graph.moe.backend import MOE_BACKENDS

pytestmark = pytest.mark.xdist_group("distributed")

WORLD = 2


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Each rank's results of ``ep_checks``."""
    return run_ranks(ep_checks, WORLD, 400.0, free_ports(2))


def _close(got, want) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)


# ---- TP=2 + EP: every rank runs every row, each rank's experts whole ----

@pytest.mark.parametrize("version", VERSIONS)
def test_tensor_and_expert_parallel_decode_the_one_process_tokens(ranks, version) -> None:
    tokens, (logits,) = greedy_decode([make_runner(small_deepseek(version), GraphConfig(enabled=False))])
    for result in (r["tp"][version] for r in ranks):
        assert result["tokens"] == tokens
        _close(result["eager_logits"], logits)
        if version in TP_GRAPH_VERSIONS:
            _close(result["graph_logits"], logits)


@pytest.mark.parametrize("version", VERSIONS)
def test_each_expert_parallel_rank_holds_its_range_of_whole_experts(ranks, version) -> None:
    c = small_deepseek(version).config
    half = c.n_routed_experts // WORLD
    for rank, layout in enumerate(r[kind][version] for kind in ("tp", "dp") for r in ranks):
        r = rank % WORLD
        assert layout["layout"]["experts"] == [r * half, (r + 1) * half]
        assert layout["expert_gate_up"] == [half, 2 * c.moe_intermediate_size, c.hidden_size]  # not TP-split
        assert f"experts=[{r * half}, {(r + 1) * half}) of {c.n_routed_experts}" in layout["repr"]
    shared = c.moe_intermediate_size * c.n_shared_experts
    assert [r["tp"][version]["shared_gate"] for r in ranks] == [[shared // WORLD, c.hidden_size]] * WORLD
    assert [r["dp"][version]["shared_gate"] for r in ranks] == [[shared, c.hidden_size]] * WORLD


@pytest.mark.parametrize("version", TP_GRAPH_VERSIONS)
def test_tensor_and_expert_parallel_graph_holds_only_all_reduces_and_compiles_once(ranks, version) -> None:
    """o_proj, then the dense MLP or the MoE (local experts + shared share, one all-reduce)."""
    layers = small_deepseek(version).config.num_hidden_layers
    for result in (r["tp"][version] for r in ranks):
        assert result["graph_step_ops"] == ["c10d::allreduce_"] * 2 * layers
        assert result["stats"] == {"compiles": 1, "recompiles": 0, "compile_failures": 0, "graph_steps": 5}


def test_tensor_parallel_ranks_rerun_a_routing_near_tie_together_or_not_at_all(ranks) -> None:
    """Under TP every rank holds the same step and replicated routers: a parity mismatch that a
    near-tie swap reproduces passes on every rank, each running the same eager reruns (each one
    all-reduces); where the ranks hold different tokens to explain, none reruns and every rank
    reports the mismatch (a rank rerunning alone would leave the others waiting in a collective)."""
    agreed = [r["flips"]["agreed"] for r in ranks]
    assert [a["ok"] for a in agreed] == [True] * WORLD
    assert [a["flips"] for a in agreed] == [[[0, "model.layers.0.mlp.gate", True]]] * WORLD
    assert agreed[0]["eager_runs"] == agreed[1]["eager_runs"] > 1
    apart = [r["flips"]["apart"] for r in ranks]
    assert apart == [{"ok": False, "flips": [], "eager_runs": 1}] * WORLD


# ---- DP=2 + EP: each rank its own rows (3 and 1), padded to one size ----

def dp_oracle(version: str, rank: int) -> tuple[list, list]:
    """The unsharded model's eager runner on rank ``rank``'s rows and steps; with, per capacity
    step, the experts its router chose."""
    model = small_deepseek(version)
    runner = make_runner(model, GraphConfig(enabled=False))
    chosen: list = []
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    hooks = [m.gate.register_forward_hook(lambda mod, args, out: chosen.append(out[1])) for m in moe]
    logits, _ = dp_decode(lambda entries, mode: runner.execute(entries), rank, modes_for(version), model)
    for h in hooks:
        h.remove()
    modes = modes_for(version)
    forced = [i for i, m in enumerate(modes) if m.startswith("capacity:")]
    forced_steps = len(modes) - forced[0] if forced else 0  # the bias stays from the first one on
    return logits, chosen[len(chosen) - forced_steps * len(moe):]


@pytest.mark.parametrize("version", VERSIONS)
def test_data_and_expert_parallel_ranks_each_equal_the_unsharded_model_on_their_rows(ranks, version) -> None:
    """Eager steps (inside ``dp_step``) and graph steps (capture size 4) alike, and a step where
    rank 0 prefills while rank 1 decodes; for V3 also the capacity edge: every row of both ranks
    routed to rank 0's experts."""
    for rank, result in enumerate(r["dp"][version] for r in ranks):
        want, chosen = dp_oracle(version, rank)
        assert len(result["logits"]) == len(want) == len(modes_for(version))
        for step, (got, expected) in enumerate(zip(result["logits"], want)):
            assert len(got) == (1 if modes_for(version)[step] == "mixed" and rank == 0 else len(DP_PROMPTS[rank]))
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5,
                                       msg=f"rank {rank} step {step} ({modes_for(version)[step]})")
        half = small_deepseek(version).config.n_routed_experts // WORLD
        assert all(bool((ids < half).all()) for ids in chosen)  # the capacity steps did route so
    assert "capacity:graph" in modes_for("v3") and "capacity:eager" in modes_for("v3")


@pytest.mark.parametrize("version", VERSIONS)
def test_padding_rows_reach_no_expert(ranks, version) -> None:
    """The experts of both ranks together computed K pairs per real row of both ranks and step,
    none for the padding rows (the graph steps pad 3 and 1 rows to 4, the eager ones to 3, the
    prefills to the longer rank's tokens)."""
    k = small_deepseek(version).config.num_experts_per_tok
    modes = modes_for(version)
    decodes = sum(m != "mixed" for m in modes)
    real = (sum(sum(map(len, p)) for p in DP_PROMPTS) + decodes * sum(map(len, DP_PROMPTS))
            + len(MIXED_PROMPT) + len(DP_PROMPTS[1]))  # the mixed step: rank 0's prefill, rank 1's rows
    padding = sum(DP_CAPTURE - len(p) for p in DP_PROMPTS) * sum(m.endswith("graph") for m in modes)
    assert padding > 0
    seen = [sum(layer) for r in ranks for layer in r["dp"][version]["rows_seen"]]
    assert sum(seen) == k * real, seen


@pytest.mark.parametrize("version", VERSIONS)
def test_data_and_expert_parallel_graph_dispatches_and_combines_by_all_reduce(ranks, version) -> None:
    """One compile, no recompile; per MoE layer two all-reduces (dispatch, combine), nothing else."""
    c = small_deepseek(version).config
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    graph_steps = sum(m.endswith("graph") for m in modes_for(version)) + 1
    for result in (r["dp"][version] for r in ranks):
        # 2 per MoE layer in the graph, and before it the runner's host agreement on the step (lockstep)
        assert result["graph_step_ops"] == ["c10d::allreduce_"] * (2 * moe_layers + 1)
        assert result["stats"] == {"compiles": 1, "recompiles": 0, "compile_failures": 0,
                                   "graph_steps": graph_steps}
        layout = result["layout"]
        assert (layout["dp_size"], layout["ep_size"], layout["tp_size"]) == (2, 2, 1)


# ---- one process ----

def _pairs_oracle(experts: RoutedExperts, x, weights, ids) -> torch.Tensor:
    """float64, pair by pair, only the pairs whose id is one of ``experts``' (the rest: none)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    w_gu, w_d = experts.gate_up_proj.double(), experts.down_proj.double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < experts.num_experts:
                gate, up = (w_gu[e] @ x[t].double()).chunk(2)
                out[t] += weights[t, j].double() * (w_d[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("name", [cls.name for cls in MOE_BACKENDS])
@pytest.mark.parametrize("big", [False, True], ids=["small_experts", "sorted_gather"])
def test_sentinel_pairs_add_nothing_and_nan_padding_stays_out(name, big, monkeypatch) -> None:
    """Local ids with the sentinel X (another rank's expert, or a padding row, whose values are
    NaN here): every backend's decode form and the prefill form equal the pairs' oracle."""
    config = DeepseekConfig.small(n_routed_experts=8)
    try:
        backend = select_moe_backend("cpu", torch.float32, name)
    except ValueError:
        pytest.skip(f"{name} does not run here")
    if big:  # the gathered backend sorts its pairs from this size
        monkeypatch.setattr("ascend_graph.moe.backend.SORT_PAIRS_MIN_EXPERT_BYTES", 1)
    experts = RoutedExperts(config, torch.float32, experts=range(4, 8))
    gen = torch.Generator().manual_seed(3)
    for p in experts.parameters():
        p.data.normal_(0, 0.1, generator=gen)
    x = torch.randn(6, config.hidden_size, generator=gen)
    x[4:] = float("nan")  # padding rows
    weights = torch.rand(6, 2, generator=gen)
    ids = torch.tensor([[0, 3], [4, 1], [2, 2], [4, 4], [0, 1], [3, 4]])  # 4: the sentinel
    ids[4:] = 4  # the padding rows' pairs
    want = _pairs_oracle(experts, x.nan_to_num(), weights, ids)
    for form in (backend.decode_local, backend.prefill_local):
        got = form(experts, x, weights, ids)
        assert torch.isfinite(got[:4]).all(), (name, form)
        torch.testing.assert_close(got[:4].double(), want[:4], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", [True, False], ids=["expert_rows_mm", "grouped_mm"])
def test_the_sorted_form_hands_no_expert_a_sentinel_row(kernel, monkeypatch) -> None:
    """The row ends each grouped matmul gets: each local expert's real pairs, and the last end
    before the sentinel pairs' rows."""
    from ascend_graph import kernels
    from ascend_graph.moe import experts as experts_module

    if kernel and not kernels.available():
        pytest.skip("the native kernels do not run here")
    ends: list = []
    if kernel:
        real = torch.ops.ascend_graph.expert_rows_mm
        monkeypatch.setattr(torch.ops.ascend_graph, "expert_rows_mm",
                            lambda x, w, e: (ends.append(e.tolist()), real(x, w, e))[1])
    else:
        real = experts_module.grouped_mm
        monkeypatch.setattr(experts_module, "grouped_mm", lambda x, w, e: (ends.append(e.tolist()), real(x, w, e))[1])
    experts = RoutedExperts(DeepseekConfig.small(n_routed_experts=8), torch.float32, experts=range(4, 8))
    for p in experts.parameters():
        p.data.normal_(0, 0.1)
    ids = torch.tensor([[0, 3], [4, 1], [2, 2], [4, 4], [4, 4], [3, 4]])  # 4: the sentinel
    experts.sorted_by_expert(torch.randn(6, experts.gate_up_proj.shape[2]), torch.rand(6, 2), ids, kernel, skip=True)
    assert ends == [[1, 2, 4, 6]] * 2  # experts 0..3 get 1, 1, 2, 2 rows; the 6 sentinel rows none


def test_an_expert_count_that_does_not_split_names_n_routed_experts() -> None:
    three = Group(None, (0, 1, 2), 0)  # shapes only: no process group is needed to build
    with pytest.raises(ValueError, match="n_routed_experts=8 does not split across the 3 expert-parallel"):
        DeepseekForCausalLM(DeepseekConfig.small(), init_weights=False, tp=three, ep=three)
    with pytest.raises(ValueError, match="ep: an expert-parallel group spans every rank"):
        DeepseekForCausalLM(DeepseekConfig.small(), init_weights=False, ep=Group(None, (0, 1), 0))


def _decode_inputs(model, rows: int):
    from ascend_graph.attention.metadata import AttentionMetadata, DecodeMetadata
    from ascend_graph.kv_cache import allocate_kv_caches

    caches = allocate_kv_caches(model.kv_cache_specs(), 4, 4)
    meta = AttentionMetadata(torch.arange(rows, dtype=torch.int64),
                             DecodeMetadata(torch.zeros(rows, 1, dtype=torch.int32),
                                            torch.ones(rows, dtype=torch.int32)), None)
    return torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64), caches, meta


def test_an_eager_data_and_expert_parallel_step_outside_dp_step_is_refused() -> None:
    """Before any collective: the ranks would bring different row counts to the dispatch."""
    two = Group(None, (0, 1), 0)
    model = DeepseekForCausalLM(DeepseekConfig.small(num_hidden_layers=2), dp=two, ep=two).eval()
    inputs = _decode_inputs(model, 3)
    with pytest.raises(RuntimeError, match="dp_step"):
        model(*inputs)
    with pytest.raises(RuntimeError, match=r"dp_step\(2\) is fewer rows than this rank's step \(3\)"), dp_step(2):
        model(*inputs)


def test_data_parallel_alone_is_a_full_replica_without_collectives() -> None:
    """DP=2 without EP: every expert whole, and an eager step runs outside ``dp_step`` (no
    process group exists here: any collective would fail)."""
    two, config = Group(None, (0, 1), 1), DeepseekConfig.small(num_hidden_layers=2)
    full, replica = DeepseekForCausalLM(config).eval(), DeepseekForCausalLM(config, dp=two).eval()
    assert replica.parallel_layout()["experts"] == [0, config.n_routed_experts]
    assert torch.equal(full(*_decode_inputs(full, 3)), replica(*_decode_inputs(replica, 3)))


class _Reads:
    """``safe_open`` that records what is read: (name, index) per slice read, (name, None) per
    whole tensor."""

    def __init__(self, real) -> None:
        self.real, self.reads = real, []

    def __call__(self, file, framework):
        return _File(self.real(file, framework=framework), self.reads)


class _File:
    def __init__(self, inner, reads) -> None:
        self.inner, self.reads = inner, reads

    def __enter__(self):
        self.f = self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        self.reads.append((name, None))
        return self.f.get_tensor(name)

    def get_slice(self, name):
        return _Slice(self.f.get_slice(name), name, self.reads)


class _Slice:
    def __init__(self, inner, name, reads) -> None:
        self.inner, self.name, self.reads = inner, name, reads

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, index):
        self.reads.append((self.name, index))
        return self.inner[index]


@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked_experts"])
def test_an_expert_parallel_rank_loads_and_reads_only_its_experts(tmp_path, stacked, monkeypatch) -> None:
    full = DeepseekForCausalLM(DeepseekConfig.from_dict(SMALL_JSON), seed=7)
    want, x = full.state_dict(), full.config.n_routed_experts
    tensors = hf_named_tensors(full)
    if stacked:
        tensors = {k: v for k, v in tensors.items() if ".experts." not in k}
        tensors.update({k: v.clone() for k, v in want.items() if ".experts." in k})
    write_checkpoint(tmp_path, tensors, shards=2)
    reads = _Reads(loader_module._safe_open())
    monkeypatch.setattr(loader_module, "_safe_open", lambda: reads)
    prefix = "model.layers.1.mlp."
    for rank in range(WORLD):
        reads.reads.clear()
        group = Group(None, (0, 1), rank)  # TP=2 + EP (EP spans the TP ranks)
        model = load_deepseek(tmp_path, tp=group, ep=group)
        mine, got = range(rank * x // 2, (rank + 1) * x // 2), model.state_dict()
        for leaf in ("gate_up_proj", "down_proj"):
            assert torch.equal(got[prefix + "experts." + leaf], want[prefix + "experts." + leaf][mine.start:mine.stop])
        rows = want[prefix + "shared_experts.gate_proj.weight"].shape[0] // 2
        assert torch.equal(got[prefix + "shared_experts.gate_proj.weight"],
                           want[prefix + "shared_experts.gate_proj.weight"][rank * rows:(rank + 1) * rows])
        expert_reads = [(n, i) for n, i in reads.reads if ".experts." in n]
        if stacked:
            assert sorted(n for n, _ in expert_reads) == [prefix + "experts.down_proj", prefix + "experts.gate_up_proj"]
            assert [i for _, i in expert_reads] == [(slice(mine.start, mine.stop),)] * 2  # their rows only
        else:
            read = {int(n.split(".experts.")[1].split(".")[0]) for n, _ in expert_reads}
            assert read == set(mine) and len(expert_reads) == 3 * len(mine)
