"""Speculative decoding with the MTP layer against decoding without it, graph mode, one process.

small-v3 (one MTP layer, seeded random weights) served by two engines on the same target weights:
one without speculation, one with ``num_speculative_tokens=1``, both capturing 1, 8 and 32
requests; decode tokens/s and ms per step at 1, 8 and 32 requests of ``--prompt-len`` tokens
generating ``--new-tokens`` each, the engines taking turns round by round. The MTP engine runs two
drafters: its MTP layer's own drafts (random weights: almost none accepted, so this is the cost of
drafting), and one forced to the reference's next token after the MTP layer has run (the ceiling:
accepted wherever two requests do not share a (position, token) key), the acceptance beside each.
Tokens must equal the reference's in every run. Also each engine's capture time and memory.

    TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.speculative [--quick]

The results go under ``speculative`` in ``benchmarks/results/<machine>.json`` (``--quick``: a
temporary file).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import conditions, merge_part  # noqa: E402

DRAFTERS = {"mtp": 0, "right": 1, "wrong": 2, "mixed": 3}  # the values of ``model.drafter``
MEASURED = ("mtp", "right")  # "wrong" costs what "mtp" does with random weights


def forced_drafter(model, max_len: int) -> None:
    """After the MTP layer has run (and written its cache), its draft at position q (token ``after``
    at q + 1) becomes, by ``model.drafter`` (``DRAFTERS``), its own, ``model.right[q, after]``
    (``set_right``), another token, or (mixed) the right one but where q % 5 == 4; its output
    hidden states (a draft chain's next input) stay its own. Tensors of the model: one captured
    graph serves all four."""
    v = model.config.vocab_size
    model.register_buffer("right", torch.zeros(max_len, v, dtype=torch.int64), persistent=False)
    model.register_buffer("drafter", torch.zeros((), dtype=torch.int64), persistent=False)
    draft = model.mtp_draft

    def mtp_draft(after, positions, hidden, kv_caches, meta, rows=None):
        own, out = draft(after, positions, hidden, kv_caches, meta, rows)
        if rows is not None:
            after, positions = after[rows], positions[rows]
        right = model.right[positions, after]
        use_right = (model.drafter == 1) | ((model.drafter == 3) & (positions % 5 != 4))
        forced = torch.where(use_right, right, (right + 1) % v)
        forced = torch.nn.functional.one_hot(forced, v).to(own.dtype) * 100.0
        return torch.where(model.drafter == 0, own, forced), out

    model.mtp_draft = mtp_draft


def set_right(model, sequences: list[list[int]]) -> int:
    """``model.right[q, seq[q + 1]] = seq[q + 2]`` over ``sequences`` (prompt + reference output);
    the first sequence to hold a key keeps it. Returns how many keys another sequence wanted otherwise."""
    model.right.zero_()
    seen, clashes = {}, 0
    for seq in sequences:
        for q in range(len(seq) - 2):
            if seen.setdefault((q, seq[q + 1]), seq[q + 2]) != seq[q + 2]:
                clashes += 1
            else:
                model.right[q, seq[q + 1]] = seq[q + 2]
    return clashes


def measure(batches: tuple[int, ...], prompt_len: int, new_tokens: int, rounds: int) -> dict:
    from ascend_graph import Engine
    from ascend_graph.config import GraphConfig
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM

    config, max_len = DeepseekConfig.small_v3(), prompt_len + new_tokens + 8
    sizes = tuple(sorted(set(batches)))
    graph = GraphConfig(enabled=True, backend="inductor", capture_sizes=sizes, max_batch_size=max(sizes))
    plain = Engine(DeepseekForCausalLM(config), graph_config=graph, max_model_len=max_len)
    model = DeepseekForCausalLM(config, mtp_layers=1)  # the same seed: the same target weights
    forced_drafter(model, max_len)
    spec = Engine(model, graph_config=graph, max_model_len=max_len, num_speculative_tokens=1)
    out = {"model": "small-v3", "prompt_len": prompt_len, "new_tokens": new_tokens, "rounds": rounds,
           "capture": {}, "batches": {}}
    for name, engine in (("none", plain), ("mtp", spec)):
        engine.capture(show_progress=False)
        stats = engine.runner.stats
        out["capture"][name] = {"seconds": round(stats.capture_seconds, 2), "runner_sizes": sorted(stats.capture),
                                "memory_bytes": sum(c["memory_bytes"] for c in stats.capture.values())}
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        prompts = [torch.randint(0, config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(b)]
        reference = plain.generate(prompts, new_tokens, ignore_eos=True)
        clashes = set_right(model, [p + r for p, r in zip(prompts, reference)])
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in ("none", *MEASURED)}
        accepted, equal = {}, True
        for _ in range(rounds):
            for name in samples:
                engine = plain if name == "none" else spec
                if name != "none":
                    model.drafter.fill_(DRAFTERS[name])
                c, s0 = engine.counters, dict(engine.stats.get("speculative") or {})
                tokens0, seconds0, steps0 = c.decode_tokens, c.decode_seconds, c.decode_steps
                equal &= engine.generate(prompts, new_tokens, ignore_eos=True) == reference
                seconds = c.decode_seconds - seconds0
                samples[name].append(((c.decode_tokens - tokens0) / seconds, 1e3 * seconds / (c.decode_steps - steps0)))
                if name != "none":
                    s1 = engine.stats["speculative"]
                    accepted[name] = round((s1["accepted_tokens"] - s0.get("accepted_tokens", 0))
                                           / (s1["drafted_tokens"] - s0.get("drafted_tokens", 0)), 4)
        row = {name: {"tokens_per_s": round(statistics.median(s[0] for s in rows), 1),
                      "ms_per_step": round(statistics.median(s[1] for s in rows), 3)} for name, rows in samples.items()}
        for name in MEASURED:
            row[name]["acceptance"] = accepted[name]
            row[name]["speedup"] = round(row[name]["tokens_per_s"] / row["none"]["tokens_per_s"], 3)
        out["batches"][str(b)] = {**row, "tokens_equal": equal, "key_clashes": clashes}
        print(f"  {b:>3} requests: none {row['none']['tokens_per_s']} tok/s | " + " | ".join(
            f"{n} {row[n]['tokens_per_s']} tok/s ({row[n]['speedup']}x, acceptance {row[n]['acceptance']})"
            for n in MEASURED) + f" | tokens equal {equal}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="batches 1 and 8, fewer tokens and rounds")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=None, help="default 32 (quick: 12)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    batches, rounds = ((1, 8), 2) if args.quick else ((1, 8, 32), 5)
    out = measure(batches, args.prompt_len, args.new_tokens or (12 if args.quick else 32), rounds)
    out["conditions"] = conditions()
    out["command"] = " ".join(["python -m benchmarks.speculative", *(argv if argv is not None else sys.argv[1:])])
    print(f"wrote {merge_part('speculative', out, args.quick)}")
    return out


if __name__ == "__main__":
    main()
