"""One markdown table per part of the suite (``PARTS``), rendered from its JSON, and the plots.

Each renderer takes the suite's JSON and returns ``[title, *lines]`` (empty where the part did not
run); what the columns mean is written once in ``report_template.md``.
"""

from __future__ import annotations

import os

from benchmarks.targets import case_title
from benchmarks.compile_phases import PHASES
from benchmarks.startup import DEMO_VARIANTS


def fmt(v, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def table(head: list[str], rows: list[list]) -> list[str]:
    """A markdown table."""
    return ([f"| {' | '.join(head)} |", "|" + " --- |" * len(head)]
            + [f"| {' | '.join(str(c) for c in r)} |" for r in rows])


def _ms(s: float | None) -> str:
    return fmt(s and s * 1e3)


def bandwidth(out: dict) -> list[str]:
    bw, rb = out.get("copy_bandwidth"), out.get("read_bandwidth") or {}
    if not bw:
        return []
    return ["Bandwidth: one core"] + table(
        ["copy GB/s (read + written)", "copy size MiB", "read GB/s", "read / copy", "read stream"],
        [[fmt(bw["bytes_per_s"] / 1e9), bw["mib"], fmt(rb.get("read_bytes_per_s") and rb["read_bytes_per_s"] / 1e9),
          fmt(rb.get("read_over_copy")), rb.get("read_how", "—")]])


def _decode(d: dict | None, title: str) -> list[str]:
    if not d:
        return []
    rows = d["rows"]
    cols = [("eager ms", lambda r: _ms(r["eager_s"])), ("graph ms", lambda r: _ms(r["graph_s"])),
            ("graph / eager", lambda r: fmt(r["speedup"])), ("graph tok/s", lambda r: f"{r['batch'] / r['graph_s']:.0f}")]
    has = lambda k: any(k in r for r in rows)  # noqa: E731
    if has("transformers_s"):
        cols += [("transformers ms", lambda r: _ms(r.get("transformers_s"))),
                 ("graph / transformers", lambda r: fmt(r.get("graph_vs_transformers")))]
    if has("graph_frozen_s"):
        cols += [("graph, frozen ms", lambda r: _ms(r.get("graph_frozen_s"))),
                 ("frozen / transformers", lambda r: fmt(r.get("graph_frozen_s") and r.get("transformers_s")
                                                         and r["transformers_s"] / r["graph_frozen_s"]))]
    if has("graph_aot_s"):
        cols += [("graph, AOTInductor ms", lambda r: _ms(r.get("graph_aot_s"))),
                 ("AOTInductor / eager", lambda r: fmt(r.get("graph_aot_s") and r["eager_s"] / r["graph_aot_s"]))]
    for key, name in (("matmuls_s", "its matmuls alone ms"), ("matmuls_aten_s", "same, all in aten ms"),
                      ("matmuls_packed_s", "same, pre-packed ms")):
        if has(key):
            cols.append((name, lambda r, key=key: _ms(r.get(key))))
    if has("bytes"):
        cols += [("MB read", lambda r: f"{r['bytes']['total'] / 1e6:.0f}" if "bytes" in r else "—"),
                 ("copy GB/s", lambda r: fmt(r.get("copy_bytes_per_s") and r["copy_bytes_per_s"] / 1e9, 1)),
                 ("roofline share", lambda r: fmt(r["bytes"]["total"] / r["graph_s"] / r["copy_bytes_per_s"])
                  if "bytes" in r else "—")]
    lines = [f"Decode step: {title}, context {d['context']}"] + table(
        ["batch"] + [c[0] for c in cols], [[r["batch"]] + [c[1](r) for c in cols] for r in rows])
    settings = [f"one-row products: {d['one_row_products']}"] if "one_row_products" in d else []
    if d.get("frozen"):
        settings.append(f"graph, frozen: `inductor_freezing_min_batch={d['frozen']['inductor_freezing_min_batch']}`")
    if has("rows_mm_max_rows"):
        settings.append(f"`rows_mm` up to {max(r.get('rows_mm_max_rows', 0) for r in rows)} rows")
    if has("matmuls_batched_in_kernel"):
        settings.append("attention products of the matmuls alone in the kernel: "
                        + ("yes" if any(r.get("matmuls_batched_in_kernel") for r in rows) else "no"))
    settings.append(f"rounds: {d['rounds']}, calls per round: {d['calls_per_round']}")
    return lines + ["", "; ".join(settings) + "."]


def decode_small(out: dict) -> list[str]:
    return _decode(out.get("decode_small"), "built-in small model (float32)")


def decode_v2(out: dict) -> list[str]:
    return _decode(out.get("decode_v2"), "DeepSeek-V2-Lite slice (2 layers, bfloat16, vocabulary 102400)")


def overhead(out: dict) -> list[str]:
    ov = out.get("overhead")
    if not ov:
        return []
    us = lambda k: fmt(ov.get(k), 0)  # noqa: E731
    lines = [f"Step overhead: small model, batch {ov['batch']}, µs per step"] + table(
        ["execute", "compiled call", "dynamo guards", "compiled call, write as the op", "write_slots op (all layers)",
         "layers", "execute, AOTInductor package"],
        [[us("execute_us"), us("compiled_call_us"), us("guard_us"), us("compiled_call_op_write_us"),
          us("write_slots_us"), ov["layers"], us("aot_execute_us")]])
    if ov.get("host_metadata"):
        lines += ["", "Host preparation: `build_attention_metadata` for a decode batch, µs", ""] + table(
            ["batch", "context", "block ids", "int32 arrays (`BlockManager`)", "Python lists"],
            [[r["batch"], r["context"], r["block_ids"], fmt(r["arrays_us"], 0), fmt(r["lists_us"], 0)]
             for r in ov["host_metadata"]])
    return lines


def compute(out: dict) -> list[str]:
    cp = out.get("compute")
    if not cp:
        return []
    g = lambda r, k: fmt(r.get(k) and r[k] / 1e9, 0)  # noqa: E731
    lines = [f"Compute: V2-Lite slice step FLOPs (context {cp['context']}) and bf16 matmul rates, GFLOP/s"] + table(
        ["batch", "step GFLOP", "aten", "pre-packed oneDNN", "`rows_mm`", "copy GB/s"],
        [[r["batch"], fmt(r["step_flops"] / 1e9, 1), g(r, "bf16_matmul_flops_per_s"),
          g(r, "bf16_packed_matmul_flops_per_s"), g(r, "bf16_kernel_matmul_flops_per_s"),
          fmt(r["copy_bytes_per_s"] / 1e9, 1)] for r in cp["rows"]])
    peak = cp.get("core_peak") or {}
    if peak:
        lines += ["", "One core's peak, GFLOP/s (`benchmarks/peak.py`)", ""] + table(
            ["bf16 dot product", "float32 FMA"], [[g(peak, "bf16_dot_flops_per_s"), g(peak, "fp32_fma_flops_per_s")]])
    if cp.get("few_rows"):
        lines += ["", "Few-row streams over plain row-major bf16 weights, GB/s", ""] + table(
            ["rows", "aten", "kernel"], [[r["rows"], fmt(r["aten_bytes_per_s"] / 1e9, 1),
                                         fmt(r["kernel_bytes_per_s"] / 1e9, 1)] for r in cp["few_rows"]])
    return lines


def moe_forms(out: dict) -> list[str]:
    m = out.get("moe_forms")
    if not m:
        return []
    names = [k for k in m["rows"][0] if isinstance(m["rows"][0][k], dict)]
    body = []
    for r in m["rows"]:
        copy = r.get("copy_bytes_per_s")
        share = fmt(copy and r["compiled decode (now)"]["GB_per_s"] * 1e9 / copy) if "compiled decode (now)" in r else "—"
        body.append([r["tokens"], r["experts_used"], fmt(copy and copy / 1e9, 1), share]
                    + [f"{r[n]['ms']:.1f} ({r[n]['GB_per_s']:.1f})" if n in r else "—" for n in names])
    return ["One V2-Lite MoE layer's routed experts (bfloat16): ms (GB/s of distinct experts)"] + table(
        ["tokens", "experts used", "copy GB/s", "share of copy bandwidth (now)"] + names, body)


def levers(out: dict) -> list[str]:
    lv = out.get("levers")
    if not lv:
        return []
    names = list(dict.fromkeys(k for r in lv["rows"] for k, v in r.items() if k != "batch" and isinstance(v, float)))
    lines = [f"Inductor levers on the {lv['model']} step (context {lv['context']}), ms per step"] + table(
        ["batch"] + names, [[r["batch"]] + [fmt(r.get(n), 1) for n in names] for r in lv["rows"]])
    return lines + (["", f"one-row products: {lv['one_row_products']}."] if "one_row_products" in lv else [])


def huge_pages(out: dict) -> list[str]:
    h = out.get("huge_pages")
    if not h or "ms" not in h:
        return [] if not h else ["Weights on 2 MiB pages", f"skipped: {h['skipped']}."]
    ms = h["ms"]
    body = [[f"{p} pages", fmt(ms[f"graph, {p} pages"], 1), fmt(ms[f"eager, {p} pages"], 1),
             fmt(ms[f"eager, {p} pages"] / ms[f"graph, {p} pages"])] for p in ("4 KiB", "2 MiB")]
    body.append(["4 KiB / 2 MiB"] + [fmt(ms[f"{m}, 4 KiB pages"] / ms[f"{m}, 2 MiB pages"]) for m in ("graph", "eager")]
                + [""])
    return [f"Weights on 2 MiB pages: {h['model']}, batch {h['batch']}, context {h['context']}, ms per step"] + table(
        ["weights on", "graph ms", "eager ms", "eager / graph"], body) + [
        "", f"{h['bytes_moved'] / 2**20:.0f} MiB of weights copied onto advised memory; "
            f"{h['anon_huge_bytes'] / 2**20:.0f} MiB of the process on huge pages at the end."]


def attention(out: dict) -> list[str]:
    a = out.get("attention")
    if not a:
        return []
    d = a["conditions"]["dims"]
    lines = [f"Decode attention alone: batch {d['batch']}, context {d['context']}, V2-Lite MLA dims, {d['dtype']}; "
             f"copy bandwidth in the same rounds {a['copy_bytes_per_s'] / 1e9:.1f} GB/s"] + table(
        ["step", "mode", "num_blocks", "ms", "GB/s", "share of copy bandwidth"],
        [[r["step"], r["mode"], r["num_blocks"], fmt(r["median_ms"]), fmt(r["bytes_per_s"] / 1e9),
          fmt(r["share_of_copy_bandwidth"])] for r in a["rows"]])
    lines += ["", "Capacity ratio t(N=32768) / t(N=256)", ""] + table(
        ["step / mode", "ratio"], [[k, fmt(v)] for k, v in a["capacity_ratio"].items()])
    op = a.get("op_alone")
    if op:
        lines += ["", f"`decode_attention` alone: batch {d['batch']}, context {d['context']}, each row's live "
                      "latent and rope rows", ""] + table(
            ["dtype", "ms", "live cache MB", "GB/s", "copy GB/s", "share of copy bandwidth"],
            [[dt, fmt(r["ms"]), f"{r['live_cache_bytes'] / 1e6:.0f}", fmt(r["bytes_per_s"] / 1e9),
              fmt(r["copy_bytes_per_s"] / 1e9, 1), fmt(r["share_of_copy_bandwidth"])] for dt, r in op.items()])
    vs = a.get("op_against_before")
    if vs:
        lines += ["", "The same op against the products before it (`paged_rows_mm`, softmax, `paged_rows_bmm` over "
                      "every slot of the block table), bfloat16, ms", ""] + table(
            ["block table for max_model_len", "after", "before", "after / before (median of rounds)", "quartiles"],
            [[r["max_model_len"], fmt(r["ms"]), fmt(r["before_ms"]), fmt(r["after_over_before"]),
              "–".join(fmt(q) for q in r["quartiles"])] for r in vs.values()])
    one = a.get("batch_1")
    if one:
        live = one["context"] * (d["kv_lora_rank"] + d["rope"]) * (4 if d["dtype"] == "float32" else 2)
        lines += ["", "Batch 1, compiled, ms", ""] + table(
            ["context", "num_blocks", "in place", "over a gathered copy", "same output", "live cache GB/s, in place"],
            [[one["context"], one["num_blocks"], fmt(one["in_place_ms"]), fmt(one["gathered_ms"]),
              "yes" if one["same_output"] else "no (within rounding)", fmt(live / one["in_place_ms"] / 1e6)]])
    g = a.get("gqa")
    if g:
        forms = [("paged_decode", ""), ("gathered rows, heads first", "gathered_"), ("former form", "former_")]
        lines += ["", f"Standard attention: batch {g['batch']}, context {g['context']}, {g['heads']} query and "
                      f"{g['kv_heads']} kv heads of {g['head_dim']}, {g['dtype']}, ms", ""] + table(
            ["form", "eager", "compiled", "largest error, eager", "largest error, compiled"],
            [[name, fmt(g.get(f"{p}eager_ms"), 1), fmt(g.get(f"{p}compiled_ms"), 1),
              f"{g['max_abs_error'][f'{p}eager']:.2g}", f"{g['max_abs_error'][f'{p}compiled']:.2g}"]
             for name, p in forms if f"{p}eager_ms" in g])
    return lines


def live_context(out: dict) -> list[str]:
    lc = out.get("live_context")
    if not lc:
        return []
    widths, contexts = lc["widths"], lc["contexts"]
    ms = lambda t, k: _ms(t.get(str(k)))  # noqa: E731
    wide = [[case_title(name), r["batch"]] + [ms(r["step_s"], w) for w in widths]
            + [fmt(r["ratio"][str(w)]) for w in widths[1:]] for name, c in lc["cases"].items() for r in c["width"]]
    lines = [f"Decode step against max_model_len (live context {lc['context']}) and against live context, "
             "graph step (`execute`), ms"] + table(
        ["case", "batch"] + [f"max_model_len {w}" for w in widths] + [f"{w} / {widths[0]}" for w in widths[1:]], wide)
    body = []
    for name, c in lc["cases"].items():
        x, f = c["context"], c["context"]["fit"]
        body.append([case_title(name), x["batch"], x["max_model_len"]] + [ms(x["step_s"], k) for k in contexts]
                    + [fmt(f["slope"] * 1e9 / x["batch"], 1), fmt(f["intercept"] * 1e3), fmt(f["r2"], 3),
                       fmt(f["rms_residual"] * 1e3, 3), fmt(f["max_relative_residual"]),
                       fmt(f.get("context_bytes_per_s") and f["context_bytes_per_s"] / 1e9),
                       fmt(f["copy_bytes_per_s"] / 1e9, 1)])
    lines += ["", "Live context sweep: step ms at each live context, and the least-squares line through them", ""]
    lines += table(["case", "batch", "max_model_len"] + [f"{k}" for k in contexts]
                   + ["slope ns per token per row", "intercept ms", "r2", "rms residual ms", "largest residual / line",
                      "added context read GB/s", "copy GB/s"], body)
    return lines + ["", f"block size {lc['block_size']}; rounds: {lc['rounds']}."]


def startup(out: dict) -> list[str]:
    s = out.get("startup")
    if not s:
        return []
    body = []
    for k in ("cold", "warm", "portable_artifacts", "aot_cold", "aot_warm"):
        if k in s:
            v = s[k]
            body.append([k, fmt(v["capture_s"], 1), fmt(v.get("load_artifacts_s"), 1), fmt(v["total_s"], 1),
                         v["compiles"], v.get("cpp_compiler_runs", "—"), fmt(v.get("cpp_compiler_s"), 1),
                         v.get("packages_loaded", "—")])
    return [f"Start-up: capture sizes {s['sizes']} of the {s['model']} model, fresh process each"] + table(
        ["variant", "capture s", "loading artifacts s", "total process s", "compiles", "C++ compiler runs",
         "C++ compiler s", "packages loaded"], body) + [
        line for key, how in DEMO_VARIANTS
        for line in startup_demo(s.get(key), how and f" with `{how.split()[-1]}` (`inductor.precompile`)")]


def startup_demo(d: dict | None, variant: str = "") -> list[str]:
    """The demo's capture cold and warm, per size and in total, and where it went by phase;
    ``variant`` says how the demo ran where not by default."""
    if not d:
        return []
    sizes = d["sizes"]
    rows = []
    for start in ("cold", "warm"):
        total = d[f"{start}_capture_s"]
        rows.append([start, *(fmt(d[f"{start}_per_size_s"][str(n)]["median"], 1) for n in sizes),
                     f"{fmt(total['median'], 1)} ({fmt(total['min'], 1)}-{fmt(total['max'], 1)})",
                     fmt(d[f"{start}_capture_cpu_s"]["median"], 1), fmt(d["goals"][f"{start}_capture_s"], 0)])
    lines = ["", f"The demo's capture (`ascend-graph demo`{variant}, sizes {sizes}), medians of {d['repeats']} fresh-process "
             "pairs: cold into an empty compile cache directory, then warm from it", ""] + table(
        ["start", *(f"size {n} s" for n in sizes), "total s (min-max)", "total CPU s", "goal s"], rows)
    phases = [[p, fmt(d["cold_phases"].get(p, {}).get("wall_s"), 1), fmt(d["cold_phases"].get(p, {}).get("cpu_s"), 1),
               fmt(d["warm_phases"].get(p, {}).get("wall_s"), 1), fmt(d["warm_phases"].get(p, {}).get("cpu_s"), 1),
               what] for p, what in PHASES.items() if p in d["cold_phases"] or p in d["warm_phases"]]
    if variant:
        return lines
    return lines + ["", "Where the demo's capture went, by phase (own seconds, without the phases each calls; CPU: "
                    "the process and the C++ compiler)", ""] + table(
        ["phase", "cold s", "cold CPU s", "warm s", "warm CPU s", "what"], phases)


def memory(out: dict) -> list[str]:
    m = out.get("memory")
    if not m:
        return []
    eager = m["eager"]["peak_rss_bytes"]
    body = [[v["mode"], f"{v['peak_rss_bytes'] / 2**20:.0f}", fmt(v["peak_rss_bytes"] / eager),
             f"{v['rss_after_build_bytes'] / 2**20:.0f}", v["cache_addresses_unchanged"]]
            for v in (m["graph"], m.get("graph_frozen"), m.get("graph_aot"), m["eager"]) if v is not None]
    lines = [f"Memory: {m['model']}, batch sizes {m['sizes']}, {m['steps_per_size']} steps each"] + table(
        ["mode", "peak RSS MiB", "peak RSS / eager", "RSS after building the model MiB", "cache addresses unchanged"],
        body)
    return lines + ["", "Bytes allocated during one decode step (small model, batch 8), by cache capacity", ""] + table(
        ["mode", "num_blocks", "allocated KiB"],
        [[r["mode"], r["num_blocks"], f"{r['allocated_bytes'] / 1024:.1f}"] for r in m["step_allocations"]])


def pd(out: dict) -> list[str]:
    """The ``pd`` part: KV transfer between two processes against a local copy, then serving with
    prefill and decode apart against one process (``benchmarks/pd_rows.py``)."""
    from benchmarks.pd_rows import serving_rows, transfer_rows

    d = out.get("pd")
    if not d:
        return []
    return (["Prefill/decode in two processes (127.0.0.1)",
             "KV transfer into the decode side's static caches against a local copy of the same bytes; *merged "
             "runs*: blocks contiguous on both sides travel as one descriptor per cache tensor", ""]
            + transfer_rows(d["transfer"])
            + ["", f"Serving the same requests with prefill and decode apart against one process, taking turns, "
                   f"{d['serving']['rounds']} rounds, graph mode on both decode sides, tokens checked equal; TTFT: "
                   "admission to first token (with PD: the prefill process's step, the control message, the "
                   "transfer)", ""] + serving_rows(d["serving"]))


PARTS = (("bandwidth", bandwidth), ("decode_small", decode_small), ("overhead", overhead), ("decode_v2", decode_v2),
         ("compute", compute), ("moe_forms", moe_forms), ("levers", levers), ("huge_pages", huge_pages),
         ("attention", attention), ("live_context", live_context), ("startup", startup), ("memory", memory),
         ("pd", pd))


def plots(out: dict, results_dir: str) -> list[str]:
    """Step time and tokens/s against batch size (graph, eager, transformers); PNG paths written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    for key in ("decode_small", "decode_v2"):
        d = out.get(key)
        if not d:
            continue
        fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(10, 4))
        for variant in ("graph", "graph_frozen", "eager", "transformers"):
            pts = [(r["batch"], r[f"{variant}_s"]) for r in d["rows"] if f"{variant}_s" in r]
            if pts:
                b, t = zip(*pts)
                ax_t.plot(b, [x * 1e3 for x in t], marker="o", label=variant)
                ax_s.plot(b, [n / x for n, x in zip(b, t)], marker="o", label=variant)
        for ax, label in ((ax_t, "step time (ms)"), (ax_s, "tokens/s")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set(xlabel="batch size", ylabel=label)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"decode step, {d['model']} ({d['dtype']}, context {d['context']})")
        fig.tight_layout()
        path = os.path.join(results_dir, f"{key}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
