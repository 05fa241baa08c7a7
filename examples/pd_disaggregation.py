"""Prefill/decode disaggregation with the Python API: an eager prefill server in a child process,
graph-mode decode here, KV blocks moved by a transfer engine into the decode graphs' static caches.

    python examples/pd_disaggregation.py                        # Mooncake where installed, else gloo
    python examples/pd_disaggregation.py --transport gloo --temperature 0.8

The decode engine registers its tuple caches with the transport before it captures any graph,
so every prompt's blocks land in the very tensors the graphs read. Tokens are checked against a
single-process Engine serving the same requests.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from ascend_graph import GraphConfig  # noqa: E402
from ascend_graph.engine import Engine  # noqa: E402
from ascend_graph.models import named_model  # noqa: E402
from ascend_graph.pd import DecodeEngine, PrefillProcess, resolve_transport  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small", help="'small' (built-in, seeded weights) or a checkpoint directory")
    p.add_argument("--transport", default="auto", choices=["auto", "mooncake", "gloo"])
    p.add_argument("--capture-sizes", default="1,2,4", help="decode batch sizes run as graphs")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the tiny model runs fastest on one thread
    sizes = tuple(int(s) for s in args.capture_sizes.split(","))
    geometry = dict(block_size=16, max_model_len=128, num_blocks=64)
    model, _ = named_model(args.model)
    prompts = [[(5 * i + 7 * j) % model.config.vocab_size for j in range(n)] for i, n in enumerate((3, 21, 9, 40))]
    sampling = dict(temperature=args.temperature, seed=0, ignore_eos=True)
    transport = resolve_transport(args.transport)

    with PrefillProcess(args.model, transport=transport, threads=1, **geometry) as prefill:
        config = GraphConfig(enabled=True, capture_sizes=sizes, max_batch_size=max(sizes))
        engine = DecodeEngine(model, prefill, transport=transport, graph_config=config, max_num_seqs=max(sizes),
                              **geometry)
        try:
            engine.capture()
            tokens = engine.generate(prompts, args.max_new_tokens, **sampling)
            prefill_side = engine.prefill_counters()
        finally:
            engine.close()

    single = Engine(model, graph_config=GraphConfig(enabled=False), max_num_seqs=max(sizes), **geometry)
    expected = single.generate(prompts, args.max_new_tokens, **sampling)
    for prompt, out in zip(prompts, tokens):
        print(f"{len(prompt):>3} prompt tokens -> {out}")
    s, t = engine.runner.stats.to_dict(), engine.stats["transfer"]
    print(f"transport {transport}: {t['transfers']} transfers, {t['bytes']} bytes, time to first token "
          f"{1e3 * t['ttft_mean_s']:.1f} ms mean")
    print(f"decode: graph steps {s['graph_steps']}, eager steps {s['eager_steps_total']}, "
          f"recompiles {s['recompiles']}; prefill side: {prefill_side['released']} released, "
          f"{prefill_side['held']} held")
    print(f"tokens equal to a single-process engine: {tokens == expected}")
    return 0 if tokens == expected else 1


if __name__ == "__main__":
    raise SystemExit(main())
