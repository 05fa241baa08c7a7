"""KV block transfer throughput between two processes on this machine, per transport.

The destination is this process, the source a child (``python -m benchmarks.pd_transfer --child
TRANSPORT``), both with the same MLA caches: ``LAYERS`` layers of kv_c ``[N, 16, 1, 512]`` and
k_pe ``[N, 16, 1, 64]`` fp32, separately allocated. Each transport moves the same blocks, about
``--mib`` MiB, in two shapes:

    runs     blocks 1..B -> 1..B: one descriptor per tensor
    blocks   blocks 1..B -> B..1: no two blocks consecutive on both sides, one descriptor per block
             per tensor, in batches of at most 512

Figures are medians over ``--repeats`` transfers (the first transfer of each case is a warm-up and
not counted), each checked bit-exact against ``index_copy_`` once. "Copy bandwidth" is a local
torch ``copy_`` of the same number of bytes between two flat buffers, and ``index_copy`` the
oracle's gather and scatter of the same blocks, timed in the same run, so the ratios compare
figures from one machine state. Each process runs ``--threads`` torch threads (default 1):

    python -m benchmarks.pd_transfer --json FILE   (the suite's ``pd`` part runs it too)
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

from benchmarks.common import conditions, write_json

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


def measure(name: str, num_blocks: int, repeats: int) -> dict:
    """One transport: every shape, ``repeats`` timed transfers each, checked once against the oracle."""
    from ascend_graph.pd.layout import CacheLayout, plan_transfer
    from ascend_graph.pd.select import open_transport

    child = subprocess.Popen([sys.executable, "-m", "benchmarks.pd_transfer", "--child", name,
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


def run(mib: int, repeats: int, transports: list[str]) -> dict:
    per_block = LAYERS * BLOCK_SIZE * (KV_LORA_RANK + ROPE_DIM) * 4
    num_blocks = mib * 2**20 // per_block + 1  # the null block is never moved
    src_ids, dst_ids = shapes(num_blocks)["blocks"]
    nbytes = (num_blocks - 1) * per_block
    copy_s = _timed_copy(nbytes, repeats)
    index_s = _timed_index_copy(make_caches(num_blocks, 1), make_caches(num_blocks, 2), src_ids, dst_ids, repeats)
    rows = {"copy": {"bytes": nbytes, "median_s": copy_s, "gib_per_s": nbytes / copy_s / 2**30},
            "index_copy": {"bytes": nbytes, "median_s": index_s, "gib_per_s": nbytes / index_s / 2**30}}
    for name in transports:
        rows[name] = measure(name, num_blocks, repeats)
        for shape in rows[name].values():
            shape["vs_copy"] = copy_s / shape["median_s"]
    return {"conditions": {**conditions(), "torch_threads": torch.get_num_threads()},
            "setup": {"layers": LAYERS, "block_size": BLOCK_SIZE, "kv_lora_rank": KV_LORA_RANK, "rope_dim": ROPE_DIM,
                      "dtype": "float32", "num_blocks": num_blocks, "bytes_per_block": per_block,
                      "repeats": repeats, "host": "127.0.0.1"},
            "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    parser.add_argument("--mib", type=int, default=64, help="cache bytes moved per transfer, MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transports", nargs="+", default=["gloo", "mooncake"])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in each process (on a shared 2-core machine, 2 threads wait on each other)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        return _child(args.child, args.blocks)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    data = run(args.mib, args.repeats, args.transports)
    for name, row in data["rows"].items():
        shown = row.items() if name in ("gloo", "mooncake") else [("", row)]
        for shape, r in shown:
            extra = f"  {r['descriptors']} descriptors  x{r['vs_copy']:.3f} of copy" if shape else ""
            print(f"{name:10s} {shape:7s} {r['gib_per_s']:7.2f} GiB/s  {r['median_s'] * 1e3:8.1f} ms{extra}")
    write_json(args.json, data)


if __name__ == "__main__":
    main()
