"""Where a small model's graph step spends its time (host vs compiled call vs dynamo's guards).

The small model is overhead-bound. ``execute`` and the bare compiled call are timed in the same
rounds as two more: the compiled call of a second runner whose backend calls the cache write as
the custom op (``ascend_graph::write_slots``, once per layer, into Python) instead of generating
it (``inline_cache_writes``, the default on CPU), and the same step from an AOTInductor package
(``GraphConfig.inductor.aot``: no dynamo guards). The compiled calls are profiled
(``torch.profiler``, 50 calls at batch 8): dynamo's guard check, and the op's own time in the
second runner. Host preparation is ``execute`` minus the compiled call.

``host_metadata`` times the part of host preparation that grows with context:
``build_attention_metadata`` for a decode batch, with the block tables as ``BlockManager`` keeps
them (int32 arrays, copied with a memcpy each) and as plain Python lists (converted id by id).

``python -m benchmarks.overhead --profile`` is a tool, not a part of the suite: where a V2-Lite-slice
graph (or eager) step's time goes, kernel by kernel. The step is compiled with Inductor's
``cpp.enable_kernel_profile`` (every generated C++ kernel records itself to ``torch.profiler``)
and profiled over a few calls; profiling adds overhead to small ops, so read the large kernels.

    TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.overhead --profile --batch 1 [--frozen] [--eager]
"""

from __future__ import annotations

import argparse
import tempfile
from array import array
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from ascend_graph.attention import build_attention_metadata
from ascend_graph.attention.metadata import INT32_TYPECODE
from ascend_graph.compile.inductor import INLINE_CACHE_WRITES, InductorBackend, config_patches
from ascend_graph.engine.block_manager import BlockManager
from ascend_graph.config import GraphConfig, InductorOptions
from benchmarks.common import interleaved_medians, set_malloc_keeps_freed_memory
from benchmarks.models import build, cases, decode_batch, make_runner


def measure(batch: int = 8, calls: int = 50) -> dict:
    """Microseconds per step of each part."""
    case = cases(True)["small"]
    config = GraphConfig(enabled=True, backend="inductor", capture_sizes=(batch,), max_batch_size=batch)
    runner = make_runner(build(case), config, (batch,), case.context)
    runner.capture(show_progress=False)
    entries = decode_batch(runner, BlockManager(runner.num_blocks, runner.block_size), batch, case.context)
    op_runner = make_runner(runner.model, config, (batch,), case.context,
                            backend=InductorBackend(config_patches(config, "cpu"), inline_writes=False))
    op_runner.capture(show_progress=False)
    decode_batch(op_runner, BlockManager(op_runner.num_blocks, op_runner.block_size), batch, case.context)
    call, op_call = _compiled_call(runner, batch), _compiled_call(op_runner, batch)

    with tempfile.TemporaryDirectory(prefix="ag-overhead-aoti-") as packages:
        aot = make_runner(runner.model, replace(config, inductor=replace(config.inductor, aot=True), compile_cache_dir=packages), (batch,),
                          case.context)
        aot.capture(show_progress=False)
        aot_entries = decode_batch(aot, BlockManager(aot.num_blocks, aot.block_size), batch, case.context)
        t = interleaved_medians({"execute": lambda: runner.execute(entries, mode="graph"), "compiled call": call,
                                 "compiled call, write as the op": op_call,
                                 "execute, AOTInductor package": lambda: aot.execute(aot_entries, mode="graph")},
                                rounds=10, calls_per_round=20)
    self_us, op_self_us = _self_us(call, calls), _self_us(op_call, calls)
    res = {"batch": batch, "execute_us": t["execute"] * 1e6, "compiled_call_us": t["compiled call"] * 1e6,
           "compiled_call_op_write_us": t["compiled call, write as the op"] * 1e6,
           "write_slots_us": op_self_us.get("ascend_graph::write_slots", 0.0)
           + op_self_us.get("aten::index_copy_", 0.0) + op_self_us.get("aten::clamp", 0.0),
           "guard_us": self_us.get("TorchDynamo Cache Lookup", 0.0),
           "layers": case.config.num_hidden_layers, "aot_execute_us": t["execute, AOTInductor package"] * 1e6,
           "host_metadata": host_metadata()}
    print(f"  overhead batch {batch}: execute {res['execute_us']:.0f} us, compiled call {res['compiled_call_us']:.0f} us "
          f"(guards {res['guard_us']:.0f} us); with the cache write called as the op "
          f"{res['compiled_call_op_write_us']:.0f} us (the op {res['write_slots_us']:.0f} us); "
          f"execute from an AOTInductor package {res['aot_execute_us']:.0f} us", flush=True)
    return res


def host_metadata(shapes=((8, 256), (64, 256), (64, 4096), (64, 16384)), block_size: int = 16) -> list[dict]:
    """Microseconds of ``build_attention_metadata`` for ``batch`` decode rows at ``context`` tokens,
    block tables as int32 arrays and as lists, timed in the same rounds."""
    rows = []
    for batch, context in shapes:
        per = -(-context // block_size)
        arrays = [array(INT32_TYPECODE, range(1 + i * per, 1 + (i + 1) * per)) for i in range(batch)]
        lists = [list(t) for t in arrays]
        kw = dict(block_size=block_size, num_blocks=1 + batch * per, max_model_len=context, block_table_width=per)

        def metadata(tables):
            return lambda: build_attention_metadata(tables, [context - 1] * batch, [1] * batch, **kw)
        t = interleaved_medians({"arrays": metadata(arrays), "lists": metadata(lists)}, rounds=15, calls_per_round=5)
        rows.append({"batch": batch, "context": context, "block_ids": batch * per,
                     "arrays_us": t["arrays"] * 1e6, "lists_us": t["lists"] * 1e6})
        print(f"  host metadata batch {batch}, context {context}: {t['arrays'] * 1e6:.0f} us (BlockManager arrays), "
              f"{t['lists'] * 1e6:.0f} us (lists)", flush=True)
    return rows


def _compiled_call(runner, batch: int):
    """The runner's compiled step for ``batch`` on its static inputs, without the host part."""
    graph, (ids, pos, meta) = runner._graphs[batch], runner._views(batch)

    def call() -> torch.Tensor:
        with torch.inference_mode():
            return graph(ids, pos, runner.kv_caches, meta)
    return call


def _self_us(fn, calls: int) -> dict:
    """Profiled self time per call of each event, microseconds."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    return {e.key: e.self_cpu_time_total / calls for e in prof.key_averages()}


def profile_step(batch: int = 1, frozen: bool = False, eager: bool = False, steps: int = 3,
                 rows: int = 20) -> None:
    """Print the kernels and ops of a V2-Lite-slice step by self time per step (``eager``: the
    eager runner's step, aten op by op; ``frozen``: with ``inductor.freezing_min_batch``)."""
    case = cases(False)["v2_lite_slice"]
    config = GraphConfig(enabled=True, backend="inductor", capture_sizes=(batch,), max_batch_size=batch,
                         inductor=InductorOptions(freezing_min_batch=batch if frozen else None))
    backend = InductorBackend({**config_patches(config, "cpu"), "cpp.enable_kernel_profile": True},
                              inline_writes=INLINE_CACHE_WRITES["cpu"])
    runner = make_runner(build(case), config, (batch,), case.context, backend=backend)
    mode = "eager" if eager else "graph"
    if not eager:
        runner.capture(show_progress=False)
    entries = decode_batch(runner, BlockManager(runner.num_blocks, runner.block_size), batch, case.context)
    for _ in range(3):
        runner.execute(entries, mode=mode)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.execute(entries, mode=mode)
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    print(f"V2-Lite slice {mode} step, batch {batch}{', frozen' if frozen else ''}: self time per step")
    for e in top:
        print(f"  {e.self_cpu_time_total / steps / 1e3:9.3f} ms  {e.count // steps:4d} calls  {e.key[:110]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", action="store_true", help="profile a V2-Lite-slice step kernel by kernel")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--frozen", action="store_true", help="with inductor.freezing_min_batch (CPU)")
    p.add_argument("--eager", action="store_true", help="profile the eager runner's step instead")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=20, help="table rows")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    set_malloc_keeps_freed_memory(True)
    if args.profile:
        profile_step(args.batch, args.frozen, args.eager, args.steps, args.rows)
    else:
        print(measure())


if __name__ == "__main__":
    main()
