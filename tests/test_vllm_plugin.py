"""ascend_graph inside the real vLLM: the plugin is inert without the flag, a bad flag fails at
``LLM(...)``, and with the flag on tiny DeepSeek-V2/V3 checkpoints decode as our graphs.

vLLM runs in a subprocess (``tests/vllm_worker.py``, in-process engine) of a python that has
it: ``$ASCEND_GRAPH_VLLM_PYTHON``, else this interpreter where vLLM is installed (the
``[vllm]`` extra). The subprocess finds the plugin through an entry point written here and
this checkout on ``PYTHONPATH``, so the code under test is always this tree's. Without a vLLM
python the module is skipped, except where ``$ASCEND_GRAPH_REQUIRE_VLLM`` is set (CI, once it
installs the extra), where that fails.

The ``ascend_graph`` torch.compile backend also serves as vLLM's own compilation backend
(``compilation_config={"mode": 2, "backend": "ascend_graph"}``), reached through its
``torch_dynamo_backends`` entry point.

Oracles: transformers' greedy tokens (float32) on the same checkpoint, and stock vLLM (the same
``LLM`` without the flag). Counters: every capture size captured in vLLM's start-up, before the
first request; then one prefill step, then one graph step per further token. The model contract
inside vLLM's own runner: its dummy run (``GPUModelRunner._dummy_run``, no attention metadata)
runs nothing and yields no logits, its profile run's sampler warm-up gets an error instead of
made-up logits, a forward without our metadata is an error naming the layer, the forward
returns ``[T, 2]`` rows (never ``[T, V]``) and ``compute_logits`` one row per request, and a
request for prompt logprobs (logits at prompt tokens) is an error.
Checkpoints: ``tests/hf_models.py`` with vLLM's CPU MLA widths (kv_lora_rank 512, rope 64),
2 layers, block 16. The V2 one has ``n_group = topk_group = 1``, as DeepSeek-V2-Lite: vLLM
routes every DeepSeek MoE group-limited whatever ``topk_method`` says, so with
``topk_method: greedy`` and 4 groups stock vLLM routes some tokens to other experts than
transformers (and the DeepSeek reference) do (docs/vllm.md).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers", minversion="5.0")
import torch  # noqa: E402

from hf_models import VOCAB, tiny_hf_model  # noqa: E402

pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "vllm_worker.py"
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [30, 31, 32, 33], [20, 21, 22]]
NEW_TOKENS = 8
SIZES = [1, 4]  # captured: max_num_seqs 4 is always captured
LLM_ARGS = dict(dtype="float32", max_model_len=128, block_size=16, max_num_seqs=4, skip_tokenizer_init=True,
                seed=0, kv_cache_memory_bytes=128 << 20)
# what a V3 checkpoint says and transformers' config omits: stock vLLM builds the correction bias from it
V3_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
ON = {"torchair_graph_config": {"enabled": True, "graph_batch_sizes": SIZES}}
# Stock vLLM's MLA: on a CPU with AMX tiles vLLM picks AMX_MLA, whose weight packing refuses these
# checkpoints' 16-wide heads (``convert_weight_packed``: "invalid weight input features 16"); CPU_MLA
# takes them. Graph mode's layers bring their own backend.
STOCK_MLA = {"attention_config": {"backend": "CPU_MLA"}}


def vllm_python() -> str:
    """A python that can import vLLM; skips (fails where vLLM is required) where there is none."""
    if os.environ.get("ASCEND_GRAPH_VLLM_PYTHON"):
        return os.environ["ASCEND_GRAPH_VLLM_PYTHON"]
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    message = "no vLLM: pip install 'ascend-graph[vllm]' or set ASCEND_GRAPH_VLLM_PYTHON to a vLLM venv's python"
    if os.environ.get("ASCEND_GRAPH_REQUIRE_VLLM"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """``run(spec) -> dict``: one ``tests/vllm_worker.py`` run in the vLLM python."""
    python, root = vllm_python(), tmp_path_factory.mktemp("vllm")
    dist = root / "plugin" / "ascend_graph-0.1.0.dist-info"  # the entry point pyproject.toml declares
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ascend-graph\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nascend_graph = ascend_graph.vllm:register\n\n"
                                           "[torch_dynamo_backends]\n"
                                           "ascend_graph = ascend_graph.compile:ascend_graph_backend\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{root / 'plugin'}", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1", VLLM_CACHE_ROOT=str(root / "cache"),
               TORCHINDUCTOR_COMPILE_THREADS="1", VLLM_LOGGING_STREAM="ext://sys.stderr")

    def run(spec: dict, **env_overrides: str) -> dict:
        n = len(list(root.glob("spec*.json")))
        spec_path, out_path = root / f"spec{n}.json", root / f"out{n}.json"
        spec_path.write_text(json.dumps(spec))
        log = root / f"log{n}.txt"
        with open(log, "w") as stderr:  # a file, not a pipe: a leftover engine process cannot hang the test
            worker = subprocess.Popen([python, str(WORKER), str(spec_path), str(out_path)], cwd=root,
                                      env={**env, **env_overrides}, stdout=subprocess.DEVNULL, stderr=stderr,
                                      start_new_session=True)
            try:
                rc = worker.wait(timeout=900)
            finally:
                _end_group(worker.pid)
        assert out_path.exists(), f"vLLM worker died (rc {rc}):\n{log.read_text()[-4000:]}"
        return json.loads(out_path.read_text())

    run.python, run.env, run.root = python, env, root
    return run


def _end_group(pid: int) -> None:
    """End what is left of the worker's session (a multi-process engine's children, if any)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def transformers_greedy(path: str, prompts: list[list[int]] = PROMPTS, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' float32 greedy tokens for ``prompts`` on the checkpoint at ``path``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return greedy_tokens(model, prompts, new_tokens)


def greedy_tokens(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """A transformers model's greedy tokens: the argmax of a full forward pass per token, EOS
    included as vLLM's ``ignore_eos`` has it (``generate(min_new_tokens=...)`` would mask EOS)."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt):])
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny V2 and V3 checkpoints (vLLM's CPU MLA widths) and transformers' tokens on each."""
    out = {}
    for flavour, config_updates in (("v2_greedy", {"n_group": 1, "topk_group": 1}), ("v3", V3_ROUTING)):
        path = tmp_path_factory.mktemp(flavour)
        tiny_hf_model(flavour, kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=2).save_pretrained(path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **config_updates}))
        out[flavour] = (str(path), transformers_greedy(str(path)))
    return out


def generation(path: str, additional_config: dict | None = None, repeats: int = 1, llm_args: dict | None = None,
               spec: dict | None = None) -> dict:
    """The spec of one ``tests/vllm_worker.py`` run that generates ``PROMPTS`` on ``path``."""
    llm = dict(LLM_ARGS, **(llm_args or {}), **({"additional_config": additional_config} if additional_config else {}))
    return {"model": path, "llm": llm, "prompts": PROMPTS, "max_tokens": NEW_TOKENS, "repeats": repeats,
            "count_backend_calls": True, **(spec or {})}


def generate(vllm_run, path: str, additional_config: dict | None = None, repeats: int = 1,
             llm_args: dict | None = None, spec: dict | None = None, **env: str) -> dict:
    result = vllm_run(generation(path, additional_config, repeats, llm_args, spec), **env)
    assert result["error"] is None, result["error"]
    return result


def generate_in_turn(vllm_run, *specs: dict) -> list[dict]:
    """``generation`` specs run one after another in one vLLM subprocess (vLLM imported once)."""
    results = vllm_run({"runs": list(specs)})["runs"]
    for result in results:
        assert result["error"] is None, result["error"]
    return results


def assert_captured_at_start(result: dict, max_num_seqs: int = LLM_ARGS["max_num_seqs"]) -> None:
    """Every capture size captured in vLLM's start-up (``runner_stats`` right after ``LLM(...)``:
    its time, an entry per size, no step yet), and nothing compiled or captured after it."""
    start, end = result["stats_at_start"], result["stats"]
    sizes = sorted(set(SIZES) | {max_num_seqs})
    assert start["graph_steps"] == 0 and start["eager_steps"] == {}, start
    assert sorted(start["capture"], key=int) == [str(s) for s in sizes], start["capture"]
    assert start["capture_seconds"] > 0 and start["compiles"] + start["packages_loaded"] == len(sizes)
    for key in ("compiles", "packages_loaded", "capture", "capture_seconds"):
        assert end[key] == start[key], key


def assert_model_contract(result: dict, generations: int) -> None:
    """What ``spec["contract"]`` and ``spec["prompt_logprobs"]`` record (tests/vllm_worker.py)."""
    contract = result["contract"]
    assert contract["dummy_run"] == {"shape": [3, 2], "rows": [-1.0], "stats_unchanged": True}
    assert "dummy run" in contract["profile_run_error"]["message"], contract
    assert "'model.layers.0.self_attn.attn'" in contract["no_metadata_error"]["message"], contract
    assert contract["stats_unchanged"]
    steps = [[sum(map(len, PROMPTS)), 2]] + [[len(PROMPTS), 2]] * (NEW_TOKENS - 1)  # the prefill, then decodes
    assert result["shapes"] == {"forward": steps * generations,
                                "compute_logits": [[len(PROMPTS), VOCAB]] * NEW_TOKENS * generations}
    assert "prompt logprobs are not supported" in result["prompt_logprobs_error"]["message"]


def assert_graph_counters(stats: dict, generations: int) -> None:
    """Each generation: one eager prefill step, then a graph step per further token; every
    capture size compiled (or loaded, precompiled by an earlier test's process) once, nothing after."""
    assert stats["eager_steps"] == {"prefill": generations}
    assert stats["graph_steps"] == generations * (NEW_TOKENS - 1)
    assert stats["compiles"] + stats["packages_loaded"] == len(set(SIZES) | {LLM_ARGS["max_num_seqs"]})
    assert stats["recompiles"] == 0 and stats["compile_failures"] == 0


def test_bad_flags_and_a_missing_tensor_fail_at_llm_construction_naming_them(vllm_run, checkpoints, tmp_path):
    """Each bad key of the flag's sections, and a checkpoint without one of its tensors (one vLLM
    subprocess for all: its import is most of each attempt's cost)."""
    from safetensors.torch import load_file, save_file

    path, _ = checkpoints["v2_greedy"]
    bad = [({"torchair_graph_config": {"enabled": True, "bogus": 1}}, "bogus"),
           ({"torchair_graph_config": {"enabled": "yes"}}, "torchair_graph_config.enabled"),
           ({"torchair_graph_config": {"enabled": True, "graph_batch_sizes": [64]}}, "max_num_seqs=4"),
           ({"ascend_graph": {"parity_interval": -1}}, "parity_interval"),
           ({"ascend_graph": {"moe_kernel": "fast"}}, "moe_kernel")]
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((pathlib.Path(path) / name).read_bytes())
    tensors = load_file(str(pathlib.Path(path) / "model.safetensors"))
    missing = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    save_file({k: v for k, v in tensors.items() if k != missing}, str(tmp_path / "model.safetensors"))
    attempts = [dict(LLM_ARGS, additional_config=a) for a, _ in bad]
    attempts.append(dict(LLM_ARGS, model=str(tmp_path), additional_config=ON))
    *errors, error = vllm_run({"model": path, "attempts": attempts})["errors"]
    for (additional, named), flag_error in zip(bad, errors):
        assert flag_error is not None, f"LLM(...) accepted {additional}"
        assert named in flag_error["message"] and "additional_config[" in flag_error["message"], flag_error
    assert error is not None and missing in error["message"], error


def test_v2_graph_mode_tokens_equal_stock_vllm_and_transformers(vllm_run, checkpoints, tmp_path):
    """Graph mode twice, each a fresh vLLM on one compile cache: the first compiles and saves its
    steps, the second (a restarted server) loads them and gives the same tokens."""
    path, expected = checkpoints["v2_greedy"]
    on = {**ON, "ascend_graph": {"compile_cache_dir": str(tmp_path)}}
    stock, graph = generate_in_turn(vllm_run, generation(path, llm_args=STOCK_MLA), generation(
        path, on, repeats=2, spec={"contract": True, "prompt_logprobs": True}))
    assert stock["plugin_loaded"] and stock["model_class"] == "DeepseekV2ForCausalLM"  # loaded, inert
    assert stock["tokens"] == expected and stock["backend_calls"] == 0  # vLLM's Inductor, not ours
    assert graph["model_class"] == "AscendGraphDeepseekV2ForCausalLM"
    assert graph["tokens"] == expected and graph["fused_moe_calls"] > 0  # the MoE in vLLM's kernel
    assert_graph_counters(graph["stats"], generations=2)
    assert_captured_at_start(graph)
    assert_model_contract(graph, generations=2)
    warm = generate(vllm_run, path, on)
    assert warm["tokens"] == expected and warm["stats"]["compiles"] == 0
    assert_graph_counters(warm["stats"], generations=1)
    assert_captured_at_start(warm)


def test_v3_graph_mode_tokens_equal_stock_vllm_eager_and_transformers_with_parity_checks(vllm_run, checkpoints):
    """Stock vLLM's default compiled graph routes this checkpoint's MoE wrongly (docs/vllm.md,
    upstream problems): the stock side is its eager path with native ops. Graph mode runs the
    MoE in our own backend here (``moe_kernel``), in vLLM's kernel in the V2 test."""
    path, expected = checkpoints["v3"]
    stock, graph = generate_in_turn(
        vllm_run, generation(path, llm_args={"enforce_eager": True, "compilation_config": {"custom_ops": ["none"]},
                                             **STOCK_MLA}),
        generation(path, {**ON, "ascend_graph": {"parity_interval": 3, "moe_kernel": "ascend_graph"}}))
    assert stock["model_class"] == "DeepseekV3ForCausalLM" and stock["tokens"] == expected
    assert graph["model_class"] == "AscendGraphDeepseekV3ForCausalLM"
    assert graph["tokens"] == expected and graph["fused_moe_calls"] == 0  # the MoE in our own backend
    stats = graph["stats"]
    assert_graph_counters(stats, generations=1)
    assert_captured_at_start(graph)
    assert stats["parity_checks"] == (NEW_TOKENS - 1) // 3 and stats["parity_failures"] == 0


def test_the_ascend_graph_backend_compiles_vllms_own_graph_with_tokens_equal_transformers(vllm_run, checkpoints):
    """vLLM's compilation with our backend (mode 2, its graph holds ``LayerName`` inputs)."""
    path, expected = checkpoints["v2_greedy"]
    compiled = generate(vllm_run, path, llm_args={"compilation_config": {"mode": 2, "backend": "ascend_graph"},
                                                  **STOCK_MLA})
    assert compiled["model_class"] == "DeepseekV2ForCausalLM"  # vLLM's own model, no graph mode
    assert compiled["backend_calls"] >= 1
    assert compiled["tokens"] == expected


def test_the_example_serves_a_checkpoint_in_graph_mode_in_vllms_multiprocess_engine(vllm_run, checkpoints):
    """``examples/vllm_graph_mode.py`` as a user runs it, in vLLM's default multi-process engine (the
    engine core in its own process) at tensor_parallel_size=2 (two workers of their own; the
    counters read across processes by ``runner_stats``): transformers' tokens, every capture size
    compiled once on each worker (one size: each compile on each worker is much of this test's
    time), every graph step checked against eager on each (float32: bfloat16's rounding on this
    random checkpoint exceeds parity's row rule at TP=1 as well)."""
    path, _ = checkpoints["v2_greedy"]
    example = ROOT / "examples" / "vllm_graph_mode.py"
    env = {**vllm_run.env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    with open(vllm_run.root / "example_log.txt", "w") as stderr:
        proc = subprocess.Popen([vllm_run.python, str(example), path, "--max-tokens", "4", "--sizes", "4",
                                 "--max-num-seqs", "4", "--tensor-parallel-size", "2",
                                 "--dtype", "float32", "--parity-interval", "1"], cwd=vllm_run.root, env=env, stdout=subprocess.PIPE,
                                stderr=stderr, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=900)
        finally:
            _end_group(proc.pid)
    assert proc.returncode == 0, (vllm_run.root / "example_log.txt").read_text()[-4000:]
    lines = out.splitlines()
    printed = [ast.literal_eval(line.split(" -> ")[1]) for line in lines if " -> " in line]
    prompts = [ast.literal_eval(line.split(" -> ")[0])["prompt_token_ids"] for line in lines if " -> " in line]
    assert printed == transformers_greedy(path, prompts, 4)
    workers = json.loads("\n".join(lines[lines.index("["):]))
    assert [w["parallel"]["tp_rank"] for w in workers] == [0, 1]
    for stats in workers:
        # requests reach the engine core one by one: a later one may prefill beside earlier decodes
        assert set(stats["eager_steps"]) <= {"prefill", "mixed"} and stats["graph_steps"] >= 4 - 2
        assert stats["compiles"] + stats["packages_loaded"] == 1  # size 4 (max_num_seqs): every decode step
        assert stats["recompiles"] == 0 and stats["compile_failures"] == 0
        assert stats["graph_steps"] == workers[0]["graph_steps"]
        assert stats["parity_checks"] == stats["graph_steps"] and stats["parity_failures"] == 0, stats


def test_mtp_drafts_of_our_engine_and_of_vllm_in_graph_mode_equal_stock_vllms_step_by_step(vllm_run, tmp_path):
    """Stock vLLM with ``speculative_config={"method": "mtp", "num_speculative_tokens": 3}`` on a
    tiny V3 whose MTP layer drafts the token it is given (``tiny_v3_with_mtp(repeat=True)``: some
    drafts are accepted, where the target repeats a token) is the oracle of two runs:

    - our Engine (verify graphs and the draft chain's): every draft, request by request and step
      by step, is vLLM's drafter's, which chains its one MTP layer as ours does;
    - vLLM in graph mode with the same ``speculative_config``: vLLM's drafter on our target's
      hidden states, its verify steps as our graphs (capture sizes of 1 + 3 rows per request):
      the same drafts at every step, so the same acceptance.

    The tokens are transformers'. Our MTP layer takes the target's embedding and head, as vLLM's does."""
    from hf_models import tiny_v3_with_mtp

    from ascend_graph import Engine
    from ascend_graph.config import GraphConfig
    from ascend_graph.models import load_deepseek

    tiny_v3_with_mtp(tmp_path, repeat=True, kv_lora_rank=512, qk_rope_head_dim=64)
    new, k = 24, 3
    eager = {"enforce_eager": True, "compilation_config": {"custom_ops": ["none"]}, **STOCK_MLA,
             "speculative_config": {"method": "mtp", "num_speculative_tokens": k}}
    graph_mode = {**ON, "ascend_graph": {"moe_kernel": "ascend_graph"}}
    theirs, graph = generate_in_turn(vllm_run, *({
        "model": str(tmp_path), "llm": dict(LLM_ARGS, **eager, **extra), "prompts": PROMPTS, "max_tokens": new,
        "record_drafts": True} for extra in ({}, {"additional_config": graph_mode})))
    expected = transformers_greedy(str(tmp_path), PROMPTS, new)
    assert theirs["tokens"] == expected and theirs["model_class"] == "DeepseekV3ForCausalLM"
    assert graph["model_class"] == "AscendGraphDeepseekV3ForCausalLM"
    assert graph["tokens"] == expected and graph["drafts"] == theirs["drafts"]
    # what the drafter drafted from, step by step: our target's hidden states at every token (this
    # MTP layer's drafts ignore them: eh_proj passes the embedding alone) are stock vLLM's
    assert len(graph["drafter_inputs"]) == len(theirs["drafter_inputs"])
    for ours_in, stock_in in zip(graph["drafter_inputs"], theirs["drafter_inputs"]):
        assert ours_in["token_ids"] == stock_in["token_ids"] and ours_in["positions"] == stock_in["positions"]
        torch.testing.assert_close(torch.tensor(ours_in["hidden_states"]), torch.tensor(stock_in["hidden_states"]),
                                   rtol=1e-4, atol=1e-4)
    # every verify step a graph; the four prompts in one eager step, those of at most 1 + k tokens
    # as decode rows beside the longer ones ("mixed"); vLLM's buffer kept: the drafter's cache is in it
    stats = graph["stats"]
    assert stats["graph_steps"] > 0 and stats["eager_steps"] == {"mixed": 1}, stats
    assert stats["vllm_kv_buffer_kept_bytes"] > 0 and theirs["stats"] is None
    assert sorted(stats["capture"], key=int) == [str(s * (1 + k)) for s in sorted(set(SIZES) | {4})]
    assert stats["recompiles"] == 0 and stats["compile_failures"] == 0

    engine = Engine(load_deepseek(tmp_path, torch.float32, mtp_layers=1), max_model_len=128, num_speculative_tokens=k,
                    graph_config=GraphConfig(enabled=True, backend="inductor", max_batch_size=4, capture_sizes=(4,)))
    ours, advance = {}, engine.spec.advance

    def recording(scheduler, batch, *args):  # each request's next draft after each of its steps
        done = advance(scheduler, batch, *args)
        for r in batch:
            ours.setdefault(str(r.index), []).append(list(r.drafts))
        return done

    engine.spec.advance = recording
    tokens = engine.generate(PROMPTS, new, ignore_eos=True)
    assert tokens == expected
    # after a request's last step vLLM still chains its drafts; ours stops at the first (none is verified)
    last = {index: steps[:-1] + [steps[-1][:1]] for index, steps in theirs["drafts"].items()}
    assert ours == last and all(len(d) == k for steps in ours.values() for d in steps[:-1])
    spec = engine.stats["speculative"]
    assert 0 < spec["accepted_tokens"] < spec["drafted_tokens"] and engine.stats["recompiles"] == 0
    chain = spec["draft_chain"]
    assert chain["graph_steps"] > 0 and chain["eager_steps_total"] == 0 and chain["recompiles"] == 0
