"""The engine: continuous batching, graph vs eager, sampling, stop tokens, input validation.

Oracles: each request served alone (batching must not change a request's tokens), the same
engine with graph mode off, a hand-computed distribution for the sampling filters, and a fresh
engine after a rejected call.
"""

from __future__ import annotations

import pytest
import torch

from ascend_graph.config import GraphConfig
from ascend_graph.engine import Engine
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
from ascend_graph.engine.sampling import SamplingParams, filtered_probs
from ascend_graph.runner import GraphCompileWarning

PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(2 + 3 * i)] for i in range(6)]  # 2..17 tokens
BUDGETS = [5, 12, 3, 9, 7, 4]
EAGER = GraphConfig(enabled=False)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return DeepseekForCausalLM(DeepseekConfig.small(), seed=0).eval()


def engine(model, config=EAGER, **kwargs) -> Engine:
    return Engine(model, graph_config=config, **{"block_size": 4, "max_model_len": 64, **kwargs})


def snapshot(e: Engine) -> list[list[torch.Tensor]]:
    return [[t.clone() for t in cache] for cache in e.runner.kv_caches]


# -- continuous batching --------------------------------------------------------------------


def test_requests_join_and_leave_and_all_blocks_come_back(model):
    e = engine(model, max_num_seqs=3)
    tokens = e.generate(PROMPTS, BUDGETS)
    assert [len(t) for t in tokens] == BUDGETS
    alone = [engine(model).generate([p], n)[0] for p, n in zip(PROMPTS, BUDGETS)]
    assert tokens == alone, "batching changed a request's tokens"
    stats = e.stats
    assert set(stats["decode_batch_sizes"]) == {"1", "2", "3"}
    assert stats["prefill_steps"] >= 4, "waiting requests should join as others finish"
    assert stats["requests"] == 6 and stats["generated_tokens"] == sum(BUDGETS)
    assert stats["prompt_tokens"] == sum(map(len, PROMPTS))
    assert e.blocks.num_free == e.num_blocks - 1


def test_admission_waits_for_free_blocks(model):
    # Every request reserves <= 16 tokens = 4 blocks; 8 usable blocks hold two at a time.
    e = engine(model, num_blocks=9, max_num_seqs=4)
    prompts, budgets = [p[:8] for p in PROMPTS], [min(n, 8) for n in BUDGETS]
    tokens = e.generate(prompts, budgets)
    assert [len(t) for t in tokens] == budgets
    assert max(int(k) for k in e.stats["decode_batch_sizes"]) == 2
    assert e.blocks.num_free == 8


def test_graph_mode_tokens_equal_eager_tokens(model):
    config = GraphConfig(enabled=True, backend="aot_eager", capture_sizes=(1, 2, 4), max_batch_size=4)
    graph = engine(model, config, max_num_seqs=4)
    g_tokens, g_logits = graph.generate(PROMPTS, BUDGETS, return_logits=True)
    e_tokens, e_logits = engine(model, max_num_seqs=4).generate(PROMPTS, BUDGETS, return_logits=True)
    assert g_tokens == e_tokens
    for g, e in zip(g_logits, e_logits):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    stats = graph.stats
    assert stats["graph_steps"] == stats["decode_steps"] > 0 and stats["recompiles"] == 0
    assert len(stats["decode_batch_sizes"]) >= 3

    checked, reports = graph.generate_checked(PROMPTS, BUDGETS)
    assert checked == e_tokens and len(reports) == stats["decode_steps"]
    assert all(r.ok and r.untouched_ok for r in reports), [r.summary() for r in reports if not r.ok]


def fails_at_two_rows(gm, example_inputs, **kwargs):
    """A compile backend that cannot compile the 2-row step (integer inputs of 2 rows) and runs
    the others as traced."""
    if any(isinstance(t, torch.Tensor) and not t.is_floating_point() and tuple(t.shape) == (2,)
           for t in example_inputs):
        raise RuntimeError("simulated compiler failure at 2 rows")
    return gm.forward


def test_a_size_that_fails_to_compile_runs_eagerly_warned_and_named_in_the_stats(model):
    """Oracle for the tokens: the engine with graph mode off."""
    error = "RuntimeError: simulated compiler failure at 2 rows"
    config = GraphConfig(enabled=True, backend="aot_eager", capture_sizes=(1, 2), max_batch_size=2)
    graph = engine(model, config, max_num_seqs=2, backend=fails_at_two_rows)
    with pytest.warns(GraphCompileWarning, match=f"capture size 2 failed, that size runs eagerly: {error}"):
        graph.capture(show_progress=False)
    budgets = [3, 9]  # 2-row decode steps, then 1-row ones
    assert graph.generate(PROMPTS[:2], budgets) == engine(model, max_num_seqs=2).generate(PROMPTS[:2], budgets)
    stats = graph.stats
    assert stats["compile_failures"] == 1 and stats["compile_errors"] == {"2": error}
    assert stats["graph_steps"] > 0 and stats["eager_steps"]["compile_failed"] > 0


# -- sampling and stopping ------------------------------------------------------------------


def test_sampling_is_reproducible_per_seed_and_top_k_1_is_greedy(model):
    e = engine(model)
    greedy = e.generate(PROMPTS, 8)
    sample = lambda **kw: e.generate(PROMPTS, 8, temperature=1.0, **kw)  # noqa: E731
    assert sample(seed=1) == sample(seed=1)
    assert sample(seed=1) != sample(seed=2)
    assert sample(seed=1) != greedy
    assert sample(seed=3, top_k=1) == greedy
    assert sample(seed=3, top_p=1e-6) == greedy


def test_top_k_and_top_p_keep_the_expected_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top2 = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(top2, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    nucleus = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))  # 0.5+0.3 < 0.9 <= +0.15
    torch.testing.assert_close(nucleus, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


def test_stop_token_ends_a_request_and_is_kept(model):
    e = engine(model)
    full = e.generate(PROMPTS[:3], 10)
    stop = full[1][3]
    stopped = e.generate(PROMPTS[:3], 10, stop_token_ids=[stop])
    for f, s in zip(full, stopped):
        expect = f[:f.index(stop) + 1] if stop in f else f
        assert s == expect
    assert e.blocks.num_free == e.num_blocks - 1


def test_string_prompts_use_the_tokenizer(model):
    class Words:
        vocab = ["<unk>", "hello", "graph", "mode"]

        def encode(self, text):
            return [self.vocab.index(w) if w in self.vocab else 0 for w in text.split()]

        def decode(self, ids):
            return " ".join(self.vocab[i] if i < len(self.vocab) else "?" for i in ids)

    e = engine(model, tokenizer=Words())
    assert e.generate(["hello graph mode"], 4) == e.generate([[1, 2, 3]], 4)
    assert e.decode([1, 3]) == "hello mode"


# -- validation -----------------------------------------------------------------------------

BAD_CALLS = {
    "request 1: the prompt is empty": dict(prompts=[[1, 2], []]),
    r"request 0: token id 256 at position 1 is outside the vocabulary \[0, 256\)": dict(prompts=[[1, 256]]),
    r"request 1: token id -3 at position 0": dict(prompts=[[1], [-3]]),
    "request 0: prompt of 60 tokens \\+ max_new_tokens=10 = 70 exceeds max_model_len=64": dict(
        prompts=[[1] * 60], max_new_tokens=10),
    "request 1: max_new_tokens must be an int >= 1, got 0": dict(max_new_tokens=[3, 0]),
    "max_new_tokens has 1 entries for 2 prompts": dict(max_new_tokens=[3]),
    "temperature must be a finite number >= 0": dict(temperature=-1.0),
    "top_k must be an int >= 0": dict(top_k=-1),
    r"top_p must be a number in \(0, 1\]": dict(top_p=0.0),
    "seed must be an int >= 0 or None": dict(temperature=1.0, seed="x"),
    "stop_token_ids must be a list of ints": dict(stop_token_ids="x"),
    "got a flat list of ints": dict(prompts=[1, 2, 3]),
    "string prompt: it needs a tokenizer": dict(prompts=["hello"]),
}


@pytest.mark.parametrize("message", list(BAD_CALLS))
def test_bad_input_raises_clearly_and_leaves_the_engine_usable(model, message):
    e = engine(model)
    expected = e.generate(PROMPTS[:2], 4)
    caches, free = snapshot(e), e.blocks.num_free
    call = {"prompts": PROMPTS[:2], "max_new_tokens": 4, **BAD_CALLS[message]}
    with pytest.raises(ValueError, match=message):
        e.generate(call.pop("prompts"), call.pop("max_new_tokens"), **call)
    assert e.blocks.num_free == free and e.stats["requests"] == 2
    for cache, saved in zip(e.runner.kv_caches, caches):
        for t, s in zip(cache, saved):
            assert torch.equal(t, s)
    assert e.generate(PROMPTS[:2], 4) == expected


def test_request_larger_than_the_whole_cache_is_rejected(model):
    e = engine(model, num_blocks=5)  # 4 usable blocks of 4 tokens
    with pytest.raises(ValueError, match="request 0: 20 tokens need 5 blocks of 4, more than the whole cache's 4"):
        e.generate([[1] * 12], 8)
    assert e.generate([[1] * 8], 8)[0] == engine(model).generate([[1] * 8], 8)[0]


def test_engine_arguments_are_checked(model):
    with pytest.raises(ValueError, match="max_model_len=200000 exceeds the model's max_position_embeddings"):
        Engine(model, graph_config=EAGER, max_model_len=200_000)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 2 \\(block 0 is the reserved null block\\)"):
        Engine(model, graph_config=EAGER, num_blocks=1)
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1, got 0"):
        Engine(model, graph_config=EAGER, max_num_seqs=0)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        Engine(model, graph_config=EAGER, block_size=0)
    budget = Engine(model, graph_config=EAGER, max_model_len=64, cache_memory_bytes=1 << 20)
    assert budget.num_blocks == (1 << 20) // (3 * (32 + 8) * 4 * 16)  # 3 layers, kv_c + k_pe, fp32
    default = Engine(model, graph_config=EAGER, max_model_len=64, max_num_seqs=3)
    assert default.num_blocks == 1 + 3 * 4
