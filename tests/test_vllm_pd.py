"""Prefill on one vLLM, decode on another: ``TupleCacheConnector`` moves graph mode's tuple caches.

Two vLLM processes on 127.0.0.1 (``tests/vllm_pd_worker.py`` in the vLLM python, the harness of
tests/test_vllm_plugin.py), both with graph mode on and ``kv_transfer_config`` naming
``ascend_graph.vllm.kv_connector``: the producer prefills with ``max_tokens=1`` and keeps the
blocks; the consumer (in vLLM's default multi-process engine: the connector's scheduler half in
the engine core, its counters read across processes) pulls them with Mooncake's transfer engine
over TCP and decodes.

Oracles: transformers' float32 greedy tokens, and the producer itself as a single vLLM instance
(the same prompts, no transfer). Proof that the consumer did not recompute the prompts: its
runner ran no eager step at all (a prompt computed there would be an eager ``prefill``), only
graph steps; its connector loaded exactly the prompts' blocks. (vLLM's
``num_cached_tokens`` is no proof here: on a remote prefill it reports the producer's prefix
cache hits, ``remote_prefill_cached_tokens``.) Skipped without vLLM or without Mooncake in the vLLM python,
except where ``$ASCEND_GRAPH_REQUIRE_VLLM`` is set (CI), where that fails.

Then one failed pull (the producer's address changed to a port nobody listens on): the connector
counts the failure and reports the blocks invalid, and vLLM (``kv_load_failure_policy:
recompute``) prefills that prompt itself, to the same tokens. Last, a pull from the producer
after its process has ended, over the transport already connected to it: the read fails with
reads in flight, the request is reported once that transport has settled, and vLLM recomputes
it, to the same tokens.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess

import pytest

transformers = pytest.importorskip("transformers", minversion="5.0")
import torch  # noqa: E402

from hf_models import tiny_hf_model  # noqa: E402
from test_vllm_plugin import LLM_ARGS, NEW_TOKENS, ROOT, SIZES, _end_group, transformers_greedy  # noqa: E402
from test_vllm_plugin import vllm_run  # noqa: E402,F401

pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.slow]

WORKER = ROOT / "tests" / "vllm_pd_worker.py"
BLOCK = LLM_ARGS["block_size"]
# 3 blocks, 2 blocks (one token into the second), one full block, a partial one
_gen = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(3, 100, (n,), generator=_gen).tolist() for n in (40, 17, 16, 5)]
ON = {"torchair_graph_config": {"enabled": True, "graph_batch_sizes": SIZES}}
# the producer's engine in its process, the consumer's in vLLM's default engine-core process
ENV = {"producer": {"MC_LOG_LEVEL": "ERROR"},
       "consumer": {"MC_LOG_LEVEL": "ERROR", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny V2 of tests/test_vllm_plugin.py (vLLM's CPU MLA widths, ``n_group = topk_group = 1``)."""
    path = tmp_path_factory.mktemp("v2_pd")
    tiny_hf_model("v2_greedy", kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=2).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "n_group": 1, "topk_group": 1}))
    return str(path), transformers_greedy(str(path), PROMPTS, NEW_TOKENS)


def _require_mooncake(python: str) -> None:
    found = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('mooncake') is not None)"],
                           capture_output=True, text=True, timeout=120).stdout.strip()
    if found != "True":
        message = f"no Mooncake in {python}: pip install mooncake-transfer-engine-non-cuda"
        if os.environ.get("ASCEND_GRAPH_REQUIRE_VLLM"):
            pytest.fail(message)
        pytest.skip(message)


def _pair(vllm_run, path: str, timeout_s: int = 600) -> tuple[dict, dict]:
    """Producer and consumer run at once (their inits overlap); each one's OUT.json."""
    root, port = vllm_run.root, _free_port()
    handoff, release, secret = root / "pd_handoff.json", root / "pd_release", root / "pd_secret"
    secret.write_text(secrets.token_hex(32))  # the shared secret both connectors read (no default)
    secret.chmod(0o600)
    procs, outs, logs = [], [], []
    for role in ("producer", "consumer"):
        kv = {"kv_connector": "TupleCacheConnector", "kv_connector_module_path": "ascend_graph.vllm.kv_connector",
              "kv_role": f"kv_{role}", "kv_port": port, "kv_connector_extra_config": {"host": "127.0.0.1", "secret_file": str(secret)},
              "kv_load_failure_policy": "recompute"}
        # the consumer without prefix caching: a recomputed prompt is then a whole eager prefill (with it,
        # a prompt decoded before hits the cache and only its last, partial block is recomputed, in a
        # one-token step that looks like the step after a successful pull)
        llm = dict(LLM_ARGS, additional_config=ON, kv_transfer_config=kv,
                   **({"enable_prefix_caching": False} if role == "consumer" else {}))
        spec = {"role": role, "model": path, "prompts": PROMPTS, "max_tokens": NEW_TOKENS, "timeout_s": timeout_s,
                "handoff": str(handoff), "release": str(release), "dead_port": _free_port(), "producer_gone": True,
                "llm": llm}
        spec_path, out_path, log = root / f"pd_{role}.json", root / f"pd_{role}_out.json", root / f"pd_{role}.log"
        spec_path.write_text(json.dumps(spec))
        outs.append(out_path)
        logs.append(log)
        with open(log, "w") as stderr:  # a file, not a pipe: a leftover engine process cannot hang the test
            procs.append(subprocess.Popen([vllm_run.python, str(WORKER), str(spec_path), str(out_path)], cwd=root,
                                          env={**vllm_run.env, **ENV[role]}, stdout=subprocess.DEVNULL,
                                          stderr=stderr, start_new_session=True))
    try:
        for proc in procs:
            proc.wait(timeout=timeout_s + 120)
    finally:
        for proc in procs:
            _end_group(proc.pid)
    results = []
    for out, log in zip(outs, logs):
        assert out.exists(), f"vLLM PD worker died:\n{log.read_text()[-4000:]}"
        result = json.loads(out.read_text())
        assert result["error"] is None, f"{result['error']}\n{log.read_text()[-4000:]}"
        results.append(result)
    return results[0], results[1]


def test_decode_instance_pulls_the_prefilled_tuple_blocks_and_decodes_as_one_instance(vllm_run, checkpoint):
    _require_mooncake(vllm_run.python)
    path, expected = checkpoint
    producer, consumer = _pair(vllm_run, path)

    # tokens: the consumer's == the single instance's == transformers'; the first came from the prefill
    assert producer["tokens"] == expected
    assert consumer["tokens"] == expected
    assert producer["first_tokens"] == [t[:1] for t in expected]

    # the consumer computed no prompt: no eager step at all, graph steps only; requests reach its
    # engine core one by one, so a later one may start its first token a step after the others
    stats = consumer["stats"]
    assert stats["eager_steps"] == {}, stats
    assert NEW_TOKENS <= stats["graph_steps"] <= NEW_TOKENS + len(PROMPTS) - 1
    assert stats["recompiles"] == 0 and stats["compile_failures"] == 0
    blocks = sum(-(-len(p) // BLOCK) for p in PROMPTS)
    moved = consumer["transfer"]
    assert moved["requests_loaded"] == len(PROMPTS) and moved["load_failures"] == 0
    assert moved["blocks_loaded"] == blocks
    # per block and layer: kv_c [16, 1, 512] and k_pe [16, 1, 64] float32
    assert moved["bytes_loaded"] == blocks * 2 * BLOCK * (512 + 64) * 4
    assert moved["regions"] == 2 * 2  # two layers, two tensors each
    assert moved["descriptors"] == len(PROMPTS) * 2 * 2  # each request's blocks one run, per tensor

    # the producer freed every held request once the consumer said it had read it, each lease held
    # till then; its authenticated control server answered one layout and one done per prompt
    assert producer["transfer"]["requests_sent"] == len(PROMPTS)
    assert producer["transfer"]["requests_loaded"] == 0
    assert producer["transfer"]["leases_expired"] == 0 and moved["expired_pulls"] == 0
    assert producer["transfer"]["control"] == {"served": 1 + len(PROMPTS), "refused_connections": 0,
                                               "refused_messages": 0, "errors": 0}

    # a pull that fails (nothing listens at the address) is reported; vLLM recomputes the prompt
    failure = consumer["after_failure"]
    assert failure["tokens"] == expected[0]
    assert failure["transfer"]["load_failures"] == 1
    assert failure["transfer"]["requests_loaded"] == len(PROMPTS)
    assert failure["stats"]["eager_steps"] == {"prefill": 1}

    # the producer gone: its connected transport breaks mid-read; the consumer recomputes and serves on
    orphan = consumer["after_producer_died"]
    assert orphan["tokens"] == expected[1]
    assert orphan["transfer"]["load_failures"] == 2
    assert orphan["transfer"]["requests_loaded"] == len(PROMPTS)
    assert orphan["transfer"]["transports_opened"] == 1  # one handshake for the producer's lifetime
    assert orphan["stats"]["eager_steps"] == {"prefill": 2}
