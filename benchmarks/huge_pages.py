"""An allocator lever: the weights on 2 MiB transparent huge pages instead of 4 KiB pages.

Two copies of the V2-Lite slice with the same weights: one as torch allocated them, one whose
weights (every parameter of 2 MiB or more) were copied into anonymous memory advised with
``MADV_HUGEPAGE`` (``ascend_graph.runtime.weights_on_huge_pages``, which the checkpoint loader
and the suite's other parts apply). Each gets its own runner; graph and eager steps of both are
timed interleaved in one process. PyTorch's own switch for this is the environment variable
``THP_MEM_ALLOC_ENABLE=1`` (CPU allocations of 2 MiB and more on huge pages), read once per
process, so it cannot be compared side by side in one run; the copy here can. Linux only: where
``madvise`` is missing, the part reports that and measures nothing.
"""

from __future__ import annotations

from ascend_graph.engine.block_manager import BlockManager
from ascend_graph.config import GraphConfig
from ascend_graph.runtime import anon_huge_page_bytes, huge_pages_supported, weights_on_huge_pages
from benchmarks.common import interleaved_medians
from benchmarks.models import build, cases, decode_batch, make_runner


def measure(batch: int = 1, rounds: int = 7, quick: bool = False) -> dict:
    """Graph and eager step time with 4 KiB-page and huge-page weights, timed interleaved."""
    if not huge_pages_supported():
        return {"skipped": "this platform has no madvise(MADV_HUGEPAGE)"}
    case = cases(quick)["v2_lite_slice"]
    config = GraphConfig(enabled=True, backend="inductor", capture_sizes=(batch,), max_batch_size=batch)
    fns, moved = {}, 0
    for pages in ("4 KiB", "2 MiB"):
        model = build(case, huge_pages=False)
        if pages == "2 MiB":
            moved = weights_on_huge_pages(model)
        runner = make_runner(model, config, (batch,), case.context)
        runner.capture(show_progress=False)
        entries = decode_batch(runner, BlockManager(runner.num_blocks, runner.block_size), batch, case.context)
        for mode in ("graph", "eager"):
            fns[f"{mode}, {pages} pages"] = (lambda r, e, m: lambda: r.execute(e, mode=m))(runner, entries, mode)
    t = interleaved_medians(fns, rounds=rounds, calls_per_round=1, warmup=2)
    print(f"  huge pages batch {batch}: " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()), flush=True)
    return {"model": case.name, "context": case.context, "batch": batch, "bytes_moved": moved,
            "anon_huge_bytes": anon_huge_page_bytes(), "ms": {k: v * 1e3 for k, v in t.items()}}
