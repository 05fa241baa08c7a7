"""Where a small model's graph step spends its time (host vs compiled call vs the custom write op).

The small model is overhead-bound: the compiled call is profiled (``torch.profiler``, 50 calls at
batch 8) and split into the cache write custom op (``ascend_graph::write_slots``, called from the
compiled graph once per layer), dynamo's guard check, and the rest (the generated kernels); host
preparation is ``execute`` minus the compiled call. The same step from an AOTInductor package
(``GraphConfig.aot_inductor``: no dynamo guards) is timed in the same rounds.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from ascend_graph.block_manager import BlockManager
from ascend_graph.config import GraphConfig
from benchmarks.common import interleaved_medians
from benchmarks.models import build, cases, decode_batch, make_runner


def measure(batch: int = 8, calls: int = 50) -> dict:
    """Microseconds per step of each part."""
    case = cases(True)["small"]
    config = GraphConfig(enabled=True, backend="inductor", capture_sizes=(batch,), max_batch_size=batch)
    runner = make_runner(build(case), config, (batch,), case.context)
    runner.capture(show_progress=False)
    entries = decode_batch(runner, BlockManager(runner.num_blocks, runner.block_size), batch, case.context)
    graph, (ids, pos, meta) = runner._graphs[batch], runner._views(batch)

    def call() -> torch.Tensor:
        with torch.inference_mode():
            return graph(ids, pos, runner.kv_caches, meta)

    with tempfile.TemporaryDirectory(prefix="ag-overhead-aoti-") as packages:
        aot = make_runner(runner.model, replace(config, aot_inductor=True, compile_cache_dir=packages), (batch,),
                          case.context)
        aot.capture(show_progress=False)
        aot_entries = decode_batch(aot, BlockManager(aot.num_blocks, aot.block_size), batch, case.context)
        t = interleaved_medians({"execute": lambda: runner.execute(entries, mode="graph"), "compiled call": call,
                                 "execute, AOTInductor package": lambda: aot.execute(aot_entries, mode="graph")},
                                rounds=10, calls_per_round=20)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
    self_us = {e.key: e.self_cpu_time_total / calls for e in prof.key_averages()}
    res = {"batch": batch, "execute_us": t["execute"] * 1e6, "compiled_call_us": t["compiled call"] * 1e6,
           "write_slots_us": self_us.get("ascend_graph::write_slots", 0.0)
           + self_us.get("aten::index_copy_", 0.0) + self_us.get("aten::clamp", 0.0),
           "guard_us": self_us.get("TorchDynamo Cache Lookup", 0.0),
           "layers": case.config.num_hidden_layers, "aot_execute_us": t["execute, AOTInductor package"] * 1e6}
    print(f"  overhead batch {batch}: execute {res['execute_us']:.0f} us, compiled call {res['compiled_call_us']:.0f} us "
          f"(write_slots {res['write_slots_us']:.0f} us, guards {res['guard_us']:.0f} us); "
          f"execute from an AOTInductor package {res['aot_execute_us']:.0f} us", flush=True)
    return res
