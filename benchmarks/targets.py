"""The issue's targets, judged from the suite's JSON: each measured value against its goal, with
the measured bound that explains a miss (roofline, compute rate, core peak)."""

from __future__ import annotations


def _row(part: dict | None, batch: int) -> dict | None:
    return next((r for r in (part or {}).get("rows", []) if r["batch"] == batch), None)


def _roofline_fraction(out: dict, batch: int, step: str = "graph_s") -> float | None:
    row = _row(out.get("decode_v2"), batch)
    if not row or "bytes" not in row or step not in row:
        return None
    return row["bytes"]["total"] / row[step] / row["copy_bytes_per_s"]


def _frozen_cost(out: dict) -> str:
    """What freezing costs: peak RSS of a run with one frozen size against eager's."""
    mem = out.get("memory") or {}
    if "frozen_peak_ratio" not in mem:
        return "opt-in: it keeps a pre-packed copy of the dense weights per frozen size"
    return (f"opt-in: it keeps a pre-packed copy of the dense weights per frozen size; peak RSS of a {mem['model']} "
            f"run with sizes {mem['sizes']}, size 8 frozen, is {mem['frozen_peak_ratio']:.2f}x eager's "
            f"(unfrozen graph: {mem['peak_ratio']:.2f}x)")


def _attention(out: dict) -> tuple[float | None, float | None]:
    att = out.get("attention")
    if not att:
        return None, None
    small = min(r["num_blocks"] for r in att["rows"])
    tuple_rows = [r for r in att["rows"] if r["step"].startswith("tuple") and r["num_blocks"] == small]
    best = max(tuple_rows, key=lambda r: r["bytes_per_s"])
    ratio = att["capacity_ratio"].get(f"{best['step']}/{best['mode']}")
    return best["share_of_copy_bandwidth"], ratio


def targets(out: dict) -> list[dict]:
    """Every target of the issue with the measured value (None where that part did not run)."""
    rows = []

    def add(name: str, value, goal: float, how: str, at_most: bool = False, bound: str = ""):
        met = None if value is None else (value <= goal if at_most else value >= goal)
        rows.append({"target": name, "value": value, "goal": goal, "at_most": at_most, "met": met, "measured": how,
                     "bound": bound})

    ov = out.get("overhead")
    for b, goal in ((1, 3.0), (8, 3.0), (32, 1.5), (64, 1.5)):
        r = _row(out.get("decode_small"), b)
        bound = ""
        if ov and b == ov["batch"]:
            bound = (f"of a {ov['execute_us']:.0f} us graph step, the compiled call is {ov['compiled_call_us']:.0f} us, "
                     f"of which {ov['guard_us']:.0f} us dynamo's guards")
            if "compiled_call_op_write_us" in ov:
                bound += (f"; with the cache write called as the custom op instead of generated, the compiled call "
                          f"takes {ov['compiled_call_op_write_us']:.0f} us (the op {ov['write_slots_us']:.0f} us, "
                          f"{ov['layers']} layers)")
            else:
                bound += f"; the cache-write custom op {ov['write_slots_us']:.0f} us ({ov['layers']} layers)"
            if "aot_execute_us" in ov:
                bound += (f"; the same step from an AOTInductor package (`aot_inductor`, opt-in) takes "
                          f"{ov['aot_execute_us']:.0f} us")
        add(f"small model: graph / eager step time, batch {b}", r and r["speedup"], goal, "decode_small", bound=bound)
    r = _row(out.get("decode_v2"), 1)
    add("V2-Lite slice: graph / eager, batch 1", r and r["speedup"], 2.5, "decode_v2",
        bound=_bound(out, r, "eager_s", 2.5))
    for b in (1, 8):
        r = _row(out.get("decode_v2"), b)
        add(f"V2-Lite slice: graph / transformers, batch {b}", r and r.get("graph_vs_transformers"), 3.0, "decode_v2",
            bound=_bound(out, r, "transformers_s", 3.0))
    r = _row(out.get("decode_v2"), 8)
    if r and "graph_frozen_s" in r and "transformers_s" in r:
        add("V2-Lite slice: graph / transformers, batch 8, freezing on (opt-in)",
            r["transformers_s"] / r["graph_frozen_s"], 3.0, "decode_v2", bound=_frozen_cost(out))
    rb = out.get("read_bandwidth")
    add("V2-Lite slice batch 1: share of the copy-bandwidth roofline", _roofline_fraction(out, 1), 0.7, "decode_v2",
        bound=rb and (f"a read-only stream ({rb.get('read_how', 'a large float32 sum')}) reaches "
                      f"{rb['read_over_copy']:.2f} of the copy bandwidth on this core"))
    add("V2-Lite slice batch 32: roofline time / step time (within 2x)", _roofline_fraction(out, 32), 0.5,
        "decode_v2", bound=_compute_bound(out, 32))
    if "graph_frozen_s" in (_row(out.get("decode_v2"), 32) or {}):
        add("V2-Lite slice batch 32: roofline time / step time, freezing on (opt-in)",
            _roofline_fraction(out, 32, "graph_frozen_s"), 0.5, "decode_v2",
            bound=_compute_bound(out, 32, "bf16_packed_matmul_flops_per_s", "pre-packed", "graph_frozen_s"))
    moe = next((r for r in (out.get("moe_forms") or {}).get("rows", []) if r["tokens"] == 32), None)
    if moe and "copy_bytes_per_s" in moe:
        now = moe["compiled decode (now)"]
        before = moe.get("compiled decode, _grouped_mm (before)")
        add("V2-Lite MoE layer alone, 32 tokens: roofline time / time (each chosen expert read once)",
            now["GB_per_s"] * 1e9 / moe["copy_bytes_per_s"], 0.5, "moe_forms",
            bound=(f"the routed experts of one layer as the compiled step runs them: {moe['experts_used']} distinct "
                   f"experts, {moe['bytes'] / 1e6:.0f} MB, in {now['ms']:.1f} ms"
                   + (f" (with `torch._grouped_mm` instead of `expert_rows_mm`, as before: {before['ms']:.1f} ms, "
                      f"ratio {before['GB_per_s'] * 1e9 / moe['copy_bytes_per_s']:.2f})" if before else "")
                   + f"; copy bandwidth in the same rounds {moe['copy_bytes_per_s'] / 1e9:.1f} GB/s"
                   + _prepacked_note(moe, out["moe_forms"]["rows"]) + _few_rows_note(out, 3)))
    frac, ratio = _attention(out)
    floor = next((x for x in (out.get("attention") or {}).get("rows", []) if x["step"].startswith("floor")), None)
    add("decode attention b32 ctx2048: bandwidth / copy bandwidth", frac, 0.5, "attention",
        bound=_attention_bound(out, floor))
    capacity = (out.get("attention") or {}).get("capacity_ratio") or {}
    small_pages = capacity.get("tuple (kv_c, k_pe)/compiled, cache on 4 KiB pages")
    evicted = capacity.get("tuple (kv_c, k_pe)/compiled, last-level cache evicted")
    bound = "" if small_pages is None else (
        f"caches on huge pages, as the runner allocates them on CPU; over caches on 4 KiB pages the compiled "
        f"step's ratio was {small_pages:.2f} in the same rounds")
    if evicted is not None:
        bound += (f"; at N=256 the batch's blocks share 4.5 MiB that stay in the last-level cache between calls: "
                  f"with that cache evicted before each call (untimed), the ratio was {evicted:.2f}")
    add("decode attention: t(N=32768) / t(N=256)", ratio, 1.15, "attention", at_most=True, bound=bound)
    st = out.get("startup")
    add("start-up: cold / warm capture time", st and st["warm_speedup_capture"], 5.0, "startup")
    mem = out.get("memory")
    add(f"peak RSS graph / eager ({mem['model'] if mem else '—'})", mem and mem["peak_ratio"], 1.1, "memory",
        at_most=True, bound="" if not mem or mem["model"] != "small" else
        "the small model's weights are tiny, so Inductor's own memory decides the ratio; the full run uses the "
        "V2-Lite slice")
    return rows


def _compute_bound(out: dict, batch: int, rate: str = "bf16_matmul_flops_per_s", kind: str = "bf16",
                   step: str = "graph_s") -> str:
    """How long the step's FLOPs take at this machine's bf16 matmul rate (``rate``: aten's, or
    with weights pre-packed for oneDNN; aten's gives way to the project's kernel where it was
    measured, as the compiled step runs that), against its roofline time; and the step
    (``step``) against the roofline with both ceilings, memory and the core's peak."""
    row = _row(out.get("decode_v2"), batch)
    comp = next((r for r in (out.get("compute") or {}).get("rows", []) if r["batch"] == batch), None)
    if not row or not comp or "bytes" not in row or rate not in comp:
        return ""
    rate_text = f"the measured {kind} matmul rate ({comp[rate] / 1e9:.0f} GFLOP/s)"
    if rate == "bf16_matmul_flops_per_s" and "bf16_kernel_matmul_flops_per_s" in comp:
        rate_text = (f"the measured bf16 matmul rate of `rows_mm`, as the compiled step runs its dense products "
                     f"({comp['bf16_kernel_matmul_flops_per_s'] / 1e9:.0f} GFLOP/s; aten {comp[rate] / 1e9:.0f})")
        rate = "bf16_kernel_matmul_flops_per_s"
    compute_s = comp["step_flops"] / comp[rate]
    roofline_s = row["bytes"]["total"] / row["copy_bytes_per_s"]
    # The goal (roofline time >= 0.5 step time) allows a step of twice the roofline time.
    floor = _matmul_floor(out, row, 2 * roofline_s, packed=step == "graph_frozen_s")
    return (f"{comp['step_flops'] / 1e9:.1f} GFLOP at {rate_text} take {compute_s * 1e3:.0f} ms vs "
            f"{roofline_s * 1e3:.0f} ms of memory traffic: compute-bound, share at most {roofline_s / compute_s:.2f} "
            "at that rate" + (f"; measured on the step itself, {floor}" if floor else "")
            + _at_peak(out, comp["step_flops"], roofline_s, "share", row.get(step)))


def _matmul_floor(out: dict, row: dict, budget_s: float, packed: bool = False) -> str:
    """What a goal that allows the step ``budget_s`` leaves for its routed experts once the step's
    other matmuls are paid for: those matmuls replayed alone in the same rounds
    (``compute.StepMatmuls``; aten on the plain weights, or with ``packed`` oneDNN on pre-packed
    ones, as a frozen step runs them), against the rate at which the batch-1 graph step streams."""
    key = "matmuls_packed_s" if packed else "matmuls_s"
    if key not in row or "bytes" not in row:
        return ""
    mm_s, routed = row[key], row["bytes"]["routed_experts"]
    if packed:
        how = "oneDNN, these weights pre-packed"
    elif "matmuls_aten_s" in row:
        attention = (", the attention products in the kernel's batched forms"
                     if row.get("matmuls_batched_in_kernel") else "")
        how = (f"as the compiled step runs them: `rows_mm` up to {row['rows_mm_max_rows']} rows{attention}, aten "
               f"beyond; all in aten they take {row['matmuls_aten_s'] * 1e3:.1f} ms")
    else:
        how = "aten, these weights"
    left_s = budget_s - mm_s
    digits = 1 if abs(left_s) < 0.0095 else 0  # not "122 ms, more than 122 ms" nor "leaves 0 ms"
    text = (f"the step's matmuls other than the routed experts', recorded from an eager step and replayed alone "
            f"in the same rounds ({how}), take {mm_s * 1e3:.{digits}f} ms")
    if left_s <= 0:
        return text + f", more than the {budget_s * 1e3:.{digits}f} ms the goal allows the whole step"
    if left_s < 0.00005:  # under the printed 0.1 ms: nothing left, not a rate of thousands of GB/s
        return text + f", all of the {budget_s * 1e3:.{digits}f} ms the goal allows the whole step"
    text += (f", which leaves {left_s * 1e3:.{digits}f} ms of the goal's {budget_s * 1e3:.{digits}f} ms for the "
             f"{routed / 1e6:.0f} MB of routed experts: {_figure(routed / left_s / 1e9, 0)} GB/s")
    one = _row(out.get("decode_v2"), 1)
    if one and "bytes" in one:
        text += (f", against the {one['bytes']['total'] / one['graph_s'] / 1e9:.1f} GB/s at which the batch-1 graph "
                 "step streams its weights")
    return text


def _figure(x: float, places: int) -> str:
    """``x`` to ``places`` decimals, or to two significant digits where those would print it as 0."""
    text = f"{x:.{places}f}"
    return f"{x:.2g}" if x and not float(text) else text


def _at_peak(out: dict, flops: float, memory_s: float, what: str, step_s: float | None = None) -> str:
    """``memory_s`` over the time ``flops`` take at one core's peak bf16 dot-product rate (``peak.py``);
    with ``step_s``, also the full roofline (the larger of the two times) over the step time."""
    rate = ((out.get("compute") or {}).get("core_peak") or {}).get("bf16_dot_flops_per_s")
    if not rate:
        return ""
    text = (f"; even at this core's peak bf16 dot-product rate ({rate / 1e9:.0f} GFLOP/s, `benchmarks/peak.py`) "
            f"the {what} would be at most {memory_s / (flops / rate):.2f}")
    if step_s:
        text += (f"; against the roofline with both ceilings (the larger of the memory time and the FLOPs at that "
                 f"peak, {max(memory_s, flops / rate) * 1e3:.0f} ms) the step is at "
                 f"{max(memory_s, flops / rate) / step_s:.2f}")
    return text


def _attention_bound(out: dict, floor: dict | None) -> str:
    """The matmul floor of decode attention, and its FLOPs at the machine's best bf16 matmul rate."""
    if not floor:
        return ""
    text = f"eager's products over KV gathered beforehand (aten's) reach {_figure(floor['share_of_copy_bandwidth'], 2)}"
    rates = [r[k] for r in (out.get("compute") or {}).get("rows", [])
             for k in ("bf16_matmul_flops_per_s", "bf16_kernel_matmul_flops_per_s") if k in r]
    d = out["attention"]["conditions"]["dims"]
    if rates:
        flops = 2 * d["batch"] * d["heads"] * d["context"] * (2 * d["kv_lora_rank"] + d["rope"])
        best_s = flops / max(rates)
        memory_s = floor["share_of_copy_bandwidth"] * floor["median_ms"] / 1e3  # its bytes at copy bandwidth
        text += (f"; its {flops / 1e9:.2f} GFLOP at the best measured bf16 matmul rate ({max(rates) / 1e9:.0f} "
                 f"GFLOP/s) take {best_s * 1e3:.0f} ms, i.e. at most {memory_s / best_s:.2f} of copy bandwidth"
                 + _at_peak(out, flops, memory_s, "share"))
    return text


def _bound(out: dict, row: dict | None, other: str, goal: float) -> str:
    """What the goal asks of the graph step, against its floors: the copy-bandwidth roofline (a
    read-only weight stream can beat it: ``copy_`` counts a read and a write) and, from batch 8,
    the step's own matmuls timed alone (``_matmul_floor``), or where those were not timed, the time
    its FLOPs take at the measured bf16 matmul rate."""
    if not row or other not in row or "bytes" not in row:
        return ""
    roofline_s = row["bytes"]["total"] / row["copy_bytes_per_s"]
    text = (f"the goal needs a {row[other] / goal * 1e3:.0f} ms graph step (now {row['graph_s'] * 1e3:.0f} ms); "
            f"at the copy-bandwidth roofline ({roofline_s * 1e3:.0f} ms) the ratio would be "
            f"{row[other] / roofline_s:.2f}")
    if row["graph_s"] < roofline_s:
        text += ", a figure the step already beats (it streams weights faster than copy_ moves them)"
    if "read_bytes_per_s" in row:  # batch 1, bandwidth-bound: its floor is the read ceiling, same rounds
        read_s = row["bytes"]["total"] / row["read_bytes_per_s"]
        text += (f"; at one core's read ceiling ({row['read_bytes_per_s'] / 1e9:.1f} GB/s in the same rounds, "
                 f"{row['read_how']}) its {row['bytes']['total'] / 1e6:.0f} MB take "
                 f"{read_s * 1e3:.1f} ms: the ratio would be at most {row[other] / read_s:.2f} with nothing else in "
                 f"the step, which runs at {read_s / row['graph_s']:.2f} of that ceiling")
    ratios = (row.get("round_ratios") or {}).get(other[:-len("_s")])
    if ratios:
        text += (f"; round by round (graph and {other[:-len('_s')]} timed back to back) the ratio ran "
                 f"{min(ratios):.2f}-{max(ratios):.2f}, at the goal or above in {sum(r >= goal for r in ratios)} "
                 f"of {len(ratios)} rounds")
    floor = _matmul_floor(out, row, row[other] / goal)
    comp = next((r for r in (out.get("compute") or {}).get("rows", []) if r["batch"] == row["batch"]), None)
    if floor:
        text += f"; {floor}"
    elif comp and row["batch"] >= 8:  # a one-row matmul's rate is a bandwidth figure, not a compute one
        compute_s = comp["step_flops"] / comp["bf16_matmul_flops_per_s"]
        text += (f"; its {comp['step_flops'] / 1e9:.1f} GFLOP at this batch's bf16 matmul rate "
                 f"({comp['bf16_matmul_flops_per_s'] / 1e9:.0f} GFLOP/s) take {compute_s * 1e3:.0f} ms: "
                 f"ratio at most {row[other] / max(roofline_s, compute_s):.2f} at that rate")
    return text


def _few_rows_note(out: dict, rows: int) -> str:
    """How fast one core streams ``rows``-row products over plain weights, aten against the
    project's kernel (``peak.few_rows_streams``)."""
    row = next((r for r in (out.get("compute") or {}).get("few_rows", []) if r["rows"] == rows), None)
    if not row:
        return ""
    return (f". On one core, {rows}-row products over plain row-major bf16 weights stream at "
            f"{row['aten_bytes_per_s'] / 1e9:.1f} GB/s with aten and {row['kernel_bytes_per_s'] / 1e9:.1f} GB/s with "
            "the kernel of `expert_rows_mm` (`python -m benchmarks.peak`)")


def _prepacked_note(moe: dict, rows: list[dict]) -> str:
    """What oneDNN's pre-packed expert weights reach in the same rounds, and what they would cost."""
    name = "eager oneDNN pre-packed (not used)"
    if name not in moe:
        return ""
    packed = moe[name]
    note = (f". The same matmuls on weights pre-packed for oneDNN take {packed['ms']:.1f} ms (ratio "
            f"{packed['GB_per_s'] * 1e9 / moe['copy_bytes_per_s']:.2f}); not used: they need a packed copy of every "
            "expert (2x the experts' memory), since the plain layout feeds the compiled batch-1 form")
    one = next((r for r in rows if r["tokens"] == 1 and name in r), None)
    if one:
        note += (f" (at 1 token: compiled {one['compiled decode (now)']['ms']:.1f} ms, pre-packed "
                 f"{one[name]['ms']:.1f} ms)")
    return note
