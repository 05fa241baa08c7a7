"""The PD section of docs/performance.md: ``benchmarks.pd_transfer`` and ``benchmarks.pd_serving`` runs."""

from __future__ import annotations

from benchmarks.tables import fmt, table


def transfer_rows(d: dict) -> list[str]:
    """Throughput of moving one set of blocks into a second process's caches, against a local copy."""
    rows, s = d["rows"], d["setup"]
    body = [["local copy (`copy_`)", "—", "—", fmt(rows["copy"]["gib_per_s"]), "1.00"],
            ["local `index_copy_` of the blocks", "—", "—", fmt(rows["index_copy"]["gib_per_s"]),
             fmt(rows["index_copy"]["gib_per_s"] / rows["copy"]["gib_per_s"])]]
    for transport in ("mooncake", "gloo"):
        for plan, label in (("runs", "merged runs"), ("blocks", "one descriptor per block")):
            r = (rows.get(transport) or {}).get(plan)
            if r:
                body.append([f"{transport}, {label}", r["descriptors"], r["batches"], fmt(r["gib_per_s"]),
                             fmt(r["vs_copy"])])
    mib = rows["copy"]["bytes"] / 2 ** 20
    return table(["path", "descriptors", "batches", "GiB/s", "vs copy"], body) + [
        "", f"{mib:.0f} MiB: {s['layers']} layers of `(kv_c, k_pe)` ({s['kv_lora_rank']} + {s['rope_dim']}, "
        f"{s['dtype']}), blocks of {s['block_size']}, {s['bytes_per_block']} bytes per block, medians of "
        f"{s['repeats']}, over {s['host']}; every received block bit-exact."]


def serving_rows(d: dict) -> list[str]:
    """TTFT and decode step, PD against one process, same requests, taking turns."""
    body = [[r["transport"], r["batch"], fmt(r["single_ttft_ms"]), fmt(r["pd_ttft_ms"]), fmt(r["pd_over_single_ttft"]),
             fmt(r["single_decode_ms"], 3), fmt(r["pd_decode_ms"], 3), fmt(r["pd_over_single_decode"]),
             fmt(r["transfer_ms_per_request"]), r["decode_recompiles"]] for r in d["rows"]]
    return table(["transport", "batch", "TTFT 1 process ms", "TTFT PD ms", "PD / 1", "decode 1 process ms",
                  "decode PD ms", "PD / 1", "transfer ms / request", "recompiles"], body)
