"""Where a V2-Lite-slice graph (or eager) step's time goes, kernel by kernel.

The step is compiled with Inductor's ``cpp.enable_kernel_profile`` (every generated C++ kernel
records itself to ``torch.profiler``) and profiled over a few calls; the table lists the
kernels and ops by self time per step. Profiling adds overhead to small ops: read the large
kernels. Not part of the suite (no ratio to keep); a tool for finding the next thing to fix.

    TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.profile_step --batch 1
    TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.profile_step --batch 8 --frozen
    python -m benchmarks.profile_step --batch 1 --eager    # the eager runner's step, aten op by op
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from ascend_graph.compile.inductor import InductorBackend, config_patches  # noqa: E402
from ascend_graph.compile.passes.inline_writes import INLINE_CACHE_WRITES
from ascend_graph.engine.block_manager import BlockManager  # noqa: E402
from ascend_graph.config import GraphConfig  # noqa: E402
from benchmarks.common import set_malloc_keeps_freed_memory  # noqa: E402
from benchmarks.models import build, cases, decode_batch, make_runner  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--frozen", action="store_true", help="with inductor_freezing_min_batch (CPU)")
    p.add_argument("--eager", action="store_true", help="profile the eager runner's step instead")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=20, help="table rows")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    set_malloc_keeps_freed_memory(True)
    case = cases(False)["v2_lite_slice"]
    n = args.batch
    config = GraphConfig(enabled=True, backend="inductor", capture_sizes=(n,), max_batch_size=n,
                         inductor_freezing_min_batch=n if args.frozen else None)
    backend = InductorBackend({**config_patches(config, "cpu"), "cpp.enable_kernel_profile": True},
                              inline_writes=INLINE_CACHE_WRITES["cpu"])
    runner = make_runner(build(case), config, (n,), case.context, backend=backend)
    mode = "eager" if args.eager else "graph"
    if not args.eager:
        runner.capture(show_progress=False)
    entries = decode_batch(runner, BlockManager(runner.num_blocks, runner.block_size), n, case.context)
    for _ in range(3):
        runner.execute(entries, mode=mode)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            runner.execute(entries, mode=mode)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:args.rows]
    print(f"V2-Lite slice {mode} step, batch {n}{', frozen' if args.frozen else ''}: self time per step")
    for e in rows:
        print(f"  {e.self_cpu_time_total / args.steps / 1e3:9.3f} ms  {e.count // args.steps:4d} calls  {e.key[:110]}")


if __name__ == "__main__":
    main()
