"""Greedy speculative decoding with the MTP layer (``Engine(..., num_speculative_tokens=3)``:
one draft from each verify step, two more from the draft chain).

Oracle: the same model served without speculation, eagerly. Random weights accept almost no
draft, so the MTP layer's drafts are also replaced (after it has run and written its cache) by a
drafter forced right (the reference's next token: every draft accepted), forced wrong (none
accepted) or mixed (right but at positions q % 5 == 4: every count of accepted drafts occurs;
``benchmarks.speculative.forced_drafter``, which the benchmark's ceiling runs): the tokens must be
the reference's in all four, graph and eager, and graph and eager must accept the same drafts per
position. The drafts themselves must be those of one MTP pass over each finished sequence
continued by the chain (no stale cache entry read, the right token and hidden state for each row).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.speculative import DRAFTERS, forced_drafter, set_right

from ascend_graph import Engine, allocate_kv_caches
from ascend_graph.attention import build_attention_metadata
from ascend_graph.config import GraphConfig
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM

PROMPTS = [[1, 5, 9, 3, 200], [7, 2, 8], [4, 4, 6, 1, 2, 9, 10, 11, 30]]
BUDGETS = [13, 9, 6]  # requests leave at different steps: the verify batch shrinks 3 -> 2 -> 1 requests
MAX_LEN = 64
K = 3  # draft tokens per step


def _model() -> DeepseekForCausalLM:
    return DeepseekForCausalLM(DeepseekConfig.small_v3(), mtp_layers=1)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return Engine(_model(), graph_config=GraphConfig(enabled=False), max_model_len=MAX_LEN).generate(
        PROMPTS, BUDGETS, ignore_eos=True)


def _serve(graph: bool, reference) -> tuple[dict, dict]:
    """Per drafter: (tokens, the engine's speculative counters), and the runner's counters."""
    model = _model()
    forced_drafter(model, MAX_LEN)
    assert set_right(model, [p + r for p, r in zip(PROMPTS, reference)]) == 0  # every key one request's
    config = GraphConfig(enabled=graph, backend="inductor", max_batch_size=4, capture_sizes=(2, 4))
    engine = Engine(model, graph_config=config, num_speculative_tokens=K, max_model_len=MAX_LEN)
    out = {}
    for name, code in DRAFTERS.items():
        model.drafter.fill_(code)
        before = engine.spec.to_dict()
        before_each = list(engine.spec.stats.accepted_per_position)
        tokens = engine.generate(PROMPTS, BUDGETS, ignore_eos=True)
        after = engine.stats["speculative"]
        drafted, accepted, steps = (after[k] - before[k] for k in ("drafted_tokens", "accepted_tokens", "verify_steps"))
        per_position = [a - b for a, b in zip(engine.spec.stats.accepted_per_position, before_each)]
        out[name] = (tokens, drafted, accepted, steps, per_position)
    return out, engine.stats, engine


@pytest.fixture(scope="module")
def served(reference, one_torch_thread):
    return {"eager": _serve(False, reference), "graph": _serve(True, reference)}


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_every_drafter_gives_the_tokens_of_decoding_without_speculation(served, reference, mode) -> None:
    for name, (tokens, *_) in served[mode][0].items():
        assert tokens == reference, name


def test_graph_and_eager_accept_the_same_drafts_and_forced_drafters_bound_it(served) -> None:
    graph, eager = served["graph"][0], served["eager"][0]
    assert {n: r[1:] for n, r in graph.items()} == {n: r[1:] for n, r in eager.items()}  # per position too
    _, drafted, accepted, steps, per_position = graph["right"]
    # every verified draft the next token, but where the reference ends (nothing to be right about)
    assert drafted - 2 * K < accepted <= drafted and per_position[0] >= per_position[-1] > 0
    assert steps < graph["mixed"][3] < graph["wrong"][3]  # 1 + K tokens per verify step, 1 + a, 1
    assert graph["wrong"][2] == 0
    assert graph["wrong"][3] == max(BUDGETS) - 1  # one token per step, as without speculation
    mixed = graph["mixed"][4]
    assert 0 < mixed[-1] < mixed[0] < graph["mixed"][1] // K  # some verify steps accept all, some fewer


def test_verify_and_chain_steps_run_as_graphs_of_their_sizes_without_recompiles(served) -> None:
    stats = served["graph"][1]
    assert stats["recompiles"] == 0 and stats["compile_failures"] == 0
    assert set(stats["eager_steps"]) == {"prefill"}  # every decode step verified as a graph
    rows = {str((1 + K) * s) for s in (2, 4)}
    assert set(stats["graph_sizes_run"]) <= rows and str(4 * (1 + K)) in stats["graph_sizes_run"]
    assert stats["graph_steps"] == sum(r[3] for r in served["graph"][0].values())
    chain = stats["speculative"]["draft_chain"]
    assert chain["compiles"] == 2 and chain["recompiles"] == 0 and chain["eager_steps_total"] == 0
    # one chain of K - 1 steps after every prefill and verify step that leaves a request running
    assert set(chain["graph_sizes_run"]) == {"2", "4"} and chain["graph_steps"] > (K - 1) * stats["graph_steps"] // 2
    eager_chain = served["eager"][1]["speculative"]["draft_chain"]
    assert eager_chain["eager_steps"] == {"disabled": chain["graph_steps"]}


def test_chain_steps_are_checked_against_eager_and_a_chain_graph_computing_otherwise_fails(served, reference):
    """``generate_checked`` compares every chain step as it compares verify steps; a chain graph
    whose hidden states are off by 1e-3 (the next chain step's input) is a mismatch."""
    engine = served["graph"][2]
    engine.model.drafter.fill_(DRAFTERS["mtp"])
    tokens, reports = engine.generate_checked(PROMPTS, BUDGETS, ignore_eos=True)
    assert tokens == reference and all(r.ok for r in reports)
    kinds = [r.kind for r in reports]
    # a chain of K - 1 steps after the prefill and after every verify step but the last
    assert kinds.count("draft") == (K - 1) * kinds.count("decode") > 0, kinds
    chain = engine.spec.chain
    graph = chain._graphs[4]
    c = engine.model.config
    skew = torch.cat([torch.zeros(c.vocab_size), torch.full((c.hidden_size,), 1e-3)])
    chain._graphs[4] = lambda *args: graph(*args) + skew
    try:
        with pytest.warns(UserWarning, match="draft chain graph/eager parity check failed: draft batch"):
            _, reports = engine.generate_checked(PROMPTS, BUDGETS, ignore_eos=True)
    finally:
        chain._graphs[4] = graph
    bad = [r for r in reports if not r.ok]
    assert bad and all(r.kind == "draft" and r.batch_size in (3, 4) for r in bad)


@torch.no_grad()
@pytest.mark.parametrize("drafter", ["mtp", "mixed"])
def test_the_drafts_are_one_mtp_pass_over_each_finished_sequence_then_the_chain(reference, drafter) -> None:
    """Every chain step of the engine (eager: the graphs are held to eager by parity) against a
    reference of the MTP layer on fresh caches: one pass over the accepted sequence up to the
    chain's first position q, with the token after every position (its last row: the chain's
    first hidden input; with the model's own drafts, also the verify step's first draft), then one
    row per chain step from the engine's draft token and the reference's previous output. With
    the mixed drafter a verify step accepts 0 to K drafts, so the chain starts from every row.
    Equal within float32 rounding: each row had its token, position and hidden state, and no
    rejected row's or earlier chain's stale cache entry was read."""
    model = _model()
    forced_drafter(model, MAX_LEN)
    set_right(model, [p + r for p, r in zip(PROMPTS, reference)])
    model.drafter.fill_(DRAFTERS[drafter])
    engine = Engine(model, graph_config=GraphConfig(enabled=False), num_speculative_tokens=K, max_model_len=MAX_LEN)
    spec, chains, firsts = engine.spec, [], []
    run_chain, execute, entries = spec._chain, spec.chain.execute, spec.decode_entries

    def record_chain(scheduler, requests, hidden):
        chains.append(([r.index for r in requests], []))
        return run_chain(scheduler, requests, hidden)

    def record_step(seqs, hidden):
        out = execute(seqs, hidden)
        chains[-1][1].append(([s.num_cached for s in seqs], [s.token_ids[0] for s in seqs], hidden.clone(), out))
        return out

    def record_first(scheduler, batch):
        firsts.extend((r.index, r.num_tokens - 1, r.drafts[0]) for r in batch)
        return entries(scheduler, batch)

    spec._chain, spec.chain.execute, spec.decode_entries = record_chain, record_step, record_first
    assert engine.generate(PROMPTS, BUDGETS, ignore_eos=True) == reference
    assert sum(len(steps) for _, steps in chains) > 10 and all(len(steps) == K - 1 for _, steps in chains)
    v, table = model.config.vocab_size, [1, 2, 3, 4]

    def mtp(tokens, start, hidden, caches):
        positions, meta = build_attention_metadata([table], [start], [len(tokens)], block_size=16, num_blocks=8,
                                                   max_model_len=MAX_LEN)
        return model.mtp_predict(torch.tensor(tokens), positions, hidden, caches, meta)

    def first_pass(seq, q):  # the MTP rows of positions 0 .. q - 1 over fresh caches
        caches = allocate_kv_caches(model.kv_cache_specs(), 8, 16)
        positions, meta = build_attention_metadata([table], [0], [q], block_size=16, num_blocks=8,
                                                   max_model_len=MAX_LEN)
        return mtp(seq[1:q + 1], 0, model(torch.tensor(seq[:q]), positions, caches, meta), caches)[-1:], caches

    for indices, steps in chains:
        for row, index in enumerate(indices):
            seq = PROMPTS[index] + reference[index]
            out, caches = first_pass(seq, steps[0][0][row])
            for positions, tokens, hidden, got in steps:
                torch.testing.assert_close(hidden[row:row + 1], out, atol=1e-4, rtol=1e-4)
                out = mtp([tokens[row]], positions[row], out, caches)
                torch.testing.assert_close(got[row:row + 1, v:], out, atol=1e-4, rtol=1e-4)
                if drafter == "mtp":
                    assert got[row, :v].argmax().item() == model.compute_mtp_logits(out).argmax(-1).item()
    if drafter == "mtp":  # the verify step's first draft too
        for index, p, draft in firsts:
            out, _ = first_pass(PROMPTS[index] + reference[index], p)
            assert model.compute_mtp_logits(out).argmax(-1).item() == draft, (index, p)


def test_bad_speculation_settings_name_the_argument() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens=1 needs a model with an MTP layer"):
        Engine(DeepseekForCausalLM(DeepseekConfig.small_v3()), num_speculative_tokens=1)
    model = _model()
    Engine(model, graph_config=GraphConfig(enabled=False), num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens=3 on a model that drafts for an engine with "
                                         "num_speculative_tokens=2"):
        Engine(model, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="num_speculative_tokens=0 on a model that drafts"):
        Engine(model)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 0"):
        Engine(_model(), num_speculative_tokens=-1)
    engine = Engine(_model(), graph_config=GraphConfig(enabled=False), num_speculative_tokens=1, max_model_len=16)
    with pytest.raises(ValueError, match="temperature must be 0"):
        engine.generate([[1, 2]], 3, temperature=0.7)
    with pytest.raises(ValueError, match=r"max_new_tokens=14 \+ num_speculative_tokens=1 = 17 exceeds max_model_len=16"):
        engine.generate([[1, 2]], 14)
    assert len(engine.generate([[1, 2]], 13, ignore_eos=True)[0]) == 13  # 2 + 13 + 1 draft slot fits
