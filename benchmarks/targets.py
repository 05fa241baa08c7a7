"""The issue's targets as data: each measured value beside its goal and the values it would take
at the limits measured in the same run (``LIMITS``), from the suite's JSON.

A limit's value is what the target would read if the step ran at that limit and did nothing
else: the best it can be on this machine while the limit stands.
"""

from __future__ import annotations

from benchmarks.startup import DEMO_GOALS, DEMO_SIZES, DEMO_VARIANTS

# limit -> column heading of the report's limits table (docs/performance.md explains each)
LIMITS = {"at_copy_roofline": "at copy roofline", "at_read_ceiling": "at read ceiling",
          "at_matmul_rate": "at bf16 matmul rate", "at_other_matmuls": "at its matmuls alone",
          "at_core_peak": "at core peak", "vs_two_ceilings": "step vs. max(memory, core peak)"}


def _row(part: dict | None, batch: int) -> dict | None:
    return next((r for r in (part or {}).get("rows", []) if r["batch"] == batch), None)


def _compute_row(out: dict, batch: int) -> dict | None:
    return next((r for r in (out.get("compute") or {}).get("rows", []) if r["batch"] == batch), None)


def _core_peak(out: dict) -> float | None:
    return ((out.get("compute") or {}).get("core_peak") or {}).get("bf16_dot_flops_per_s")


def _ratio_limits(out: dict, row: dict | None, other: str, goal: float) -> dict:
    """A ratio ``row[other] / graph step`` at its limits: the copy roofline, one core's read
    ceiling (batch 1), the step's other matmuls timed alone, its FLOPs at the bf16 matmul rate
    (batch 8 on); and how many rounds, graph and ``other`` timed back to back, reached ``goal``."""
    if not row or other not in row or "bytes" not in row:
        return {}
    roofline_s = row["bytes"]["total"] / row["copy_bytes_per_s"]
    limits = {"at_copy_roofline": row[other] / roofline_s}
    if "read_bytes_per_s" in row:
        limits["at_read_ceiling"] = row[other] * row["read_bytes_per_s"] / row["bytes"]["total"]
    if "matmuls_s" in row:
        limits["at_other_matmuls"] = row[other] / row["matmuls_s"]
    comp = _compute_row(out, row["batch"])
    if comp and row["batch"] >= 8:  # a one-row matmul's rate is a bandwidth figure, not a compute one
        rate = comp.get("bf16_kernel_matmul_flops_per_s", comp["bf16_matmul_flops_per_s"])
        limits["at_matmul_rate"] = row[other] * rate / comp["step_flops"]
    ratios = (row.get("round_ratios") or {}).get(other[:-len("_s")])
    if ratios:
        limits.update(rounds=len(ratios), rounds_at_goal=sum(r >= goal for r in ratios), round_min=min(ratios),
                      round_max=max(ratios))
    return limits


def _share_limits(out: dict, batch: int, step: str = "graph_s") -> dict:
    """The roofline share of the V2-Lite step ``step`` at ``batch`` at its limits: its FLOPs at the
    measured bf16 matmul rate (the kernel's where measured; pre-packed for the frozen step), its
    other matmuls timed alone, its FLOPs at the core's peak; and the step against the roofline
    with both ceilings (the larger of memory time and FLOPs at peak)."""
    row, comp = _row(out.get("decode_v2"), batch), _compute_row(out, batch)
    if not row or "bytes" not in row or step not in row:
        return {}
    roofline_s = row["bytes"]["total"] / row["copy_bytes_per_s"]
    limits = {}
    if batch == 1:
        rb = out.get("read_bandwidth") or {}
        if "read_bytes_per_s" in row:
            limits["at_read_ceiling"] = row["read_bytes_per_s"] / row["copy_bytes_per_s"]
        elif "read_over_copy" in rb:
            limits["at_read_ceiling"] = rb["read_over_copy"]
        return limits
    frozen = step == "graph_frozen_s"
    if comp:
        rate = (comp.get("bf16_packed_matmul_flops_per_s") if frozen else
                comp.get("bf16_kernel_matmul_flops_per_s", comp["bf16_matmul_flops_per_s"]))
        if rate:
            limits["at_matmul_rate"] = roofline_s * rate / comp["step_flops"]
    mm = row.get("matmuls_packed_s" if frozen else "matmuls_s")
    if mm:
        limits["at_other_matmuls"] = roofline_s / mm
    peak = _core_peak(out)
    if comp and peak:
        peak_s = comp["step_flops"] / peak
        limits["at_core_peak"] = roofline_s / peak_s
        limits["vs_two_ceilings"] = max(roofline_s, peak_s) / row[step]
    return limits


def _roofline_share(out: dict, batch: int, step: str = "graph_s") -> float | None:
    row = _row(out.get("decode_v2"), batch)
    if not row or "bytes" not in row or step not in row:
        return None
    return row["bytes"]["total"] / row[step] / row["copy_bytes_per_s"]


def _attention(out: dict) -> tuple[float | None, float | None, dict]:
    """The compiled tuple step's share of copy bandwidth at the smaller capacity, its capacity
    ratio, and the share at its limits: its matmuls alone over pre-gathered KV, its FLOPs at the
    best bf16 matmul rate measured and at the core's peak."""
    att = out.get("attention")
    if not att:
        return None, None, {}
    small = min(r["num_blocks"] for r in att["rows"])
    best = max((r for r in att["rows"] if r["step"].startswith("tuple") and r["num_blocks"] == small),
               key=lambda r: r["bytes_per_s"])
    ratio = att["capacity_ratio"].get(f"{best['step']}/{best['mode']}")
    floor = next((r for r in att["rows"] if r["step"].startswith("floor")), None)
    if not floor:
        return best["share_of_copy_bandwidth"], ratio, {}
    limits = {"at_other_matmuls": floor["share_of_copy_bandwidth"]}
    memory_s = floor["share_of_copy_bandwidth"] * floor["median_ms"] / 1e3  # its bytes at copy bandwidth
    d = att["conditions"]["dims"]
    flops = 2 * d["batch"] * d["heads"] * d["context"] * (2 * d["kv_lora_rank"] + d["rope"])
    rates = [r[k] for r in (out.get("compute") or {}).get("rows", [])
             for k in ("bf16_matmul_flops_per_s", "bf16_kernel_matmul_flops_per_s") if r.get(k)]
    if rates:
        limits["at_matmul_rate"] = memory_s * max(rates) / flops
    if _core_peak(out):
        limits["at_core_peak"] = memory_s * _core_peak(out) / flops
    return best["share_of_copy_bandwidth"], ratio, limits


def case_title(name: str) -> str:
    """A ``live_context`` case (``<model>_<dtype>``) as the tables name it."""
    model, dtype = name.rsplit("_", 1)
    return f"{'small model' if model == 'small' else 'V2-Lite slice'}, {dtype}"


def width_target(case: dict, goal: float) -> tuple[float | None, dict]:
    """A ``live_context`` case's worst t(widest max_model_len) / t(narrowest) over its batches, and
    for that batch the rounds (both widths timed back to back) at ``goal`` or under."""
    rows = case.get("width") or []
    if not rows:
        return None, {}
    widest = max(rows[0]["ratio"], key=int)
    worst = max(rows, key=lambda r: r["ratio"][widest])
    ratios = worst.get("round_ratios", {}).get(widest) or []
    limits = ({"rounds": len(ratios), "rounds_at_goal": sum(r <= goal for r in ratios), "round_min": min(ratios),
               "round_max": max(ratios)} if ratios else {})
    return worst["ratio"][widest], limits


def targets(out: dict) -> list[dict]:
    """Every target of the issue: goal, measured value (None where its part did not run), whether
    it meets the goal, and its limits (``LIMITS``, plus round counts where timed per round)."""
    rows = []

    def add(name: str, value, goal: float, part: str, at_most: bool = False, limits: dict | None = None):
        met = None if value is None else (value <= goal if at_most else value >= goal)
        rows.append({"target": name, "part": part, "goal": goal, "at_most": at_most, "value": value, "met": met,
                     "limits": limits or {}})

    for b, goal in ((1, 3.0), (8, 3.0), (32, 1.5), (64, 1.5)):
        r = _row(out.get("decode_small"), b)
        add(f"small model: graph / eager step time, batch {b}", r and r["speedup"], goal, "decode_small")
    v2 = out.get("decode_v2")
    r = _row(v2, 1)
    add("V2-Lite slice: graph / eager, batch 1", r and r["speedup"], 2.5, "decode_v2",
        limits=_ratio_limits(out, r, "eager_s", 2.5))
    for b in (1, 8):
        r = _row(v2, b)
        add(f"V2-Lite slice: graph / transformers, batch {b}", r and r.get("graph_vs_transformers"), 3.0,
            "decode_v2", limits=_ratio_limits(out, r, "transformers_s", 3.0))
    r = _row(v2, 8)
    if r and "graph_frozen_s" in r and "transformers_s" in r:
        add("V2-Lite slice: graph / transformers, batch 8, freezing on (opt-in)",
            r["transformers_s"] / r["graph_frozen_s"], 3.0, "decode_v2")
    add("V2-Lite slice batch 1: share of the copy-bandwidth roofline", _roofline_share(out, 1), 0.7, "decode_v2",
        limits=_share_limits(out, 1))
    add("V2-Lite slice batch 32: roofline time / step time", _roofline_share(out, 32), 0.5, "decode_v2",
        limits=_share_limits(out, 32))
    if "graph_frozen_s" in (_row(v2, 32) or {}):
        add("V2-Lite slice batch 32: roofline time / step time, freezing on (opt-in)",
            _roofline_share(out, 32, "graph_frozen_s"), 0.5, "decode_v2",
            limits=_share_limits(out, 32, "graph_frozen_s"))
    moe = next((r for r in (out.get("moe_forms") or {}).get("rows", []) if r["tokens"] == 32), None)
    moe_share = (moe["compiled decode (now)"]["GB_per_s"] * 1e9 / moe["copy_bytes_per_s"]
                 if moe and "copy_bytes_per_s" in moe else None)
    add("V2-Lite MoE layer alone, 32 tokens: roofline time / time", moe_share, 0.5, "moe_forms")
    share, ratio, limits = _attention(out)
    add("decode attention b32 ctx2048: bandwidth / copy bandwidth", share, 0.5, "attention", limits=limits)
    add("decode attention: t(N=32768) / t(N=256)", ratio, 1.15, "attention", at_most=True)
    ops = (out.get("attention") or {}).get("op_alone") or {"bfloat16": None}
    for dt, op in ops.items():
        add(f"decode_attention op alone b32 ctx2048, {dt}: live-cache bytes/s / copy bandwidth",
            op and op["share_of_copy_bandwidth"], 0.5, "attention")
    lc = out.get("live_context") or {}
    for name, case in (lc.get("cases") or {"": {}}).items():
        value, limits = width_target(case, 1.15)
        title = f"decode step, {case_title(name)}, context {lc['context']}: " if name else "decode step: "
        add(title + f"t(max_model_len {max(lc.get('widths', [32768]))}) / t({min(lc.get('widths', [256]))}), "
            "worst batch", value, 1.15, "live_context", at_most=True, limits=limits)
    st = out.get("startup")
    add("start-up: cold / warm capture time", st and st["warm_speedup_capture"], 5.0, "startup")
    for key, how in DEMO_VARIANTS:
        demo = (st or {}).get(key)
        if key != "demo" and demo is None:
            continue
        for start in ("cold", "warm"):
            add(f"start-up: the demo's capture of sizes {', '.join(map(str, DEMO_SIZES))}{how}, {start}, s (median)",
                demo and demo[f"{start}_capture_s"]["median"], DEMO_GOALS[f"{start}_capture_s"], "startup",
                at_most=True)
    mem = out.get("memory")
    add(f"peak RSS graph / eager ({mem['model'] if mem else '—'})", mem and mem["peak_ratio"], 1.1, "memory",
        at_most=True)
    return rows
