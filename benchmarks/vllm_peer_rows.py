"""``benchmarks.vllm_peer``'s rows: every side against stock vLLM, tokens checked, and the table.

A row (``compare``) is one model, dtype and batch: each side's decode ms per step (``ms``), its
rounds, for the vLLM sides the split of a step into the model's forward (``forward_ms``) and
vLLM's own work around it (``own_ms``: scheduling, input preparation, sampling, outputs), and
per side other than stock vLLM (``vs_vllm``) the ratio ``vllm_ms / side_ms`` (> 1:
that side is faster than stock vLLM), left out where its tokens differ from stock vLLM's, with
each round's own ratio (the table shows their range). There
``Referee`` (transformers on the same checkpoint) judges each differing request's first
difference; where all are near-ties, ``ratio_near_ties`` gives the ratio all the same. Two of our
own comparisons come with it: ``capacity`` (vLLM+graph at ``k`` times the KV cache bytes over
vLLM+graph at 1x: no step copies a whole cache where it stays near 1) and ``before_after``
(vLLM+graph of this checkout over that of an older one), each with its tokens checked against
vLLM+graph's.
"""

from __future__ import annotations

import gc
import statistics

import torch

from benchmarks.tables import fmt, table

STOCK, GRAPH, ENGINE, BEFORE = "vllm", "vllm_graph", "engine", "vllm_graph_before"
LABELS = {STOCK: "vLLM", GRAPH: "vLLM+graph", ENGINE: "Engine", BEFORE: "vLLM+graph before"}


def capacity_side(multiplier: int) -> str:
    """The name of the vLLM+graph side at ``multiplier`` times the KV cache bytes."""
    return f"{GRAPH}_{multiplier}x"


def label(side: str) -> str:
    """A side's column title."""
    if side in LABELS:
        return LABELS[side]
    return f"vLLM+graph {side[len(GRAPH) + 1:]} cache" if side.startswith(GRAPH + "_") else side


def first_difference(a: list[list[int]], b: list[list[int]]) -> dict | None:
    """Where two batches of token lists first differ: the first request that differs, the
    position in it and both tokens there (``vllm`` from ``a``, ``side`` from ``b``; ``None``: a
    token there is missing), and how many requests differ; ``None`` where all are equal."""
    if len(a) != len(b):
        return {"request": min(len(a), len(b)), "position": 0, "vllm": None, "side": None,
                "requests_differing": abs(len(a) - len(b))}
    differing = request_differences(a, b)
    if not differing:
        return None
    i, pos = differing[0]
    at = lambda seq: seq[pos] if pos < len(seq) else None  # noqa: E731
    return {"request": i, "position": pos, "vllm": at(a[i]), "side": at(b[i]), "requests_differing": len(differing)}


def request_differences(a: list[list[int]], b: list[list[int]]) -> list[tuple[int, int]]:
    """``(request, position)`` of each request's first token difference between two batches."""
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            out.append((i, next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))))
    return out


def versus(base: dict, other: dict) -> dict:
    """``other`` against ``base`` (two sides' timed rows): ``base_ms / other_ms`` where the tokens
    agree; and each round's own ratio (``round_ratios``, the rounds as both sides ran them)."""
    diff = first_difference(base["tokens"], other["tokens"])
    return {"ratio": base["ms_per_step"] / other["ms_per_step"] if diff is None else None,
            "round_ratios": [b / o for b, o in zip(base["round_ms"], other["round_ms"])],
            "tokens_equal": diff is None, "first_difference": diff}


def compare(model: str, dtype: str, batch: int, timed: dict[str, dict]) -> dict:
    """One result row from ``interleaved_decode``'s per-side rows (stock vLLM's among them)."""
    row = {"model": model, "dtype": dtype, "batch": batch,
           "ms": {k: v["ms_per_step"] for k, v in timed.items()},
           "round_ms": {k: v["round_ms"] for k, v in timed.items()},
           "round_s": {k: v["round_s"] for k, v in timed.items()},
           "tokens_stable": {k: v["tokens_stable"] for k, v in timed.items()},
           "vs_vllm": {k: versus(timed[STOCK], v) for k, v in timed.items() if k != STOCK}}
    split = {k: v["forward_round_ms"] for k, v in timed.items() if v.get("forward_round_ms")}
    if split:  # the vLLM sides: each round's step = the model's forward + vLLM's own work
        row["forward_round_ms"] = split
        row["forward_ms"] = {k: statistics.median(v) for k, v in split.items()}
        row["own_ms"] = {k: statistics.median(ms - f for ms, f in zip(timed[k]["round_ms"], v))
                         for k, v in split.items()}
    for side, v in timed.items():
        if side.startswith(GRAPH + "_") and side.endswith("x") and side[len(GRAPH) + 1:-1].isdigit():
            row["capacity"] = {"multiplier": int(side[len(GRAPH) + 1:-1]), **slower(timed[GRAPH], v)}
        if side == BEFORE:
            row["before_after"] = slower(v, timed[GRAPH])
    return row


def slower(base: dict, other: dict) -> dict:
    """``other_ms / base_ms`` (> 1: ``other`` is slower) and whether their tokens are equal."""
    return {"ratio": other["ms_per_step"] / base["ms_per_step"], "tokens_equal": base["tokens"] == other["tokens"]}


class Referee:
    """transformers on the checkpoint at ``path`` in float32 and in bfloat16 (each loaded on first
    use): which side a token difference agrees with, and whether it is a near-tie, one that
    bfloat16 rounding alone can decide (``verdict``)."""

    def __init__(self, path: str) -> None:
        self.path, self.models = path, {}

    def logits(self, dtype: torch.dtype, tokens: list[int]) -> torch.Tensor:
        """The float32 logits ``[T, V]`` at every position of ``tokens``, of the model in ``dtype``."""
        import transformers

        if dtype not in self.models:
            self.models[dtype] = transformers.AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype).eval()
        with torch.inference_mode():
            return self.models[dtype](torch.tensor([tokens])).logits[0].float()

    def verdict(self, prompt: list[int], prefix: list[int], candidates: list[int | None]) -> dict:
        """After ``prompt + prefix``: transformers' float32 choice and its logits of the
        ``candidates``; their gap, and transformers' own bfloat16 error on this request (its
        largest ``|bf16 - fp32|`` logit over the vocabulary, at each of the request's generated
        positions up to this one). ``near_tie``: the gap is within that error, so a bfloat16
        implementation may take either token without computing anything wrong."""
        ref = self.logits(torch.float32, prompt + prefix)
        found = [t for t in candidates if t is not None]
        out = {"argmax": int(ref[-1].argmax()), "logits": {str(t): float(ref[-1, t]) for t in found}}
        if len(found) == 2:
            first = len(prompt) - 1  # the position that predicts the first generated token
            error = float((self.logits(torch.bfloat16, prompt + prefix) - ref)[first:].abs().max())
            gap = abs(float(ref[-1, found[0]] - ref[-1, found[1]]))
            out.update(gap=gap, bf16_error=error, near_tie=gap <= error)
        return out

    def close(self) -> None:
        self.models.clear()
        gc.collect()


def with_referee(row: dict, referee: Referee, prompts: list[list[int]], timed: dict[str, dict]) -> dict:
    """``row`` with transformers' verdict on each differing request's first difference from stock
    vLLM (``differences``) per side, and, where every one is a near-tie, the ratio all the same
    (``ratio_near_ties``: the sides computed the same model up to bfloat16 rounding)."""
    vllm_tokens = timed[STOCK]["tokens"]
    for side, cmp in row["vs_vllm"].items():
        tokens = timed[side]["tokens"]
        if cmp["first_difference"] is None or len(vllm_tokens) != len(tokens):
            continue
        verdicts = []
        for i, pos in request_differences(vllm_tokens, tokens):
            at = lambda seq: seq[pos] if pos < len(seq) else None  # noqa: E731
            pair = [at(vllm_tokens[i]), at(tokens[i])]
            verdicts.append({"request": i, "position": pos, "vllm": pair[0], "side": pair[1],
                             **referee.verdict(prompts[i], vllm_tokens[i][:pos], pair)})
        cmp["differences"] = verdicts
        cmp["near_ties_only"] = all(v.get("near_tie", False) for v in verdicts)
        cmp["ratio_near_ties"] = row["ms"][STOCK] / row["ms"][side] if cmp["near_ties_only"] else None
    return row


def ratio_cell(cmp: dict | None) -> str:
    """A comparison's ratio with the range of its rounds' own ratios; where tokens differ only at
    near-ties, that ratio marked so; else empty."""
    if cmp is None:
        return fmt(None)
    spread = value_range(cmp.get("round_ratios"))
    if cmp["ratio"] is not None:
        return fmt(cmp["ratio"]) + "x" + (f" ({spread})" if spread else "")
    if cmp.get("ratio_near_ties") is not None:
        return fmt(cmp["ratio_near_ties"]) + "x (near-ties" + (f"; {spread})" if spread else ")")
    return fmt(None)


def tokens_cell(row: dict) -> str:
    """Per side, whether its tokens equal stock vLLM's (and our two comparisons' own checks)."""
    parts = []
    for side, cmp in row["vs_vllm"].items():
        d = cmp["first_difference"]
        parts.append(f"{label(side)}: " + ("yes" if d is None else f"no (request {d['request']}, token "
                                            f"{d['position']}" + (", near-ties only)" if cmp.get("near_ties_only")
                                                                  else ")")))
    for key, what in (("capacity", "{m}x = 1x"), ("before_after", "before = after")):
        if key in row and not row[key]["tokens_equal"]:
            parts.append(what.format(m=row[key].get("multiplier")) + ": no")
    return "; ".join(parts)


def render(rows: list[dict]) -> list[str]:
    """The markdown table of ``rows``: each side's ms, the ratios to stock vLLM, our comparisons."""
    sides = list(dict.fromkeys(s for r in rows for s in r["ms"]))
    others = [s for s in sides if s != STOCK and s in (GRAPH, ENGINE)]
    head = ["model", "dtype", "batch"] + [f"{label(s)} ms" for s in sides] + [
        f"vLLM / {label(s)}" for s in others]
    multipliers = sorted({r["capacity"]["multiplier"] for r in rows if "capacity" in r})
    head += [f"{m}x cache / 1x" for m in multipliers] + (
        ["after / before"] if any("before_after" in r for r in rows) else []) + ["tokens equal to vLLM"]
    body = []
    for r in rows:
        cells = [r["model"], r["dtype"], r["batch"]] + [fmt(r["ms"].get(s)) for s in sides]
        cells += [ratio_cell(r["vs_vllm"].get(s)) for s in others]
        cells += [fmt(r["capacity"]["ratio"]) + "x" if r.get("capacity", {}).get("multiplier") == m else fmt(None)
                  for m in multipliers]
        if "after / before" in head:
            cells.append(fmt(r["before_after"]["ratio"]) + "x" if "before_after" in r else fmt(None))
        body.append(cells + [tokens_cell(r)])
    return table(head, body)


def value_range(values: list[float] | None) -> str:
    """``lo-hi`` of per-round ratios, or "" without them."""
    return f"{fmt(min(values))}-{fmt(max(values))}" if values else ""


def render_split(rows: list[dict]) -> list[str]:
    """The vLLM sides' steps split into the model's forward and vLLM's own work (``forward_ms``,
    ``own_ms``) as a table; nothing for rows without the split."""
    split = [r for r in rows if STOCK in r.get("forward_ms", {}) and GRAPH in r.get("forward_ms", {})]
    if not split:
        return []
    head = ["model", "dtype", "batch", "forward: vLLM ms", "vLLM+graph ms", "vLLM / vLLM+graph",
            "vLLM's own work: vLLM ms", "vLLM+graph ms"]
    body = [[r["model"], r["dtype"], r["batch"], fmt(r["forward_ms"][STOCK]), fmt(r["forward_ms"][GRAPH]),
             f"{fmt(r['forward_ms'][STOCK] / r['forward_ms'][GRAPH])}x", fmt(r["own_ms"][STOCK]),
             fmt(r["own_ms"][GRAPH])] for r in split]
    return table(head, body)


def render_floors(rows: list[dict]) -> list[str]:
    """The batch-1 rows' ``floor`` (``vllm_peer.batch_one_floor``) as lines; none without floors."""
    lines = []
    for r in rows:
        f = r.get("floor")
        if f:
            lines.append(f"batch 1 floor, {r['model']} {r['dtype']}: {f['bytes'] / 1e6:.1f} MB a step at "
                         f"{f['read_bytes_per_s'] / 1e9:.1f} GB/s ({f['read_how']}) = {f['floor_ms']:.2f} ms; "
                         f"stock vLLM / floor {f['max_vs_vllm']:.2f}x"
                         + (f" (its rounds {rounds})" if (rounds := value_range(f.get("round_max_vs_vllm"))) else "")
                         + graph_bound(f))
    return lines


def graph_bound(floor: dict) -> str:
    """``floor``'s bound on vLLM+graph (``vllm_peer.with_floor``) as the end of its line; "" without one."""
    if "graph_max_vs_vllm" not in floor:
        return ""
    rounds = value_range(floor.get("round_graph_max_vs_vllm"))
    return (f"; vLLM+graph at most {floor['graph_max_vs_vllm']:.2f}x (vLLM's own work {floor['graph_own_ms']:.2f} ms"
            f" + the floor{f'; its rounds {rounds}' if rounds else ''})")
