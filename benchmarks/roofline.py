"""The measured limits a decode step runs against: bandwidth, the matmul rate, the core's peak.

- Bandwidth: a large ``copy_`` into an already allocated tensor (bytes read + written; a clone
  into fresh memory would measure page faults instead), and one core's read-only stream
  (``ReadProbe``: ``peak.c``'s read loop). A decode step must read every weight it uses once
  (attention, dense MLP, router, shared experts, the routed experts chosen by at least one row of
  the batch, the LM head; the embedding rows of the batch) and each row's KV context
  (``step_bytes``).
- Compute: FLOPs of a V2-Lite-slice step (``step_flops``) and the rate of a ``[B, 2048] x
  [2048, 10944]`` bfloat16 matmul (the dense MLP's shape), aten's and the project's ``rows_mm``
  where the compiled step runs it, timed interleaved with the copy probe; above them one core's
  peak multiply-add rate (``peak.c``: 12 independent chains of one vector instruction, built for
  this CPU with ``-march=native``); and for 1 to 64 rows, aten's ``F.linear`` against ``rows_mm``
  streaming the same row-major bfloat16 weights (``few_rows_streams``).

    python -m benchmarks --parts bandwidth compute
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import tempfile
import time

import torch

from ascend_graph import kernels
from ascend_graph.moe.layer import MoE, RoutedExperts
from benchmarks.common import interleaved_medians
from benchmarks.models import v2_lite_slice

PEAK_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peak.c")


def copy_bandwidth(mib: int = 512, reps: int = 15) -> dict:
    """Median bytes/s of ``dst.copy_(src)`` for ``mib`` MiB, counting bytes read + written."""
    src = torch.empty(mib * 2 ** 20 // 4).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page first
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    t = statistics.median(times)
    return {"bytes_per_s": 2 * src.numel() * 4 / t, "mib": mib, "median_s": t, "reps": reps,
            "threads": torch.get_num_threads()}


class CopyProbe:
    """A ``copy_`` of ``mib`` MiB into allocated memory, to time interleaved with other steps."""

    def __init__(self, mib: int = 256) -> None:
        self.src = torch.empty(mib * 2 ** 20 // 4).normal_()
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)
        self.bytes = 2 * self.src.numel() * 4  # read + written

    def __call__(self) -> None:
        self.dst.copy_(self.src)


class ReadProbe:
    """One pass over ``mib`` MiB of float32, bytes read only: the most a read-only stream gets on
    one core, or with ``threads`` > 1 on that many (the buffer cut into equal parts, one thread
    each; ctypes lets go of the GIL). A hand-written loop (``peak.c``'s ``read_f32``: four AVX-512
    or eight AVX2 vector sums, nothing stored) over memory on 2 MiB pages, as the weights lie; where
    that does not build, torch's ``sum`` over ordinary memory on torch's threads (``self.how`` says
    which); the loop reads faster than ``sum`` (``read_bandwidth`` in the suite's results)."""

    def __init__(self, mib: int = 256, threads: int = 1) -> None:
        from ascend_graph.runtime import huge_page_buffer

        self.lib, self.sink = peak_library(), torch.zeros(max(64, 16 * threads))  # one 64-byte line per thread
        if self.lib is not None and self.lib.read_f32(self.sink.data_ptr(), 64, self.sink.data_ptr()) == 0.0:
            self.lib = None  # neither AVX-512 nor AVX2
        self.pool = None
        if self.lib is not None:
            self.src = huge_page_buffer(mib << 20).view(torch.float32)
            self.src.normal_()
            self.how = f"a {mib} MiB float32 read loop ({vector_isa()}, 2 MiB pages, {threads} thread(s))"
            per = self.src.numel() // threads // 1024 * 1024
            self.parts = [self.src[i * per:(i + 1) * per] for i in range(threads)]  # 4 KiB-aligned starts
            if threads > 1:
                from concurrent.futures import ThreadPoolExecutor

                self.pool = ThreadPoolExecutor(threads)
            self.bytes = per * threads * 4
        else:
            self.src = torch.empty(mib * 2 ** 20 // 4).normal_()
            self.how = f"a {mib} MiB float32 `sum`"
            self.bytes = self.src.numel() * 4

    def _read(self, i: int) -> None:
        """Part ``i`` read, its sum into the sink's ``i``-th line."""
        self.lib.read_f32(self.parts[i].data_ptr(), self.parts[i].numel(), self.sink[16 * i:].data_ptr())

    def __call__(self) -> None:
        if self.lib is None:
            self.src.sum()
        elif self.pool is None:
            self._read(0)
        else:
            list(self.pool.map(self._read, range(len(self.parts))))


def read_vs_copy(rounds: int = 9) -> dict:
    """Read-only bandwidth (``ReadProbe``) and copy bandwidth, timed interleaved."""
    read, copy = ReadProbe(), CopyProbe()
    t = interleaved_medians({"read": read, "copy": copy}, rounds=rounds, calls_per_round=2)
    res = {"read_bytes_per_s": read.bytes / t["read"], "copy_bytes_per_s": copy.bytes / t["copy"], "read_how": read.how}
    res["read_over_copy"] = res["read_bytes_per_s"] / res["copy_bytes_per_s"]
    print(f"  read {res['read_bytes_per_s'] / 1e9:.1f} GB/s, copy {res['copy_bytes_per_s'] / 1e9:.1f} GB/s "
          f"(read / copy {res['read_over_copy']:.2f})", flush=True)
    return res


def _experts_used(model: torch.nn.Module, run_step) -> dict[str, int]:
    """Distinct routed experts each MoE layer chooses in one (eager) run of ``run_step``."""
    used, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            def hook(mod, args, out, name=name):
                used[name] = int(out[1].unique().numel())
            hooks.append(module.gate.register_forward_hook(hook))
    try:
        run_step()
    finally:
        for h in hooks:
            h.remove()
    return used


def step_bytes(model: torch.nn.Module, batch: int, context: int, run_step=None,
               experts_used: dict[str, int] | None = None) -> dict:
    """Bytes one decode step of ``batch`` rows at ``context`` tokens must read, by part; the
    distinct experts each MoE layer reads are counted in a run of ``run_step`` or given
    (``experts_used``: MoE module name -> count)."""
    used = experts_used if experts_used is not None else _experts_used(model, run_step)
    weights = routed = 0
    for name, module in model.named_modules():
        if isinstance(module, RoutedExperts):
            per_expert = sum(p[0].numel() * p.element_size() for p in module.parameters())
            routed += used[name.rsplit(".experts", 1)[0]] * per_expert
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        nbytes = p.numel() * p.element_size()
        weights += batch * p.shape[1] * p.element_size() if name.endswith("embed_tokens.weight") else nbytes
    c = model.config
    kv = c.num_hidden_layers * batch * context * (c.kv_lora_rank + c.qk_rope_head_dim) * model.dtype.itemsize
    return {"weights": weights, "routed_experts": routed, "kv": kv, "total": weights + routed + kv,
            "experts_used_per_layer": used}


def batch_one_bytes(model: torch.nn.Module, context: int) -> dict:
    """``step_bytes`` of one row: each MoE layer reads exactly its ``num_experts_per_tok`` experts
    (a top-k of distinct experts), so nothing needs to run; ``model`` may be on the meta device."""
    k = model.config.num_experts_per_tok
    return step_bytes(model, 1, context, experts_used={n: k for n, m in model.named_modules() if isinstance(m, MoE)})


def _build(out_dir: str) -> ctypes.CDLL | None:
    cc = kernels.compiler()
    if cc is None:
        return None
    lib = os.path.join(out_dir, "peak.so")
    done = subprocess.run([cc, "-O2", "-march=native", "-shared", "-fPIC", PEAK_SOURCE, "-o", lib],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return None
    dll = ctypes.CDLL(lib)
    for name in ("fma_f32", "dot_bf16"):
        getattr(dll, name).restype, getattr(dll, name).argtypes = ctypes.c_double, [ctypes.c_long]
    dll.read_f32.restype = ctypes.c_double
    dll.read_f32.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    dll.vector_bits.restype, dll.vector_bits.argtypes = ctypes.c_int, []
    return dll


def peak_library() -> ctypes.CDLL | None:
    """``peak.c`` built and loaded, or None without a C compiler. Built in a temporary directory;
    the loaded library outlives it."""
    with tempfile.TemporaryDirectory() as d:
        return _build(d)


def vector_isa() -> str | None:
    """The vector instructions ``peak.c`` is built with on this CPU: "AVX-512", "AVX2" or None."""
    dll = peak_library()
    return None if dll is None else {512: "AVX-512", 256: "AVX2"}.get(dll.vector_bits())


def _rate(fn, seconds: float = 0.2, runs: int = 5) -> float | None:
    if fn(1) == 0.0:
        return None  # this CPU lacks the instruction
    n = 1 << 16
    while True:  # size a run to about ``seconds``
        t = time.perf_counter()
        fn(n)
        if time.perf_counter() - t > seconds / 4:
            break
        n *= 2
    n = int(n * seconds / max(time.perf_counter() - t, 1e-9))
    best = 0.0
    for _ in range(runs):
        t = time.perf_counter()
        flops = fn(n)
        best = max(best, flops / (time.perf_counter() - t))
    return best


def core_peak() -> dict:
    """``{"fp32_fma_flops_per_s", "bf16_dot_flops_per_s"}`` of one core (None: not measurable here)."""
    dll = peak_library()
    if dll is None:
        return {"fp32_fma_flops_per_s": None, "bf16_dot_flops_per_s": None, "skipped": "no C compiler"}
    return {"fp32_fma_flops_per_s": _rate(dll.fma_f32), "bf16_dot_flops_per_s": _rate(dll.dot_bf16)}


def few_rows_streams(weight_mib: int = 48, k: int = 2048, rows=(1, 2, 3, 4, 8, 16, 24, 32, 64),
                     runs: int = 9) -> list[dict]:
    """GB/s of bfloat16 weight read by an ``r``-row product on one core, median of ``runs``, per
    row count: aten's ``F.linear`` against the project's kernel (``rows_mm``; the MoE's
    ``expert_rows_mm`` is the same kernel; from 5 rows, on AVX2 from 16, it runs its wide forms) on the same
    row-major weights. The compiled step runs its dense products of
    2 to ``ROWS_MM_MAX`` rows in the kernel. The calls take turns over four weights, so each weight
    was last read three calls (three times the last-level cache) before. Empty where the kernel
    does not run here."""
    import torch
    import torch.nn.functional as F

    from ascend_graph.runtime import huge_page_buffer

    if not kernels.available():
        return []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = (weight_mib << 20) // (2 * k)
        buf = huge_page_buffer(4 * n * k * 2).view(torch.bfloat16)
        buf.normal_()
        weights = [buf[i * n * k:(i + 1) * n * k].view(n, k) for i in range(4)]
        found, calls_made = [], 0
        for r in rows:
            x = torch.randn(r, k, dtype=torch.bfloat16)
            calls = {"kernel": lambda w: torch.ops.ascend_graph.rows_mm(x, w), "aten": lambda w: F.linear(x, w)}
            times = {name: [] for name in calls}
            for _ in range(runs):
                for name, call in calls.items():
                    w = weights[calls_made % 4]
                    calls_made += 1
                    t = time.perf_counter()
                    call(w)
                    times[name].append(time.perf_counter() - t)
            rate = {name: n * k * 2 / sorted(ts)[runs // 2] for name, ts in times.items()}
            found.append({"rows": r, "aten_bytes_per_s": rate["aten"], "kernel_bytes_per_s": rate["kernel"]})
        return found
    finally:
        torch.set_num_threads(threads)


def step_flops(batch: int, context: int) -> float:
    """Multiply-add FLOPs (2 per MAC) of one decode step of the V2-Lite slice."""
    c = v2_lite_slice()
    e, h = c.hidden_size, c.num_attention_heads
    attn_w = e * h * c.qk_head_dim + e * (c.kv_lora_rank + c.qk_rope_head_dim) + h * c.v_head_dim * e
    absorbed = 2 * h * (c.qk_nope_head_dim * c.kv_lora_rank + context * (2 * c.kv_lora_rank + c.qk_rope_head_dim)
                        + c.kv_lora_rank * c.v_head_dim)
    dense_mlp = 3 * e * c.intermediate_size
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    shared = 3 * e * c.moe_intermediate_size * c.n_shared_experts + e * c.n_routed_experts
    routed_pairs = c.num_experts_per_tok * 3 * e * c.moe_intermediate_size
    per_row = (c.num_hidden_layers * attn_w + c.first_k_dense_replace * dense_mlp
               + moe_layers * (shared + routed_pairs) + e * c.vocab_size)
    return 2.0 * batch * per_row + batch * c.num_hidden_layers * absorbed


def compute(batches=(1, 8, 32, 64), context: int = 256, rounds: int = 7) -> dict:
    """FLOPs per step and the bf16 matmul rate (FLOP/s) at each batch, with copy bandwidth."""
    from ascend_graph.compile.passes.decode_matmul import runs_rows_mm

    probe, rows = CopyProbe(), []
    w = torch.randn(10944, 2048).to(torch.bfloat16)
    for b in batches:
        x = torch.randn(b, 2048).to(torch.bfloat16)
        fns = {"mm": lambda: torch.nn.functional.linear(x, w), "copy": probe}
        if runs_rows_mm(x, w):
            fns["kernel"] = lambda: torch.ops.ascend_graph.rows_mm(x, w)
        t = interleaved_medians(fns, rounds=rounds, calls_per_round=3)
        rate = 2 * b * w.numel() / t["mm"]
        rows.append({"batch": b, "step_flops": step_flops(b, context), "bf16_matmul_flops_per_s": rate,
                     "copy_bytes_per_s": probe.bytes / t["copy"]})
        if "kernel" in t:
            rows[-1]["bf16_kernel_matmul_flops_per_s"] = 2 * b * w.numel() / t["kernel"]
        kernel_rate = rows[-1].get("bf16_kernel_matmul_flops_per_s")
        print(f"  compute batch {b}: step {rows[-1]['step_flops'] / 1e9:.1f} GFLOP, bf16 matmul "
              f"{rate / 1e9:.1f} GFLOP/s -> {rows[-1]['step_flops'] / rate * 1e3:.0f} ms"
              + (f"; rows_mm {kernel_rate / 1e9:.1f} GFLOP/s" if kernel_rate else ""), flush=True)
    core = core_peak()
    if core.get("bf16_dot_flops_per_s"):
        print(f"  compute: one core's peak bf16 dot-product rate {core['bf16_dot_flops_per_s'] / 1e9:.0f} GFLOP/s, "
              f"float32 FMA {core['fp32_fma_flops_per_s'] / 1e9:.0f} GFLOP/s", flush=True)
    few_rows = few_rows_streams()
    for row in few_rows:
        print(f"  compute: {row['rows']}-row products on plain bf16 weights, aten "
              f"{row['aten_bytes_per_s'] / 1e9:.1f} GB/s, rows_mm {row['kernel_bytes_per_s'] / 1e9:.1f} GB/s",
              flush=True)
    return {"context": context, "rows": rows, "core_peak": core, "few_rows": few_rows}
