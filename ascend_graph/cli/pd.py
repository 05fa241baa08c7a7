"""``ascend-graph pd-demo``: prefill and decode as two processes on 127.0.0.1 (``ascend_graph.pd``)."""

from __future__ import annotations

import argparse
import time

from ..pd.decode import DecodeEngine
from ..pd.process import PrefillProcess
from ..pd.select import resolve_transport
from .commands import graph_config, load_model, make_engine, workload


def add_pd_demo(p: argparse.ArgumentParser) -> None:
    """The pd-demo flags (beside the model flags)."""
    g = p.add_argument_group("disaggregation")
    g.add_argument("--transport", choices=["auto", "mooncake", "gloo"], default="auto",
                   help="KV transfer engine: auto = Mooncake where installed, else torch.distributed gloo")
    g.add_argument("--kill-prefill-after", type=int, default=None, metavar="N",
                   help="kill the prefill process in the middle of the transfer after N requests have "
                        "landed; the rest are recomputed on the decode side")
    g.add_argument("--num-requests", type=int, default=8, help="requests (default: 8)")
    g.add_argument("--max-new-tokens", type=int, default=16, help="new tokens per request (default: 16)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="requests decoding at once (default: "
                                                                  "the largest capture size)")


def run_pd_demo(args: argparse.Namespace) -> tuple[dict, str, int]:
    """Serve requests with prefill and decode in two processes, and check the tokens.

    A prefill server (eager, its own tuple caches) runs as a child process; this process decodes
    through per-size graphs over static tuple caches registered with the transport before capture.
    Each prompt's blocks move from the prefill caches into the decode caches, then the request
    joins the decode batch. The report: tokens vs a single-process Engine on the same requests,
    transfer bytes and throughput, time to first token, the decode runner's counters (graph
    steps, recompiles), and both sides' free blocks after the run. Exit code 1 when the tokens
    differ, a request failed, a block leaked, or a graph recompiled.
    """
    start = time.perf_counter()
    model, info = load_model(args)
    prompts, budgets = workload(model.config.vocab_size, args.num_requests, args.max_new_tokens, args.max_model_len)
    reference = make_engine(model, args, graph=False, max_num_seqs=args.max_num_seqs).generate(
        prompts, budgets, ignore_eos=True)
    transport = resolve_transport(args.transport)
    geometry = make_engine(model, args, graph=False, max_num_seqs=args.max_num_seqs)
    with PrefillProcess(args.model, dtype=args.dtype, block_size=geometry.block_size, num_blocks=geometry.num_blocks,
                        max_model_len=args.max_model_len, transport=transport, threads=args.threads) as prefill:
        decode = DecodeEngine(model, prefill, transport=transport, graph_config=graph_config(args, True),
                              block_size=geometry.block_size, max_model_len=args.max_model_len,
                              max_num_seqs=args.max_num_seqs or max(args.capture_sizes), num_blocks=geometry.num_blocks,
                              kill_prefill_after=args.kill_prefill_after,
                              max_descriptors=1 if args.kill_prefill_after is not None else 512)
        try:
            decode.capture(show_progress=not args.no_progress)
            free_before = decode.blocks.num_free
            tokens = decode.generate(prompts, budgets, ignore_eos=True, show_progress=not args.no_progress)
            prefill_side = decode.prefill_counters()
        finally:
            decode.close()
    stats = decode.runner.stats.to_dict()
    result = {"command": "pd-demo", "model": info, "transport": transport, "prompts": prompts,
              "max_new_tokens": budgets, "tokens": tokens, "reference_tokens": reference,
              "tokens_match": tokens == reference, "failures": {str(k): v for k, v in decode.failures.items()},
              "transfer": decode.stats["transfer"], "decode_stats": stats, "prefill_side": prefill_side,
              "decode_free_blocks": {"before": free_before, "after": decode.blocks.num_free},
              "killed_prefill_after": args.kill_prefill_after, "seconds": round(time.perf_counter() - start, 1)}
    leak = free_before != decode.blocks.num_free or (prefill_side is not None and prefill_side["held"])
    ok = result["tokens_match"] and not decode.failures and not leak and stats["recompiles"] == 0
    return result, format_pd_demo(result), 0 if ok else 1


def format_pd_demo(r: dict) -> str:
    """The pd-demo's report."""
    t, s, p = r["transfer"], r["decode_stats"], r["prefill_side"]
    blocks = r["decode_free_blocks"]
    lines = [f"ascend-graph pd-demo: {len(r['prompts'])} requests, prefill and decode in two processes, "
             f"transport {r['transport']}",
             f"  model                {r['model']['source']}",
             f"  tokens == single-process Engine: {'yes' if r['tokens_match'] else 'NO'}"
             + (f"; failed requests: {r['failures']}" if r["failures"] else ""),
             f"  transferred          {t['transfers']} requests, {t['bytes']} bytes in {t['seconds']:.4f} s "
             f"({t['gib_per_s']:.3f} GiB/s, {t['descriptors']} descriptors in {t['batches']} batches)",
             f"  time to first token  mean {_ms(t['ttft_mean_s'])}, max {_ms(t['ttft_max_s'])}",
             f"  recomputed here      {t['recomputed']}" + (f" (errors: {t['errors']})" if t["errors"] else ""),
             f"  leases               {t['leases_expired']} pulls discarded here (lease expired)"
             + ("" if p is None else f"; prefill side: {p['expired']} expired, {p['late_releases']} late releases"),
             f"  control channel      {t['refused_messages']} messages refused here"
             + ("" if p is None else f"; prefill side: {p['refused_messages']} messages, "
                                     f"{p['refused_connections']} connections refused"),
             f"  decode runner        {s['graph_steps']} graph steps, {sum(s['eager_steps'].values())} eager "
             f"steps, {s['recompiles']} recompiles",
             f"  decode free blocks   {blocks['before']} before, {blocks['after']} after",
             f"  prefill side         " + ("gone (killed)" if p is None else
                                           f"{p['prefilled']} prefilled, {p['released']} released, {p['held']} held, "
                                           f"{p['free_blocks']} of {p['num_blocks'] - 1} blocks free"),
             f"finished in {r['seconds']:.1f} s"]
    return "\n".join(lines)


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f} ms"
