"""Plots and the markdown performance section, rendered from the suite's JSON (targets from
``benchmarks.targets``).

    python -m benchmarks.report [benchmarks/results/suite.json]   # re-render PERFORMANCE.md + PNGs
    python -m benchmarks.report --cuda      # the README's CUDA table from benchmarks/results/cuda/
"""

from __future__ import annotations

import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.targets import targets  # noqa: E402


def _fmt(v, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _merged(out: dict) -> str:
    """Where parts come from different runs (``--merge``), which run each is from."""
    started = out.get("part_run") or {}
    runs: dict[str, list[str]] = {}
    for part in out.get("part_seconds", {}):
        runs.setdefault(started.get(part, "an earlier run"), []).append(part)
    if len(runs) < 2:
        return ""
    return " Parts come from different runs (`--merge`): " + "; ".join(
        f"{', '.join(parts)} from the run started {when}" for when, parts in sorted(runs.items())) + "."


def _flags(c: dict) -> str:
    """The CPU's vector features that pick the code paths (``runtime.machine``; older results lack them)."""
    return f" with {', '.join(c['cpu_flags'])}" if c.get("cpu_flags") else ""


def markdown(out: dict) -> str:
    """The README's performance section."""
    c = out["conditions"]
    lines = ["## Performance", "",
             f"Measured with `{out.get('command', 'python -m benchmarks')}` on {c['cpu']}{_flags(c)} ({c['cores']} cores, "
             f"torch threads: {c['torch_threads']}), torch {c['torch']}, Python {c['python']}, {c['when']}. "
             "The machine was shared with other jobs: every comparison is timed interleaved (round robin), "
             "medians; read ratios, not absolute times. CPU only (Inductor, C++ wrapper)." + _merged(out), ""]
    bw = out.get("copy_bandwidth")
    if bw:
        lines += [f"Copy bandwidth (a {bw['mib']} MiB `copy_` into allocated memory, bytes read + written): "
                  f"**{bw['bytes_per_s'] / 1e9:.2f} GB/s**."]
        rb = out.get("read_bandwidth")
        if rb:
            lines += [f"Read-only bandwidth ({rb.get('read_how', 'a 256 MiB float32 `sum`')}, timed interleaved "
                      "with a copy): "
                      f"{rb['read_bytes_per_s'] / 1e9:.2f} GB/s, {rb['read_over_copy']:.2f} of the copy's."]
        lines += [""]
    lines += ["### Targets", "", "| target | goal | measured | met | bound |", "| --- | --- | --- | --- | --- |"]
    for t in out.get("targets", targets(out)):
        goal = ("≤ " if t["at_most"] else "≥ ") + f"{t['goal']}"
        met = {True: "yes", False: "**no**", None: "not run"}[t["met"]]
        digits = 3 if t["value"] is not None and _fmt(t["value"]) == _fmt(t["goal"]) else 2  # 0.4997: not 0.50
        lines.append(f"| {t['target']} | {goal} | {_fmt(t['value'], digits)} | {met} | {t.get('bound', '')} |")
    for key, title in (("decode_small", "built-in small model (float32)"),
                       ("decode_v2", "DeepSeek-V2-Lite slice (2 layers, bfloat16, vocabulary 102400)")):
        lines += _decode_table(out.get(key), title, bw)
    lines += _host_table(out.get("overhead"))
    lines += _moe_table(out.get("moe_forms"))
    lines += _levers_table(out.get("levers"))
    lines += _huge_pages_table(out.get("huge_pages"))
    lines += _attention_table(out.get("attention"), bw)
    lines += _startup_table(out.get("startup"))
    lines += _portable_note(out.get("startup"))
    lines += _memory_table(out.get("memory"))
    if out.get("notes"):
        lines += ["### Notes", ""] + [f"- {n}" for n in out["notes"]] + [""]
    return "\n".join(lines) + "\n"


def _decode_table(d: dict | None, title: str, bw: dict | None) -> list[str]:
    if not d:
        return []
    has_hf = any("transformers_s" in r for r in d["rows"])
    has_bytes = any("bytes" in r for r in d["rows"])
    head = "| batch | eager ms | graph ms | graph/eager | graph tok/s |"
    sep = "| --- | --- | --- | --- | --- |"
    if has_hf:
        head += " transformers ms | graph/transformers |"
        sep += " --- | --- |"
    has_frozen = any("graph_frozen_s" in r for r in d["rows"])
    if has_frozen:
        head += " graph, frozen ms | frozen/transformers |"
        sep += " --- | --- |"
    has_aot = any("graph_aot_s" in r for r in d["rows"])
    if has_aot:
        head += " graph, AOTInductor ms | AOTInductor/eager |"
        sep += " --- | --- |"
    has_floor = any("matmuls_s" in r for r in d["rows"])
    has_packed = any("matmuls_packed_s" in r for r in d["rows"])
    has_aten = any("matmuls_aten_s" in r for r in d["rows"])
    floor_keys = ("matmuls_s",) + (("matmuls_aten_s",) if has_aten else ()) + (("matmuls_packed_s",) if has_packed else ())
    if has_floor:
        head += (" its matmuls alone ms |" + (" same, all in aten ms |" if has_aten else "")
                 + (" same, pre-packed ms |" if has_packed else ""))
        sep += " --- |" * len(floor_keys)
    if has_bytes:
        head += " MB read | copy GB/s | roofline share |"
        sep += " --- | --- | --- |"
    lines = ["", f"### Decode step: {title}, context {d['context']}", "", head, sep]
    for r in d["rows"]:
        line = (f"| {r['batch']} | {r['eager_s'] * 1e3:.2f} | {r['graph_s'] * 1e3:.2f} | {r['speedup']:.2f} | "
                f"{r['batch'] / r['graph_s']:.0f} |")
        if has_hf:
            hf = r.get("transformers_s")
            line += f" {_fmt(hf and hf * 1e3)} | {_fmt(r.get('graph_vs_transformers'))} |"
        if has_frozen:
            fz = r.get("graph_frozen_s")
            hf = r.get("transformers_s")
            line += f" {_fmt(fz and fz * 1e3)} | {_fmt(fz and hf and hf / fz)} |"
        if has_aot:
            aot = r.get("graph_aot_s")
            line += f" {_fmt(aot and aot * 1e3)} | {_fmt(aot and r['eager_s'] / aot)} |"
        if has_floor:
            for key in floor_keys:
                line += f" {_fmt(r.get(key) and r[key] * 1e3)} |"
        if has_bytes:
            share = r["bytes"]["total"] / r["graph_s"] / r["copy_bytes_per_s"]
            line += f" {r['bytes']['total'] / 1e6:.0f} | {r['copy_bytes_per_s'] / 1e9:.1f} | {_fmt(share)} |"
        lines.append(line)
    if d.get("frozen"):
        lines += ["", f"\"graph, frozen\": a second runner over the same weights with "
                  f"`inductor_freezing_min_batch={d['frozen']['inductor_freezing_min_batch']}` (opt-in), timed in "
                  "the same rounds; its memory cost is in the memory table."]
    if has_floor:
        attention = ("; MLA decode's attention products in the kernel's batched forms (`expert_rows_mm`, "
                     "`rows_bmm`), over the gathered copy of the cache rows that the eager step made, where the "
                     "compiled step reads them in place" if any(r.get("matmuls_batched_in_kernel") for r in d["rows"])
                     else "")
        how = ("as the compiled step runs them: `rows_mm` (the project's kernel) from 2 to "
               f"{max(r.get('rows_mm_max_rows', 0) for r in d['rows'])} rows{attention}, aten beyond; \"same, all in "
               "aten\": every one as aten runs it, as before `rows_mm`" if has_aten else
               "as aten runs them; from 2 rows on the graph step calls the same aten kernels for them")
        lines += ["", "\"its matmuls alone\": the step's matmuls except the routed experts' (attention, dense MLP, "
                  "shared experts, router, LM head), recorded from an eager step and replayed alone, timed in the same "
                  f"rounds (`benchmarks/compute.py`, `StepMatmuls`), {how}. At 1 row the graph step replaces them "
                  + ("with `rows_mm` calls (the bfloat16 linears over row-major weights) and generated reductions "
                     "(the rest)." if d.get("one_row_products") == "kernel" else "with generated reductions.")
                  + (" \"Same, pre-packed\": the replay with each linear's weight pre-packed for oneDNN, as the "
                     "frozen runner multiplies them." if has_packed else "")]
    if has_aot:
        lines += ["", "\"graph, AOTInductor\": a second runner over the same weights with `aot_inductor=True` "
                  "(opt-in), its packages compiled into a temporary directory, timed in the same rounds."]
    return lines + [""]


def _host_table(ov: dict | None) -> list[str]:
    rows = (ov or {}).get("host_metadata")
    if not rows:
        return []
    lines = ["", "### Host preparation that grows with context: `build_attention_metadata` for a decode batch, us",
             "", "| batch | context | block ids | tables as `BlockManager` keeps them (int32 arrays) "
             "| as Python lists |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['context']} | {r['block_ids']} | {r['arrays_us']:.0f} | {r['lists_us']:.0f} |"
              for r in rows]
    return lines + ["", "Arrays are copied with one memcpy per table and every id is range-checked with one tensor "
                    "reduction; lists are converted id by id.", ""]


def _moe_table(m: dict | None) -> list[str]:
    if not m:
        return []
    names = [k for k in m["rows"][0] if isinstance(m["rows"][0][k], dict)]
    lines = ["", "### One V2-Lite MoE layer's routed experts (bfloat16): before / now, ms (GB/s of distinct experts)",
             "", "| tokens | experts used | " + " | ".join(names) + " |", "| --- | --- | " + "--- | " * len(names)]
    for r in m["rows"]:
        cells = " | ".join(f"{r[n]['ms']:.1f} ({r[n]['GB_per_s']:.1f})" for n in names)
        lines.append(f"| {r['tokens']} | {r['experts_used']} | {cells} |")
    return lines + [""]


def _levers_table(lv: dict | None) -> list[str]:
    if not lv:
        return []
    names = [k for k, v in lv["rows"][0].items() if k != "batch" and isinstance(v, (int, float))]
    lines = ["", f"### Inductor levers on the {lv['model']} step (context {lv['context']}), ms per step", "",
             "| batch | " + " | ".join(names) + " |", "| --- | " + "--- | " * len(names)]
    for r in lv["rows"]:
        lines.append(f"| {r['batch']} | " + " | ".join(f"{r[n]:.1f}" for n in names) + " |")
    one_row = ("one-row bf16 matmuls over row-major weights and bf16 matmuls of 2-64 rows as `ascend_graph::rows_mm`, "
               "other one-row matmuls as reductions" if lv.get("one_row_products") == "kernel" else
               "one-row matmuls as reductions, bf16 matmuls of 2-64 rows as `ascend_graph::rows_mm`")
    return lines + ["", f"Default on CPU: C++ wrapper, the decode-matmul pass ({one_row}, "
                    "MLA decode's batched attention products "
                    "as `paged_rows_mm` and `paged_rows_bmm`, over the cache blocks where they lie) and the "
                    "generated cache write "
                    "(`ascend_graph/backends/inductor.py`); a lever is kept only where it wins here. "
                    "`one-row products as reductions` (or `in the kernel`): the other choice for one-row bf16 "
                    "products over row-major weights and for one token's routed experts; the default follows the "
                    "kernel's build (`rows_mm` and `expert_rows_mm` on AVX2, reductions on AVX512-BF16: "
                    "`kernels.ONE_ROW_KERNEL`). "
                    "`few-row matmuls in aten`: the pass without the kernel (`rows_mm` and the attention "
                    "products), as before it. `attention products in aten`: the pass without the kernel for MLA "
                    "decode's batched attention products only (scores and values). `attention over gathered KV`: "
                    "the kernel multiplies a gathered copy of the cache rows (`expert_rows_mm`, `rows_bmm`; at batch 1 "
                    "aten's `mm`), as before its paged forms. `cache write as "
                    "the op's call`: the step calls the `ascend_graph::write_slots` custom op once per layer, as "
                    "before `inline_cache_writes`. `row-major long "
                    "rows`: the dense MLP's down projection (rows of 10944) stored row-major, as before, instead of "
                    "chunk-major (`ascend_graph/models/layers.py`, `ChunkedLinear`); the eager columns run the "
                    "eager step on either layout. Freezing "
                    "(`GraphConfig.inductor_freezing_min_batch`) is opt-in: it costs a pre-packed copy of the dense "
                    "weights per frozen capture size, and at batch 1 it replaces the single-row reductions. "
                    "`AOTInductor package` (`GraphConfig.aot_inductor`, opt-in): the step compiled ahead of time "
                    "with torch.export and AOTInductor, run on the model's own weights, without dynamo's guards; "
                    "like the default, it calls the project's kernel (`rows_mm`, `expert_rows_mm`).", ""]


def _huge_pages_table(h: dict | None) -> list[str]:
    if not h or "ms" not in h:
        return [] if not h else ["", f"Huge pages: {h['skipped']}.", ""]
    ms = h["ms"]
    lines = ["", f"### Weights on 2 MiB pages: {h['model']}, batch {h['batch']}, context {h['context']}, ms per step",
             "", "| mode | 4 KiB pages | 2 MiB pages | 4 KiB / 2 MiB |", "| --- | --- | --- | --- |"]
    for mode in ("graph", "eager"):
        small, huge = ms[f"{mode}, 4 KiB pages"], ms[f"{mode}, 2 MiB pages"]
        lines.append(f"| {mode} | {small:.1f} | {huge:.1f} | {small / huge:.2f} |")
    ratio = [ms[f"eager, {p} pages"] / ms[f"graph, {p} pages"] for p in ("4 KiB", "2 MiB")]
    return lines + ["", f"{h['bytes_moved'] / 2**20:.0f} MiB of weights copied onto advised memory "
                    f"({h['anon_huge_bytes'] / 2**20:.0f} MiB of the process on huge pages at the end). Graph / "
                    f"eager: {ratio[0]:.2f} with 4 KiB pages, {ratio[1]:.2f} with 2 MiB pages. Loaded models get "
                    "2 MiB pages by default on CPU, for eager and graph mode alike (`load_deepseek(huge_pages=True)`, "
                    "`runtime.weights_on_huge_pages`), and so do the suite's. PyTorch's `THP_MEM_ALLOC_ENABLE=1` puts every CPU allocation of 2 MiB "
                    "or more on huge pages for a whole process.", ""]


def _attention_table(a: dict | None, bw: dict | None) -> list[str]:
    if not a:
        return []
    d = a["conditions"]["dims"]
    lines = ["", f"### Decode attention alone: batch {d['batch']}, context {d['context']}, V2-Lite MLA dims, "
             f"{d['dtype']}; copy bandwidth in the same rounds {a['copy_bytes_per_s'] / 1e9:.1f} GB/s", "", "| step | mode | num_blocks | ms | GB/s | share of copy bandwidth |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in a["rows"]:
        share = r["share_of_copy_bandwidth"]
        lines.append(f"| {r['step']} | {r['mode']} | {r['num_blocks']} | {r['median_ms']:.2f} | "
                     f"{r['bytes_per_s'] / 1e9:.2f} | {_fmt(share)} |")
    one = a.get("batch_1")
    if one:
        lines += ["", f"Batch 1, context {one['context']} ({one['num_blocks']} blocks), compiled: "
                  f"{one['in_place_ms']:.2f} ms reading the cache blocks in place, {one['gathered_ms']:.2f} ms over a "
                  "gathered copy of the rows (aten's `mm`, as before the paged forms took batch 1), timed interleaved; "
                  + ("the same output." if one["same_output"] else "outputs within rounding, not bit for bit.")]
    g = a.get("gqa")
    if g:
        lines += ["", f"Standard attention (`paged_decode` over a `(k, v)` cache, {g['heads']} query and {g['kv_heads']} kv "
                  f"heads of {g['head_dim']}, {g['dtype']}), batch {g['batch']}, context {g['context']}: eager "
                  f"{g['eager_ms']:.1f} ms, compiled {g['compiled_ms']:.1f} ms (graph/eager "
                  f"{g['graph_over_eager']:.2f})"
                  + (f"; over gathered rows heads first (its form where the kernel does not take the products) "
                     f"{g['gathered_eager_ms']:.1f} and {g['gathered_compiled_ms']:.1f} ms" if "gathered_eager_ms" in g
                     else "")
                  + f"; in its form before 2026-12-01 (products over the gathered `[B, T, Hk, D]` rows in the cache's "
                  f"dtype) {g['former_eager_ms']:.1f} and {g['former_compiled_ms']:.1f} ms; timed interleaved."]
    return lines + [""]


def _startup_table(s: dict | None) -> list[str]:
    if not s:
        return []
    lines = ["", f"### Start-up: capture sizes {s['sizes']} of the {s['model']} model, fresh process each", "",
             "| variant | capture s | total process s | compiles | C++ compiler runs (s) |",
             "| --- | --- | --- | --- | --- |"]
    for k in ("cold", "warm", "portable_artifacts", "aot_cold", "aot_warm"):
        if k not in s:
            continue
        v = s[k]
        extra = f" (+ {v['load_artifacts_s']:.1f} s loading)" if v.get("load_artifacts_s", 0) > 0.05 else ""
        cpp = f"{v['cpp_compiler_runs']} ({v['cpp_compiler_s']:.1f})" if "cpp_compiler_runs" in v else ""
        lines.append(f"| {k} | {v['capture_s']:.1f}{extra} | {v['total_s']:.1f} | {v['compiles']} | {cpp} |")
    return lines + [""]


def _portable_note(s: dict | None) -> list[str]:
    p = (s or {}).get("portable_artifacts")
    if not p:
        return []
    text = ("`portable_artifacts`: the cold run's `torch.compiler.save_cache_artifacts()` loaded with "
            "`load_cache_artifacts` into an empty cache directory of a fresh process. The warm row is "
            "`GraphConfig.compile_cache_dir` reused as is.")
    if "cpp_compiler_runs" in p:
        text += (f" Inductor's FX graph and AOTAutograd caches hit, but on CPU the artifacts carry the "
                 f"generated C++ source, not the compiled kernels: the loading run still ran the C++ "
                 f"compiler {p['cpp_compiler_runs']} times ({p['cpp_compiler_s']:.1f} s of its "
                 f"{p['capture_s']:.1f} s capture; the warm run: {s['warm'].get('cpp_compiler_runs', 0)}). "
                 f"To start warm on another node with the same CPU and torch, copy the compile cache "
                 f"directory itself.")
    a = s.get("aot_warm")
    if a:
        text += (f" `aot_cold` / `aot_warm`: `GraphConfig.aot_inductor` (opt-in), each size exported and compiled "
                 f"by AOTInductor into a package; warm, {a['packages_loaded']} packages were loaded with "
                 f"{a.get('cpp_compiler_runs', 0)} C++ compiler runs. A package is a file: it can be shipped to "
                 f"another node with the same CPU and torch.")
    return [text, ""]


def _memory_table(m: dict | None) -> list[str]:
    if not m:
        return []
    g, e = m["graph"], m["eager"]
    lines = ["", f"### Memory: {m['model']}, batch sizes {m['sizes']}, {m['steps_per_size']} steps each", "",
             "| mode | peak RSS MiB | RSS after building the model MiB | cache addresses unchanged |",
             "| --- | --- | --- | --- |"]
    for v in (g, m.get("graph_frozen"), m.get("graph_aot"), e):
        if v is None:
            continue
        lines.append(f"| {v['mode']} | {v['peak_rss_bytes'] / 2**20:.0f} | {v['rss_after_build_bytes'] / 2**20:.0f} | "
                     f"{v['cache_addresses_unchanged']} |")
    lines += ["", "Bytes allocated during one decode step (small model, batch 8), by cache capacity:", "",
              "| mode | num_blocks | allocated KiB |", "| --- | --- | --- |"]
    for r in m["step_allocations"]:
        lines.append(f"| {r['mode']} | {r['num_blocks']} | {r['allocated_bytes'] / 1024:.1f} |")
    return lines + [""]


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
            if not pts:
                continue
            b, t = zip(*pts)
            ax_t.plot(b, [x * 1e3 for x in t], marker="o", label=variant)
            ax_s.plot(b, [n / x for n, x in zip(b, t)], marker="o", label=variant)
        for ax, label in ((ax_t, "step time (ms)"), (ax_s, "tokens/s")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"decode step, {d['model']} ({d['dtype']}, context {d['context']})")
        fig.tight_layout()
        path = os.path.join(results_dir, f"{key}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def write_outputs(out: dict, json_path: str, results_dir: str) -> None:
    """PERFORMANCE.md (PERFORMANCE_quick.md for a quick run), the PNG plots and the README's
    section; a JSON written elsewhere (``--json``) gets its markdown beside it and touches none."""
    quick = out["conditions"].get("quick")
    if os.path.dirname(os.path.abspath(json_path)) != os.path.abspath(results_dir):
        md = os.path.splitext(json_path)[0] + ".md"
        with open(md, "w") as f:
            f.write(markdown(out))
        print(f"wrote {md}")
        return
    md = os.path.join(results_dir, "PERFORMANCE_quick.md" if quick else "PERFORMANCE.md")
    with open(md, "w") as f:
        f.write(markdown(out))
    print(f"wrote {md}")
    if not quick:
        pngs = plots(out, results_dir)
        for p in pngs:
            print(f"wrote {p}")
        update_readme(markdown(out), pngs)


README_BEGIN, README_END = "<!-- performance:begin -->", "<!-- performance:end -->"
CUDA_BEGIN, CUDA_END = "<!-- cuda:begin -->", "<!-- cuda:end -->"
# benchmarks.decode_step runs on a CUDA device (.ci/cuda_check), kept in benchmarks/results/cuda/
CUDA_RUNS = (("decode_small.json", "small model, float32"),
             ("decode_v2_lite.json", "V2-Lite slice, bfloat16"),
             ("decode_v2_lite_gathered_moe.json", "V2-Lite slice, bfloat16, MoE before `grouped_mm_on_gpu`"))


def update_readme(section: str, pngs: list[str], markers: tuple[str, str] = (README_BEGIN, README_END),
                  source: str = "benchmarks/results/suite.json") -> None:
    """Replace the README's section between ``markers`` with ``section`` (and ``pngs``)."""
    begin, end = markers
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = os.path.join(root, "README.md")
    with open(readme) as f:
        text = f.read()
    if begin not in text or end not in text:
        print(f"{readme} has no {begin} ... {end} markers; left unchanged")
        return
    images = "".join(f"![{os.path.basename(p)}]({os.path.relpath(p, root)})\n" for p in pngs)
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    generated = f"<!-- generated by `python -m benchmarks.report` from {source}; do not edit by hand -->\n"
    with open(readme, "w") as f:
        f.write(f"{head}{begin}\n{generated}{section}\n{images}{end}{tail}")
    print(f"updated {readme}")


def cuda_markdown(results_dir: str) -> str:
    """The README's CUDA table: ``benchmarks.decode_step`` runs on a GPU, and the demo's verdict."""
    runs = [(title, json.load(open(path))) for name, title in CUDA_RUNS
            if os.path.exists(path := os.path.join(results_dir, name))]
    if not runs:
        return "No CUDA run is recorded.\n"
    c = runs[0][1]["conditions"]
    lines = [f"`bash .ci/cuda_check` on an {c.get('device', 'unknown GPU')} ({c['cores']}-core {c['cpu']}), "
             f"torch {c['torch']}, Python {c['python']}, {c['when'][:10]}: decode step through the runner, "
             "graph (Inductor + CUDA graphs) and eager on the same caches, timed interleaved to the step's end "
             "(`torch.cuda.synchronize`), medians; host preparation included. The last rows are an earlier run "
             "of the same command, before the compiled MoE used `torch._grouped_mm` on the GPU.", "",
             "| model | batch | eager ms | graph ms | graph / eager | capture s | capture memory MiB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for title, d in runs:
        for r in d["rows"]:
            cap = d["capture"].get(str(r["batch"]), {})
            lines.append(f"| {title} (context {d['context']}) | {r['batch']} | {r['eager_s'] * 1e3:.2f} | "
                         f"{r['graph_s'] * 1e3:.2f} | {r['speedup']:.2f} | {_fmt(cap.get('seconds'), 1)} | "
                         f"{cap.get('memory_bytes', 0) / 2**20:.0f} |")
    demo = os.path.join(results_dir, "demo.json")
    if os.path.exists(demo):
        d = json.load(open(demo))
        t, p = d["throughput"], d["parity"]
        lines += ["", f"`ascend-graph demo --device cuda` ({d['model']['source']}, {d['model']['dtype']}): graph "
                      f"{t['graph']['tokens_per_s']:.0f} vs eager {t['eager']['tokens_per_s']:.0f} tokens/s "
                      f"({t['speedup']:.2f}x); tokens identical: {'yes' if p['tokens_identical'] else 'no'}; "
                      f"{p['compare_step']['checks'] - p['compare_step']['failures']} of "
                      f"{p['compare_step']['checks']} compare_step checks OK."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--cuda"]:
        update_readme(cuda_markdown(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cuda")), [],
                      (CUDA_BEGIN, CUDA_END), "benchmarks/results/cuda/*.json")
        sys.exit(0)
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(results, "suite.json")
    with open(path) as f:
        data = json.load(f)
    data["targets"] = targets(data)
    write_outputs(data, path, results)  # a JSON elsewhere (benchmarks/results/avx2/) gets its .md, not the README
