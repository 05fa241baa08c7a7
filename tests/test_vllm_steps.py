"""A vLLM step's metadata in the runner's terms, and the logits rows vLLM gets back, without vLLM.

Oracle: a mixed step written out by hand as vLLM lays it out (decodes first, a padded block
table, spans in ``query_start_loc``), the SequenceSteps it must give, and vLLM's own selection
``logits_indices = query_start_loc[1:] - 1`` (``GPUModelRunner._prepare_inputs``) applied to
what ``forward`` returns, which must give back the runner's logits row per request.
"""

from types import SimpleNamespace

import pytest
import torch

from ascend_graph.runner import SequenceStep
from ascend_graph.vllm.steps import NO_ROW, select_logits, sequence_steps, speculative_rows, token_rows

# Two decodes (lengths 17 and 5 after this step), then a 3-token prefill; block size 16.
# The table has a padding row and padding columns, as vLLM's persistent buffers do.
MIXED = SimpleNamespace(
    num_reqs=3,
    query_start_loc_cpu=torch.tensor([0, 1, 2, 5, 5], dtype=torch.int32),
    seq_lens=torch.tensor([17, 5, 3, 0], dtype=torch.int32),
    block_table_tensor=torch.tensor([[4, 9, 0, 0], [7, 0, 0, 0], [2, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32),
)
TOKENS = [11, 12, 21, 22, 23]


def test_each_request_brings_its_span_its_cached_count_and_the_blocks_its_length_needs():
    assert sequence_steps(TOKENS, MIXED, block_size=16) == [
        SequenceStep([11], 16, [4, 9]),  # position 16 starts the second block
        SequenceStep([12], 4, [7]),
        SequenceStep([21, 22, 23], 0, [2]),
    ]


def vllm_logits_indices(meta) -> torch.Tensor:
    """What vLLM selects from the forward's output without speculative decoding."""
    return meta.query_start_loc_cpu[1: meta.num_reqs + 1].to(torch.long) - 1


def test_a_mixed_step_returns_a_small_row_per_token_and_vllms_selection_gives_each_requests_logits():
    logits = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # the runner's, one row per request
    rows = token_rows(5, step=7, meta=MIXED)
    assert rows.shape == (5, 2)  # T x 2, never T x V
    assert torch.equal(select_logits(rows[vllm_logits_indices(MIXED)], logits, step=7), logits)
    reordered = rows[torch.tensor([4, 0])]  # request 2's last token, then request 0's
    assert torch.equal(select_logits(reordered, logits, step=7), logits[[2, 0]])


@pytest.mark.parametrize("tokens", [[2], [3], [2, 4]])  # a prompt token: no logits there
def test_a_token_without_logits_is_an_error_not_a_row_of_zeros(tokens):
    rows = token_rows(5, step=7, meta=MIXED)
    with pytest.raises(ValueError, match=r"logits at token rows \[0"):
        select_logits(rows[torch.tensor(tokens)], torch.ones(3, 2), step=7)


def test_rows_of_another_forward_or_made_up_rows_are_refused_naming_them():
    rows = token_rows(5, step=7, meta=MIXED)[vllm_logits_indices(MIXED)]
    with pytest.raises(ValueError, match=r"another forward \(step 7\).*step 8"):
        select_logits(rows, torch.ones(3, 2), step=8)
    with pytest.raises(ValueError, match="another forward"):  # vLLM's sampler warm-up feeds rand_like(hidden)
        select_logits(torch.rand_like(rows), torch.ones(3, 2), step=7)
    with pytest.raises(ValueError, match=r"\[k, 2\] float64"):
        select_logits(torch.zeros(3, 5), torch.ones(3, 2), step=7)
    bad = rows.clone()
    bad[0, 0] = 3.0  # past the runner's 3 rows
    with pytest.raises(ValueError, match=r"outside \[0, 3\)"):
        select_logits(bad, torch.ones(3, 2), step=7)


def test_a_dummy_run_has_no_logits_anywhere():
    rows = token_rows(4, step=2)  # no metadata: vLLM's _dummy_run
    with pytest.raises(ValueError, match="dummy run"):
        select_logits(rows[torch.tensor([1, 3])], None, step=2, what="vLLM's dummy run")


# Three decodes (lengths 1, 16 and 33 after this step: 1, 1 and 3 blocks of 16), a padded table.
DECODES = SimpleNamespace(
    num_reqs=3,
    query_start_loc_cpu=torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32),
    seq_lens=torch.tensor([1, 16, 33, 0], dtype=torch.int32),
    block_table_tensor=torch.tensor([[5, 0, 0, 0], [6, 0, 0, 0], [1, 2, 3, 0], [0, 0, 0, 0]], dtype=torch.int32),
)


def test_a_decode_only_step_gives_one_token_per_request_and_its_blocks():
    steps = sequence_steps([40, 41, 42], DECODES, block_size=16)
    assert steps == [SequenceStep([40], 0, [5]), SequenceStep([41], 15, [6]), SequenceStep([42], 32, [1, 2, 3])]
    assert all(type(b) is int for s in steps for b in s.block_table)  # host ints, no tensors


def test_one_token_per_request_passes_the_logits_through_uncopied():
    logits = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    rows = token_rows(3, step=1, meta=DECODES)[vllm_logits_indices(DECODES)]
    assert select_logits(rows, logits, step=1) is logits


# Speculative decoding, k = 2: request 0 verifies its last token and 2 drafts (length 20 after
# the step), request 1 got no draft (length 6), request 2 is a new 3-token prompt.
VERIFY = SimpleNamespace(
    num_reqs=3,
    query_start_loc_cpu=torch.tensor([0, 3, 4, 7, 7], dtype=torch.int32),
    seq_lens=torch.tensor([20, 6, 3, 0], dtype=torch.int32),
    block_table_tensor=torch.tensor([[4, 9, 0], [7, 0, 0], [2, 0, 0], [0, 0, 0]], dtype=torch.int32),
)


def vllm_spec_logits_indices(meta, drafts: list[int]) -> torch.Tensor:
    """What vLLM samples at with speculation (``_calc_spec_decode_metadata``): each request's
    last ``1 + drafts[i]`` tokens."""
    ends = meta.query_start_loc_cpu[1: meta.num_reqs + 1].tolist()
    return torch.tensor([i for end, d in zip(ends, drafts) for i in range(end - 1 - d, end)])


def test_with_speculation_no_request_above_one_plus_k_tokens_makes_every_token_a_decode_row():
    layout = speculative_rows([11, 12, 13, 14, 21, 22, 23], VERIFY, block_size=16, k=2)
    lens, request = layout.decode
    assert lens.tolist() == [18, 19, 20, 6, 1, 2, 3] and request.tolist() == [0, 0, 0, 1, 2, 2, 2]
    assert layout.seqs is None and layout.order.tolist() == list(range(7))
    logits = torch.arange(7.0)[:, None]  # the runner's: one row per token
    rows = token_rows(9, step=3, rows=layout.rows)  # vLLM pads the step to 9 tokens
    assert rows[7:, 0].tolist() == [NO_ROW, NO_ROW]
    picked = select_logits(rows[vllm_spec_logits_indices(VERIFY, [2, 0, 0])], logits, step=3)
    assert picked.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 6.0]


# k = 1: a 3-token prompt first, then a request verifying its last token and 1 draft (length 18).
PROMPT_THEN_VERIFY = SimpleNamespace(
    num_reqs=2,
    query_start_loc_cpu=torch.tensor([0, 3, 5], dtype=torch.int32),
    seq_lens=torch.tensor([3, 18], dtype=torch.int32),
    block_table_tensor=torch.tensor([[2, 0], [4, 9]], dtype=torch.int32),
)


def test_with_speculation_a_prompt_is_one_step_and_the_verify_tokens_one_step_each_before_it():
    layout = speculative_rows([21, 22, 23, 11, 12], PROMPT_THEN_VERIFY, block_size=16, k=1)
    assert layout.decode is None
    assert layout.seqs == [SequenceStep([11], 16, [4, 9]), SequenceStep([12], 17, [4, 9]),
                           SequenceStep([21, 22, 23], 0, [2])]
    assert layout.order.tolist() == [2, 3, 4, 0, 1]  # where each token's hidden state is in the runner's
    assert layout.rows.tolist() == [NO_ROW, NO_ROW, 2.0, 0.0, 1.0]
    logits = torch.tensor([[10.0], [11.0], [12.0]])  # the runner's: the two verify tokens, the prompt
    rows = token_rows(5, step=1, rows=layout.rows)
    picked = select_logits(rows[vllm_spec_logits_indices(PROMPT_THEN_VERIFY, [0, 1])], logits, step=1)
    assert picked.flatten().tolist() == [12.0, 10.0, 11.0]
