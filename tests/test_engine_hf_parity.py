"""The engine against transformers' own greedy generation, on tiny random DeepSeek V2 and V3.

transformers builds the models (float32), ``save_pretrained`` writes them, ``Engine.from_pretrained``
loads them. Prompts of three lengths with three generation budgets are served with continuous
batching (the decode batch shrinks 3 -> 2 -> 1 as requests finish), eagerly and in graph mode.
The oracle is ``model.generate(do_sample=False)`` per prompt: same tokens, and per-step logits
(``output_logits``) equal to float32 rounding.
"""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("safetensors")

from hf_models import random_prompts, tiny_hf_model  # noqa: E402

from ascend_graph.config import GraphConfig  # noqa: E402
from ascend_graph.engine import Engine  # noqa: E402

BUDGETS = [32, 40, 36]  # different lengths: the decode batch size changes
LOGIT_ATOL = 1e-4  # float32; measured max ~2e-5, eager and graph alike
# V3 runs on the real CPU backend (Inductor); V2 on aot_eager to keep compile time down.
BACKENDS = {"v2_greedy": "aot_eager", "v3": "inductor"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per flavour: the checkpoint directory and transformers' greedy generation of each prompt."""
    out, prompts = {}, random_prompts()
    for flavour in BACKENDS:
        hf = tiny_hf_model(flavour)
        path = tmp_path_factory.mktemp(flavour)
        hf.save_pretrained(path)
        out[flavour] = (path, [hf_generate(hf, p, n) for p, n in zip(prompts, BUDGETS)])
    return out


@torch.no_grad()
def hf_generate(hf, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the ``[new_tokens, V]`` logits they were chosen from."""
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True,
                      pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0].float()


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("flavour", list(BACKENDS))
def test_engine_greedy_generation_matches_transformers(flavour, graph, checkpoints):
    path, reference = checkpoints[flavour]
    # batches 2 and 3 run padded to 4: one compile per size, and Inductor's take 20 s each, cold
    config = GraphConfig(enabled=graph, backend=BACKENDS[flavour], capture_sizes=(1, 4), max_batch_size=4)
    engine = Engine.from_pretrained(path, graph_config=config, dtype=torch.float32, block_size=4,
                                    max_model_len=64)
    tokens, logits = engine.generate(random_prompts(), BUDGETS, return_logits=True)
    for i, (ref_tokens, ref_logits) in enumerate(reference):
        assert ref_logits.std(dim=-1).min() > 0.5, "logits nearly constant: the token check would mean little"
        assert tokens[i] == ref_tokens, f"request {i}: tokens differ from transformers' greedy generation"
        diff = (logits[i] - ref_logits).abs().max().item()
        assert diff < LOGIT_ATOL, f"request {i}: max |logit difference| {diff:.3g}"
    stats = engine.stats
    assert stats["decode_batch_sizes"] == {"1": 4, "2": 4, "3": 31}
    assert stats["free_blocks"] == engine.num_blocks - 1
    if graph:
        assert stats["graph_steps"] == stats["decode_steps"] > 0 and stats["recompiles"] == 0
        assert stats["compiles"] == 2 and stats["eager_steps"] == {"prefill": 1}
    else:
        assert stats["graph_steps"] == 0 and stats["eager_steps"] == {"prefill": 1, "disabled": 39}


def test_checkpoint_tokenizer_loads_lazily_and_its_absence_is_clear(checkpoints, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    path, _ = checkpoints["v2_greedy"]
    plain = Engine.from_pretrained(path, graph_config=GraphConfig(enabled=False), block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="holds no tokenizer .* pass prompt token ids instead"):
        plain.generate(["hello world"], 2)

    with_tokenizer = tmp_path / "with_tokenizer"
    shutil.copytree(path, with_tokenizer)
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "hello": 5, "world": 9}, unk_token="<unk>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.save(str(with_tokenizer / "tokenizer.json"))
    engine = Engine.from_pretrained(with_tokenizer, graph_config=GraphConfig(enabled=False), block_size=4,
                                    max_model_len=64)
    assert engine._tokenizer is None  # not loaded before it is needed
    assert engine.generate(["hello world"], 3) == engine.generate([[5, 9]], 3)
    assert engine.decode([9, 5]) == "world hello"
