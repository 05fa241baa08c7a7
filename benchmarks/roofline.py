"""The memory-bandwidth limit: this machine's copy bandwidth and the bytes a decode step must read.

Copy bandwidth is a large ``copy_`` into an already allocated tensor (bytes read + written); a
clone into fresh memory would measure page faults instead. A decode step must read every weight
it uses once (attention, dense MLP, router, shared experts, the routed experts chosen by at least
one row of the batch, the LM head; the embedding rows of the batch) and each row's KV context.
"""

from __future__ import annotations

import statistics
import time

import torch

from ascend_graph.moe.layer import MoE, RoutedExperts


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
        from benchmarks import peak

        self.lib, self.sink = peak.library(), torch.zeros(max(64, 16 * threads))  # one 64-byte line per thread
        if self.lib is not None and self.lib.read_f32(self.sink.data_ptr(), 64, self.sink.data_ptr()) == 0.0:
            self.lib = None  # neither AVX-512 nor AVX2
        self.pool = None
        if self.lib is not None:
            self.src = huge_page_buffer(mib << 20).view(torch.float32)
            self.src.normal_()
            self.how = f"a {mib} MiB float32 read loop ({peak.vector_isa()}, 2 MiB pages, {threads} thread(s))"
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
    from benchmarks.common import interleaved_medians

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
