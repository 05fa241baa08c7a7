"""Compile one DeepSeek decoder layer with its tuple MLA cache; check it against eager, time both.

A ``DecoderLayer`` (latent attention + MoE or dense MLP) decodes one token for each of
``--batch`` sequences that already hold ``--context - 1`` tokens in a paged
``MLACache(kv_c, k_pe)``. The same step runs eagerly and compiled (``torch.compile`` with this
project's backend for the device, caches marked as static inputs) from the same cache state; the
outputs and the cache contents after the step are compared, then both are timed (median).

    python examples/compile_deepseek_layer.py                       # small dims, MoE layer, Inductor
    python examples/compile_deepseek_layer.py --preset v2-lite --layer 0 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from ascend_graph import GraphConfig, MLACacheSpec, allocate_kv_caches, resolve_backend  # noqa: E402
from ascend_graph.attention import build_attention_metadata  # noqa: E402
from ascend_graph.models import DeepseekConfig, RopeScaling  # noqa: E402
from ascend_graph.models.deepseek import DecoderLayer  # noqa: E402
from ascend_graph.models.rope import RotaryEmbedding  # noqa: E402

V2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
               num_attention_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
               n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
               first_k_dense_replace=1, max_position_embeddings=163840, initializer_range=0.02,
               rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096, mscale=0.707,
                                        mscale_all_dim=0.707))
PRESETS = {"small": DeepseekConfig.small, "small-v3": DeepseekConfig.small_v3,
           "v2-lite": lambda: DeepseekConfig(**V2_LITE)}


def build_layer(config: DeepseekConfig, index: int, dtype: torch.dtype) -> DecoderLayer:
    """Layer ``index`` with seeded random weights (matrices normal, norms one)."""
    layer = DecoderLayer(config, index, dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.empty(p.shape).normal_(0.0, config.initializer_range, generator=gen))
            else:
                p.fill_(1.0)
    layer.self_attn.process_weights_after_loading()  # W_UK / W_UV from the kv_b_proj just drawn
    return layer.eval()


def prefilled_step(layer, config, args, dtype):
    """A cache holding ``context - 1`` tokens per sequence, and the inputs of their next decode step."""
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = 1 + args.batch * blocks_per_seq
    cache = allocate_kv_caches([MLACacheSpec(config.kv_lora_rank, config.qk_rope_head_dim, dtype)],
                               num_blocks, args.block_size)[0]
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(args.batch)]
    layout = dict(block_size=args.block_size, num_blocks=num_blocks, max_model_len=args.context,
                  block_table_width=blocks_per_seq)
    rope, gen = RotaryEmbedding(config), torch.Generator().manual_seed(1)
    hidden = lambda t: torch.randn(t, config.hidden_size, generator=gen).to(dtype)  # noqa: E731
    with torch.inference_mode():
        positions, meta = build_attention_metadata(tables, [0] * args.batch, [args.context - 1] * args.batch, **layout)
        layer(hidden(positions.shape[0]), *rope(positions), cache, meta)
        positions, meta = build_attention_metadata(tables, [args.context - 1] * args.batch, [1] * args.batch, **layout)
        return cache, (hidden(args.batch), *rope(positions), cache, meta)


def run_from(cache, saved, step, inputs):
    """Restore the cache to ``saved``, run ``step``; returns the output and the cache after it."""
    for t, s in zip(cache, saved):
        t.copy_(s)
    with torch.inference_mode():
        out = step(*inputs)
    return out, [t.clone() for t in cache]


def median_ms(fn, inputs, rounds: int) -> float:
    times = []
    with torch.inference_mode():
        for _ in range(rounds):
            start = time.perf_counter()
            fn(*inputs)
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="small", help="layer dimensions (default: small)")
    p.add_argument("--layer", type=int, default=1, help="layer index: 0 is dense, >= 1 MoE (default: 1)")
    p.add_argument("--batch", type=int, default=4, help="decode rows (default: 4)")
    p.add_argument("--context", type=int, default=64, help="tokens per sequence after the step (default: 64)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--backend", default="auto", help="GraphConfig backend name (default: auto)")
    p.add_argument("--rounds", type=int, default=30, help="timed calls per mode (default: 30)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype, config = getattr(torch, args.dtype), PRESETS[args.preset]()
    layer = build_layer(config, args.layer, dtype)
    cache, inputs = prefilled_step(layer, config, args, dtype)
    for t in cache:
        torch._dynamo.mark_static_address(t)
    backend = resolve_backend(GraphConfig(enabled=True, backend=args.backend), "cpu")
    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)
    saved = [t.clone() for t in cache]
    start = time.perf_counter()
    graph_out, graph_cache = run_from(cache, saved, compiled, inputs)  # compiles
    compile_s = time.perf_counter() - start
    eager_out, eager_cache = run_from(cache, saved, layer, inputs)
    diff = {"output": (graph_out.float() - eager_out.float()).abs().max().item()}
    for name, g, e in zip(cache._fields, graph_cache, eager_cache):
        diff[name] = (g.float() - e.float()).abs().max().item()
    eager_ms, graph_ms = median_ms(layer, inputs, args.rounds), median_ms(compiled, inputs, args.rounds)
    kind = "MoE" if config.is_moe_layer(args.layer) else "dense MLP"
    print(f"DeepSeek decoder layer {args.layer} ({kind}) of preset {args.preset}, {args.dtype}: "
          f"batch {args.batch}, context {args.context}, cache MLACache(kv_c {tuple(cache.kv_c.shape)}, "
          f"k_pe {tuple(cache.k_pe.shape)})")
    print(f"compile + first run: {compile_s:.1f} s")
    print("graph vs eager max |diff|: " + ", ".join(f"{k} {v:.3g}" for k, v in diff.items()))
    print(f"step time (median of {args.rounds}): eager {eager_ms:.3f} ms, compiled {graph_ms:.3f} ms, "
          f"speed-up {eager_ms / graph_ms:.2f}x")
    return {"diff": diff, "eager_ms": eager_ms, "graph_ms": graph_ms, "compile_s": compile_s}


if __name__ == "__main__":
    main()
