"""Prefill and decode in two processes on this machine: the KV transfer, then serving.

``transfer``: KV block throughput between two processes per transport. The destination is this
process, the source a child (``python -m benchmarks.pd --child TRANSPORT``), both with the same
MLA caches: ``LAYERS`` layers of kv_c ``[N, 16, 1, 512]`` and k_pe ``[N, 16, 1, 64]`` fp32,
separately allocated. Each transport moves the same blocks in two shapes:

    runs     blocks 1..B -> 1..B: one descriptor per tensor
    blocks   blocks 1..B -> B..1: no two blocks consecutive on both sides, one descriptor per block
             per tensor, in batches of at most 512

Medians over ``repeats`` transfers (the first of each case a warm-up), each checked bit-exact
against ``index_copy_`` once; a local ``copy_`` of the same bytes and ``index_copy_`` of the same
blocks timed in the same run, so the ratios compare one machine state.

``serving``: the same requests served with prefill and decode in two processes against one
process, the two taking turns in every round, graph mode on both decode sides (the built-in
small model, one thread each); ``ttft`` is admission to first token (with PD: the prefill
process's step, the control message, the KV transfer); the tokens of every round checked equal.

    python -m benchmarks --parts pd
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from ascend_graph.config import GraphConfig
from ascend_graph.engine.engine import Engine
from ascend_graph.models.named import named_model
from ascend_graph.pd import DecodeEngine, PrefillProcess, resolve_transport
from benchmarks.common import conditions

LAYERS, BLOCK_SIZE, KV_LORA_RANK, ROPE_DIM = 4, 16, 512, 64
TIMEOUT_S = 60.0


def make_caches(num_blocks: int, seed: int):
    from ascend_graph.kv_cache import MLACacheSpec, allocate_kv_caches

    kv = allocate_kv_caches([MLACacheSpec(KV_LORA_RANK, ROPE_DIM)] * LAYERS, num_blocks, BLOCK_SIZE)
    g = torch.Generator().manual_seed(seed)
    for cache in kv:
        for t in cache:
            t.copy_(torch.randn(t.shape, generator=g))
    return kv


def shapes(num_blocks: int) -> dict[str, tuple[list[int], list[int]]]:
    ids = list(range(1, num_blocks))
    return {"runs": (ids, ids), "blocks": (ids, ids[::-1])}


def _child(name: str, num_blocks: int) -> None:
    """The source: register, print the endpoint, then serve ``connect`` / ``send`` / ``exit`` lines."""
    from ascend_graph.pd.layout import CacheLayout, plan_transfer
    from ascend_graph.pd.select import open_transport

    transport = open_transport(name, "source")
    layout = transport.register(make_caches(num_blocks, seed=1))
    print(json.dumps(transport.endpoint()), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "connect":
            transport.connect(cmd["peer"], TIMEOUT_S)
        elif cmd["op"] == "send":
            src, dst = shapes(num_blocks)[cmd["shape"]]
            transport.send(plan_transfer(layout, CacheLayout.from_dict(cmd["layout"]), src, dst), TIMEOUT_S)
        else:
            break
        print(json.dumps({"ok": True}), flush=True)
    transport.close()


def _timed_copy(nbytes: int, repeats: int) -> float:
    a, b = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    b.copy_(a)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _timed_index_copy(src_kv, dst_kv, src_ids, dst_ids, repeats: int) -> float:
    s, d = torch.tensor(src_ids), torch.tensor(dst_ids)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        for a, b in zip(src_kv, dst_kv):
            for x, y in zip(a, b):
                y.index_copy_(0, d, x.index_select(0, s))
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def transfer_case(name: str, num_blocks: int, repeats: int) -> dict:
    """One transport: every shape, ``repeats`` timed transfers each, checked once against the oracle."""
    from ascend_graph.pd.layout import CacheLayout, plan_transfer
    from ascend_graph.pd.select import open_transport

    child = subprocess.Popen([sys.executable, "-m", "benchmarks.pd", "--child", name,
                              "--blocks", str(num_blocks), "--threads", str(torch.get_num_threads())], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(cmd: dict) -> None:
        child.stdin.write(json.dumps(cmd) + "\n")
        child.stdin.flush()

    try:
        peer = json.loads(child.stdout.readline())
        kv = make_caches(num_blocks, seed=2)
        transport = open_transport(name, "destination")
        layout = transport.register(kv)
        ask({"op": "connect", "peer": transport.endpoint()})
        transport.connect(peer, TIMEOUT_S)
        assert json.loads(child.stdout.readline())["ok"]
        src_layout = CacheLayout.from_dict(peer["layout"])
        out = {}
        for shape, (src_ids, dst_ids) in shapes(num_blocks).items():
            plan = plan_transfer(src_layout, layout, src_ids, dst_ids)
            times = []
            for _ in range(repeats + 1):
                ask({"op": "send", "shape": shape, "layout": layout.to_dict()})
                t = time.perf_counter()
                transport.receive(plan, TIMEOUT_S)
                times.append(time.perf_counter() - t)
                assert json.loads(child.stdout.readline())["ok"]
            src = make_caches(num_blocks, seed=1)
            exact = all(torch.equal(y[torch.tensor(dst_ids)], x[torch.tensor(src_ids)])
                        for a, b in zip(src, kv) for x, y in zip(a, b))
            seconds = statistics.median(times[1:])
            out[shape] = {"descriptors": plan.num_descriptors, "batches": len(plan.batches), "bytes": plan.num_bytes,
                          "first_s": times[0], "median_s": seconds, "gib_per_s": plan.num_bytes / seconds / 2**30,
                          "bit_exact": exact}
        ask({"op": "exit"})
        transport.close()
        return out
    finally:
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)


def transfer(mib: int, repeats: int, transports: list[str]) -> dict:
    """Every transport moving the same blocks, against a local copy and ``index_copy_`` of them."""
    per_block = LAYERS * BLOCK_SIZE * (KV_LORA_RANK + ROPE_DIM) * 4
    num_blocks = mib * 2**20 // per_block + 1  # the null block is never moved
    src_ids, dst_ids = shapes(num_blocks)["blocks"]
    nbytes = (num_blocks - 1) * per_block
    copy_s = _timed_copy(nbytes, repeats)
    index_s = _timed_index_copy(make_caches(num_blocks, 1), make_caches(num_blocks, 2), src_ids, dst_ids, repeats)
    rows = {"copy": {"bytes": nbytes, "median_s": copy_s, "gib_per_s": nbytes / copy_s / 2**30},
            "index_copy": {"bytes": nbytes, "median_s": index_s, "gib_per_s": nbytes / index_s / 2**30}}
    for name in transports:
        rows[name] = transfer_case(name, num_blocks, repeats)
        for shape in rows[name].values():
            shape["vs_copy"] = copy_s / shape["median_s"]
    return {"conditions": {**conditions(), "torch_threads": torch.get_num_threads()},
            "setup": {"layers": LAYERS, "block_size": BLOCK_SIZE, "kv_lora_rank": KV_LORA_RANK, "rope_dim": ROPE_DIM,
                      "dtype": "float32", "num_blocks": num_blocks, "bytes_per_block": per_block,
                      "repeats": repeats, "host": "127.0.0.1"},
            "rows": rows}


GEOMETRY = dict(block_size=16, max_model_len=256)
NEW_TOKENS = 32


def prompts(batch: int, vocab: int) -> list[list[int]]:
    """``batch`` prompts of 40..(40 + 24 * batch) tokens."""
    return [[(11 * i + 7 * j) % vocab for j in range(40 + 24 * i)] for i in range(batch)]


class TimedEngine(Engine):
    """A single-process engine that notes when each request's first token was made."""

    def _serve(self, requests, *args, **kwargs):
        self.first_token_at, self.started = {}, time.monotonic()
        return super()._serve(requests, *args, **kwargs)

    def _advance(self, scheduler, batch, logits, prefill, *args):
        done = super()._advance(scheduler, batch, logits, prefill, *args)
        if prefill:
            now = time.monotonic()
            self.first_token_at.update({r.index: now - self.started for r in batch})
        return done


def serve(engine: Engine, reqs: list, budgets: list) -> tuple[list, float, float]:
    """Tokens, mean ttft (s) and decode ms per step of one ``generate`` run."""
    c = engine.counters
    steps, seconds = c.decode_steps, c.decode_seconds
    if isinstance(engine, DecodeEngine):
        before = len(engine.transfer.ttft_seconds)
        tokens = engine.generate(reqs, budgets, ignore_eos=True)
        ttft = statistics.fmean(engine.transfer.ttft_seconds[before:])
    else:
        tokens = engine.generate(reqs, budgets, ignore_eos=True)
        ttft = statistics.fmean(engine.first_token_at.values())
    return tokens, ttft, 1e3 * (c.decode_seconds - seconds) / (c.decode_steps - steps)


def serving_transport(model, transport: str, batches: tuple[int, ...], rounds: int) -> list[dict]:
    config = GraphConfig(enabled=True, capture_sizes=batches, max_batch_size=max(batches))
    seats = max(batches)
    num_blocks = 1 + seats * GEOMETRY["max_model_len"] // GEOMETRY["block_size"]
    single = TimedEngine(model, graph_config=config, max_num_seqs=seats, num_blocks=num_blocks, **GEOMETRY)
    single.capture(show_progress=False)
    rows = []
    with PrefillProcess("small", transport=transport, threads=1, num_blocks=num_blocks, **GEOMETRY) as server:
        pd = DecodeEngine(model, server, transport=transport, graph_config=config, max_num_seqs=seats,
                          num_blocks=num_blocks, **GEOMETRY)
        try:
            pd.capture(show_progress=False)
            for batch in batches:
                reqs, budgets = prompts(batch, model.config.vocab_size), [NEW_TOKENS] * batch
                samples = {"single": [], "pd": []}
                for r in range(rounds + 1):  # round 0 warms both up
                    order = (("single", single), ("pd", pd)) if r % 2 else (("pd", pd), ("single", single))
                    outs = {name: serve(engine, reqs, budgets) for name, engine in order}
                    if outs["pd"][0] != outs["single"][0]:
                        raise AssertionError(f"batch {batch}: PD tokens differ from the single process's")
                    if r:
                        for name, (_, ttft, ms) in outs.items():
                            samples[name].append((ttft, ms))
                rows.append(row(transport, batch, reqs, samples, pd))
        finally:
            pd.close()
    return rows


def row(transport: str, batch: int, reqs: list, samples: dict, pd: DecodeEngine) -> dict:
    med = {name: (statistics.median(s[0] for s in v), statistics.median(s[1] for s in v))
           for name, v in samples.items()}
    t = pd.transfer
    out = {"transport": transport, "batch": batch, "prompt_tokens": [len(p) for p in reqs],
           "single_ttft_ms": round(1e3 * med["single"][0], 3), "pd_ttft_ms": round(1e3 * med["pd"][0], 3),
           "single_decode_ms": round(med["single"][1], 3), "pd_decode_ms": round(med["pd"][1], 3),
           "transfer_bytes_per_request": t.bytes // max(t.transfers, 1),
           "transfer_ms_per_request": round(1e3 * t.seconds / max(t.transfers, 1), 3),
           "decode_recompiles": pd.runner.stats.recompiles, "tokens_equal": True}
    out["pd_over_single_ttft"] = round(out["pd_ttft_ms"] / out["single_ttft_ms"], 3)
    out["pd_over_single_decode"] = round(out["pd_decode_ms"] / out["single_decode_ms"], 3)
    print(f"{transport:>8} batch {batch}: ttft single {out['single_ttft_ms']:.2f} ms, PD {out['pd_ttft_ms']:.2f} ms "
          f"({out['pd_over_single_ttft']:.2f}x); decode step single {out['single_decode_ms']:.3f} ms, PD "
          f"{out['pd_decode_ms']:.3f} ms ({out['pd_over_single_decode']:.2f}x)", flush=True)
    return out


def serving(transports: list[str], batches: tuple[int, ...], rounds: int) -> dict:
    """Every transport (a name or ``auto``) at every batch size: the figures as one JSON object."""
    torch.set_num_threads(1)
    model = named_model("small")[0]
    rows = [r for t in transports for r in serving_transport(model, resolve_transport(t), batches, rounds)]
    return {"benchmark": "pd_serving", "conditions": conditions(), "model": "small", "new_tokens": NEW_TOKENS,
            "rounds": rounds, **GEOMETRY, "rows": rows}


def run(transports: list[str], quick: bool) -> dict:
    """The suite's ``pd`` part: the transfer, then serving, over every transport."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    return {"transfer": transfer(16 if quick else 64, 3 if quick else 5, transports),
            "serving": serving(transports, (1, 4), 5 if quick else 15)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", required=True, help="the transfer's source process, for this transport")
    p.add_argument("--blocks", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    _child(args.child, args.blocks)
