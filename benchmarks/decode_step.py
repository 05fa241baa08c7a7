"""Decode-step time, graph vs eager vs transformers, per capture size, side by side in one run.

Both modes run through the same runner on the same caches (``execute(mode="graph"|"eager")``),
interleaved, after the graphs were captured. Host preparation (metadata, padding, copies into
the static buffers) is part of each step, as in serving. transformers is
``DeepseekV2ForCausalLM`` of the same configuration (``models.HFDecoder``).

``compare`` is what the suite's ``decode_small`` and ``decode_v2`` parts run, ``overhead`` its
``overhead`` part (where the small model's graph step spends its time); the command line runs
``measure`` alone (the CUDA checks, ``.ci/cuda_check``, use it with ``--device cuda``).

    TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.decode_step --model small --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ascend_graph.engine.block_manager import BlockManager  # noqa: E402
from ascend_graph.config import GraphConfig, InductorOptions  # noqa: E402
from benchmarks.common import conditions, interleaved_medians, interleaved_samples, ratio_of_rounds, write_json  # noqa: E402
from benchmarks.models import HFDecoder, ModelCase, build, cases, decode_batch, make_runner  # noqa: E402
from benchmarks.roofline import CopyProbe, ReadProbe, step_bytes  # noqa: E402


# What a user would run instead of this project (``extra`` variants compared with the graph step,
# ``graph_vs_<name>``); the other extras are timed beside it for the report and its bounds.
ALTERNATIVES = ("transformers",)


class RunnerVariant:
    """Another graph runner over the same model with other ``GraphConfig`` fields (its own
    caches), captured up front: a variant timed beside the default one."""

    def __init__(self, model: torch.nn.Module, case: ModelCase, sizes: tuple[int, ...], **config_fields) -> None:
        config = GraphConfig(enabled=True, backend="inductor", capture_sizes=sizes, max_batch_size=max(sizes),
                             **config_fields)
        self.runner, self.context = make_runner(model, config, sizes, case.context), case.context
        self.runner.capture(show_progress=False)
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_size)

    def step_fn(self, n: int):
        """A function running one graph decode step of ``n`` prefilled sequences."""
        entries = decode_batch(self.runner, self.blocks, n, self.context)
        return lambda: self.runner.execute(entries, mode="graph")


def _one_row_products(device: torch.device, backend: str) -> dict:
    """How the CPU graph step ran its one-row bf16 products (``DecodeMatmulPass.one_row_kernel``)."""
    if device.type != "cpu" or backend != "inductor":
        return {}
    from ascend_graph.compile.inductor import DecodeMatmulPass

    return {"one_row_products": "kernel" if DecodeMatmulPass().one_row_kernel else "reductions"}


def synchronized(fn, device: torch.device):
    """``fn`` followed by waiting for ``device``: a step's time on a GPU, not its launch's."""
    if device.type != "cuda":
        return fn
    return lambda: (fn(), torch.cuda.synchronize(device))


def measure(case: ModelCase, sizes: tuple[int, ...], rounds: int, calls: int, backend: str = "inductor",
            model: torch.nn.Module | None = None, extra: dict | None = None, roofline: bool = False,
            device: str = "cpu") -> dict:
    """Graph and eager step time of ``case`` at every batch size in ``sizes``.

    ``extra`` maps a name to ``f(batch) -> callable or None`` for more variants timed in the
    same rounds (the transformers baseline uses it). With ``roofline`` each row also gets the
    bytes the step must read (``benchmarks.roofline.step_bytes``).
    ``device``: where a model built here runs (a CUDA device: each step is timed to its end).
    """
    model = build(case, device=device) if model is None else model
    dev = next(model.parameters()).device
    config = GraphConfig(enabled=True, backend=backend, capture_sizes=sizes, max_batch_size=max(sizes))
    runner = make_runner(model, config, sizes, case.context)
    runner.capture(show_progress=False)
    blocks, rows = BlockManager(runner.num_blocks, runner.block_size), []
    for n in sizes:
        entries = decode_batch(runner, blocks, n, case.context)
        fns = {"eager": lambda: runner.execute(entries, mode="eager"),
               "graph": lambda: runner.execute(entries, mode="graph")}
        fns.update({name: fn for name, make in (extra or {}).items() if (fn := make(n)) is not None})
        fns = {name: synchronized(fn, dev) for name, fn in fns.items()}
        samples = interleaved_samples(fns, rounds=rounds, calls_per_round=calls, warmup=2)
        t = {k: statistics.median(v) for k, v in samples.items()}
        row = {"batch": n, **{f"{k}_s": v for k, v in t.items()}, "speedup": t["eager"] / t["graph"]}
        row.update({f"graph_vs_{k}": t[k] / t["graph"] for k in ALTERNATIVES if k in t})
        # how many times faster graph ran than eager and the alternatives, from the same rounds
        row["rounds"] = {k: ratio_of_rounds(samples, k, "graph") for k in ("eager", *ALTERNATIVES) if k in samples}
        if roofline:
            row["bytes"] = step_bytes(runner.model, n, case.context, lambda: runner.execute(entries, mode="eager"))
        rows.append(row)
        print(f"  {case.name} batch {n:>3}: " + "  ".join(f"{k} {v * 1e3:8.2f} ms" for k, v in t.items())
              + f"  graph/eager {row['speedup']:.2f}x", flush=True)
    return {"model": case.name, "dtype": case.dtype_name, "context": case.context, "backend": backend,
            "device": str(dev),
            "capture": runner.stats.to_dict()["capture"], "rows": rows, "rounds": rounds,
            "calls_per_round": calls, **_one_row_products(dev, backend)}


def compare(case_name: str, sizes, hf_sizes, rounds: tuple[int, int], quick: bool, frozen_sizes=(),
           aot_sizes=()) -> dict:
    """The suite's decode part: graph vs eager vs transformers for one model case, and for the
    V2-Lite slice the copy and read probes in the same rounds (the step's bytes over its time);
    ``frozen_sizes`` also get a graph compiled with Inductor's freezing (``inductor.freezing_min_batch``),
    and ``aot_sizes`` one from AOTInductor packages (``inductor.aot``), each its own runner over the
    same weights, timed in the same rounds."""
    case = cases(quick)[case_name]
    model = build(case)
    hf = HFDecoder(case.config, case.dtype, case.context)
    extra = {"transformers": lambda n: hf.step_fn(n) if n in hf_sizes else None}
    frozen = None
    if frozen_sizes:
        frozen = RunnerVariant(model, case, tuple(frozen_sizes),
                               inductor=InductorOptions(freezing_min_batch=min(frozen_sizes)))
        extra["graph_frozen"] = lambda n: frozen.step_fn(n) if n in frozen_sizes else None
    packages = tempfile.TemporaryDirectory(prefix="ag-decode-aoti-") if aot_sizes else None
    if packages is not None:
        aot = RunnerVariant(model, case, tuple(aot_sizes), inductor=InductorOptions(aot=True),
                            compile_cache_dir=packages.name)
        extra["graph_aot"] = lambda n: aot.step_fn(n) if n in aot_sizes else None
    probe = read = None
    if case_name != "small":  # copy bandwidth timed in the same rounds as the steps it bounds
        probe = CopyProbe()
        extra["copy"] = lambda n: probe
        read = ReadProbe()  # and one core's read ceiling, which bounds the batch-1 step
        extra["read"] = lambda n: read if n == 1 else None
    res = measure(case, sizes, rounds[0], rounds[1], model=model, extra=extra, roofline=probe is not None)
    if frozen is not None:
        res["frozen"] = {"inductor_freezing_min_batch": min(frozen_sizes),
                         "capture": frozen.runner.stats.to_dict()["capture"]}
    if packages is not None:
        packages.cleanup()
    for row in res["rows"]:
        if probe is not None:
            row["copy_bytes_per_s"] = probe.bytes / row.pop("copy_s")
        if "read_s" in row:
            row["read_bytes_per_s"], row["read_how"] = read.bytes / row.pop("read_s"), read.how
    return res


def overhead(batch: int = 8, calls: int = 50) -> dict:
    """Microseconds per step of the small model's graph step (``execute``), its bare compiled call
    (``execute`` minus it is host preparation), dynamo's guard check in that call (profiled), and
    the same step from an AOTInductor package (no guards), timed in the same rounds."""
    from torch.profiler import ProfilerActivity, profile

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
        aot = RunnerVariant(runner.model, case, (batch,), inductor=InductorOptions(aot=True),
                            compile_cache_dir=packages)
        t = interleaved_medians({"execute": lambda: runner.execute(entries, mode="graph"), "compiled call": call,
                                 "aot": aot.step_fn(batch)}, rounds=10, calls_per_round=20)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
    guard = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == "TorchDynamo Cache Lookup") / calls
    res = {"batch": batch, "execute_us": t["execute"] * 1e6, "compiled_call_us": t["compiled call"] * 1e6,
           "guard_us": guard, "layers": case.config.num_hidden_layers, "aot_execute_us": t["aot"] * 1e6}
    print(f"  overhead batch {batch}: execute {res['execute_us']:.0f} us, compiled call {res['compiled_call_us']:.0f} us "
          f"(guards {guard:.0f} us); from an AOTInductor package {res['aot_execute_us']:.0f} us", flush=True)
    return res


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(cases(True)), default="small")
    p.add_argument("--sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu, or a CUDA device (graph = Inductor with CUDA graphs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    result = {"benchmark": "decode_step", "conditions": conditions(args.device),
              **measure(cases(False)[args.model], sizes, args.rounds, args.calls, args.backend, device=args.device)}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
