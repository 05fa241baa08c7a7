"""Speculative decoding with the MTP layer against decoding without it, graph mode, one process.

small-v3 (one MTP layer, seeded random weights) served by engines on the same target weights:
one without speculation, one per ``--num-speculative-tokens`` k (1 and 3: the verify graphs' one
draft, and a draft chain of two more steps), all capturing 1, 8 and 32 requests; decode tokens/s
and ms per step at 1, 8 and 32 requests of ``--prompt-len`` tokens generating ``--new-tokens``
each, the engines taking turns round by round. Each MTP engine runs two drafters: its MTP layer's
own drafts (random weights: almost none accepted, so this is the cost of drafting), and one forced
to the reference's next token after the MTP layer has run (the ceiling: accepted wherever two
requests do not share a (position, token) key), the acceptance (overall and per draft position)
beside each. Tokens must equal the reference's in every run. Also each engine's capture time and
memory, the draft chain's graphs apart.

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


def _engine_capture(engine) -> dict:
    """An engine's capture: its runner's graphs and, with a draft chain, the chain's."""
    stats = engine.runner.stats
    out = {"seconds": round(stats.capture_seconds, 2), "runner_sizes": sorted(stats.capture),
           "memory_bytes": sum(c["memory_bytes"] for c in stats.capture.values())}
    chain = engine.spec.chain if engine.spec else None
    if chain is not None:
        c = chain.stats
        out["chain"] = {"seconds": round(c.capture_seconds, 2), "sizes": sorted(c.capture),
                        "memory_bytes": sum(x["memory_bytes"] for x in c.capture.values())}
    return out


def measure(batches: tuple[int, ...], ks: tuple[int, ...], prompt_len: int, new_tokens: int, rounds: int) -> dict:
    from ascend_graph import Engine
    from ascend_graph.config import GraphConfig
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM

    config, max_len = DeepseekConfig.small_v3(), prompt_len + new_tokens + 8
    sizes = tuple(sorted(set(batches)))
    graph = GraphConfig(enabled=True, backend="inductor", capture_sizes=sizes, max_batch_size=max(sizes))
    engines = {"none": Engine(DeepseekForCausalLM(config), graph_config=graph, max_model_len=max_len)}
    for k in ks:
        model = DeepseekForCausalLM(config, mtp_layers=1)  # the same seed: the same target weights
        forced_drafter(model, max_len)
        engines[k] = Engine(model, graph_config=graph, max_model_len=max_len, num_speculative_tokens=k)
    out = {"model": "small-v3", "prompt_len": prompt_len, "new_tokens": new_tokens, "rounds": rounds,
           "ks": list(ks), "capture": {}, "batches": {}}
    for k, engine in engines.items():
        engine.capture(show_progress=False)
        out["capture"][str(k) if k == "none" else f"k{k}"] = _engine_capture(engine)
    runs = ["none", *((k, name) for k in ks for name in MEASURED)]
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        prompts = [torch.randint(0, config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(b)]
        reference = engines["none"].generate(prompts, new_tokens, ignore_eos=True)
        for k in ks:
            clashes = set_right(engines[k].model, [p + r for p, r in zip(prompts, reference)])
        samples: dict = {run: [] for run in runs}
        accepted, equal = {}, True
        for _ in range(rounds):
            for run in runs:
                engine = engines["none" if run == "none" else run[0]]
                if run != "none":
                    engine.model.drafter.fill_(DRAFTERS[run[1]])
                    s0 = engine.spec.to_dict()
                    each0 = list(engine.spec.stats.accepted_per_position)
                c = engine.counters
                tokens0, seconds0, steps0 = c.decode_tokens, c.decode_seconds, c.decode_steps
                equal &= engine.generate(prompts, new_tokens, ignore_eos=True) == reference
                seconds = c.decode_seconds - seconds0
                samples[run].append(((c.decode_tokens - tokens0) / seconds, 1e3 * seconds / (c.decode_steps - steps0)))
                if run != "none":
                    s1 = engine.spec.to_dict()
                    drafted = s1["drafted_tokens"] - s0["drafted_tokens"]
                    each = [round((a - a0) * run[0] / drafted, 4)  # per verified request row
                            for a, a0 in zip(engine.spec.stats.accepted_per_position, each0)]
                    accepted[run] = (round((s1["accepted_tokens"] - s0["accepted_tokens"]) / drafted, 4), each)
        key = lambda run: run if run == "none" else f"{run[1]}_k{run[0]}"  # noqa: E731
        row = {key(run): {"tokens_per_s": round(statistics.median(s[0] for s in rows), 1),
                          "ms_per_step": round(statistics.median(s[1] for s in rows), 3)} for run, rows in samples.items()}
        for run in runs[1:]:
            row[key(run)].update(acceptance=accepted[run][0], acceptance_per_position=accepted[run][1],
                                 speedup=round(row[key(run)]["tokens_per_s"] / row["none"]["tokens_per_s"], 3))
        out["batches"][str(b)] = {**row, "tokens_equal": equal, "key_clashes": clashes}
        print(f"  {b:>3} requests: none {row['none']['tokens_per_s']} tok/s | " + " | ".join(
            f"{key(r)} {row[key(r)]['tokens_per_s']} tok/s ({row[key(r)]['speedup']}x, acceptance "
            f"{row[key(r)]['acceptance']})" for r in runs[1:]) + f" | tokens equal {equal}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="batches 1 and 8, fewer tokens and rounds")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=None, help="default 32 (quick: 12)")
    p.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[1, 3], metavar="K",
                   help="the draft tokens per step of each MTP engine (default: 1 3)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    batches, rounds = ((1, 8), 2) if args.quick else ((1, 8, 32), 5)
    out = measure(batches, tuple(args.num_speculative_tokens), args.prompt_len,
                  args.new_tokens or (12 if args.quick else 32), rounds)
    out["conditions"] = conditions()
    out["command"] = " ".join(["python -m benchmarks.speculative", *(argv if argv is not None else sys.argv[1:])])
    print(f"wrote {merge_part('speculative', out, args.quick)}")
    return out


if __name__ == "__main__":
    main()
