"""What one call of an ``ascend_graph::*`` kernel op costs beyond its native kernel.

A compiled CPU step calls these ops through the dispatcher (``aoti_torch_call_dispatcher`` in the
C++ wrapper) into their C++ kernels (``kernels/csrc/ops.cpp``: argument checks, output allocation,
the C entry). Timed round robin in one run, per call:

- ``op``: ``torch.ops.ascend_graph.<op>.default`` called from Python (the compiled step's call,
  plus Python's entry into the dispatcher);
- ``bare``: for ``rows_mm`` the native entry alone through ctypes on prepared pointers; for
  ``decode_attention`` its ctypes call (``kernel_builds.attention_run``: index conversion, output
  allocation).

``op / bare`` is what the op adds to its kernel. Before the ops' kernels were C++ (Python bodies
behind ``torch.library.custom_op``) the same cases measured op / bare 3.3-6.7 here.

    TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.op_call_cost [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import torch

from ascend_graph.kernels import build
from benchmarks.common import conditions, interleaved_medians, write_json
from benchmarks.kernel_builds import attention_run


def rows_mm_case(n: int, k: int, dtype: torch.dtype, threads: int) -> dict:
    """``rows_mm`` of one row by an ``[n, k]`` weight."""
    x, w = torch.randn(1, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    out, end = torch.empty(1, n, dtype=dtype), ctypes.c_int32(1)
    entry = getattr(build._library(), "expert_rows_f32" if dtype == torch.float32 else "expert_rows")
    args = (x.data_ptr(), w.data_ptr(), ctypes.addressof(end), out.data_ptr(), 1, n, k, threads)

    def bare(keep=(x, w, out, end)) -> None:  # keep: the tensors behind args' pointers stay alive
        if entry(*args) != 0:
            raise RuntimeError("rows_mm: the native entry failed")

    return {"op": lambda: torch.ops.ascend_graph.rows_mm.default(x, w), "bare": bare}


def attention_case(context: int, dtype: torch.dtype, threads: int, heads: int = 4) -> dict:
    """MLA ``decode_attention`` of one row (``heads`` heads, C 512, R 64, block 16) over ``context`` tokens."""
    s, c, r = 16, 512, 64
    blocks = -(-context // s)
    q, q_pe = torch.randn(1, heads, c, dtype=dtype), torch.randn(1, heads, r, dtype=dtype)
    kv_c, k_pe = torch.randn(blocks + 1, s, 1, c, dtype=dtype), torch.randn(blocks + 1, s, 1, r, dtype=dtype)
    tables = torch.arange(1, blocks + 1, dtype=torch.int32).unsqueeze(0)
    lens = torch.tensor([context], dtype=torch.int32)
    lib = build._library()
    args = (q, q_pe, kv_c, k_pe, kv_c, tables, lens, c ** -0.5)
    return {"op": lambda: torch.ops.ascend_graph.decode_attention.default(*args),
            "bare": lambda: attention_run(lib, *args, 1, heads, threads)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if not build.available():
        raise SystemExit("the native kernels are not available on this machine (build.available() is False)")
    cases = {"rows_mm float32 [1, 256] x [576, 256]": rows_mm_case(576, 256, torch.float32, a.threads),
             "rows_mm float32 [1, 256] x [320, 256]": rows_mm_case(320, 256, torch.float32, a.threads),
             "rows_mm bfloat16 [1, 2048] x [3072, 2048]": rows_mm_case(3072, 2048, torch.bfloat16, a.threads),
             "decode_attention MLA float32, 4 heads, context 32": attention_case(32, torch.float32, a.threads)}
    rows = []
    for name, fns in cases.items():
        us = {k: v * 1e6 for k, v in interleaved_medians(fns, rounds=a.rounds, calls_per_round=200).items()}
        rows.append({"case": name, **{f"{k}_us": round(v, 2) for k, v in us.items()},
                     "op_over_bare": round(us["op"] / us["bare"], 2)})
        print(f"{name:52s} op {us['op']:7.1f} us  bare {us['bare']:7.1f} us  op / bare {us['op'] / us['bare']:.2f}")
    out = {"conditions": conditions(), "threads": a.threads, "rows": rows,
           "command": " ".join(["python -m benchmarks.op_call_cost", *(argv if argv is not None else sys.argv[1:])])}
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
