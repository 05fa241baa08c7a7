"""``ascend_graph::triton_decode_attention`` (``kernels/triton_attention.py``) and the ``triton``
attention backends against float64 oracles (``attention.oracle``) computed from sequences the test
keeps contiguous, written by hand into a paged cache whose every other slot is NaN: a row that
read one token outside its live range would come out NaN.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py
before anything imports triton) on CPU tensors; with one, on the GPU, and ``test_cuda_*`` also runs
the backends against the reference backend, eager and in a CUDA graph. Without triton every test
is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple, Optional

import pytest
import torch

from ascend_graph.attention import DecodeMetadata
from ascend_graph.attention.oracle import dense_attention
from ascend_graph.attention.reference import ReferenceMLA, ReferencePaged
from ascend_graph.attention.triton import TritonMLA, TritonPaged
from ascend_graph.kernels import triton_attention
from ascend_graph.kv_cache import KVCache, MLACache


def _why_not() -> Optional[str]:
    """Why the kernels cannot run here, or None."""
    if not triton_attention.available():
        return "needs triton (not installed)"
    if not torch.cuda.is_available() and not triton_attention.interpreted():
        return "needs a CUDA device or Triton's interpreter (TRITON_INTERPRET=1 before triton's import)"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
S, W = 4, 24  # block size, table width: 96 slots, 3 to 6 tiles, ragged blocks and tiles
KINDS = {"mla": dict(hq=20, hk=1, dk=144, dv=144, r=16), "gqa": dict(hq=8, hk=2, dk=16, dv=24, r=0)}
LENS = {"ones": [1, 1, 1], "boundaries": [S, S + 1, 32, 33, 64, S * W - 1], "full": [S * W, S * W],
        "mixed": [0, 37, 1, 0, S * W, 12]}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}  # of max |oracle|


class Case(NamedTuple):
    q: torch.Tensor  # [B, Hq, Dk]
    q_rope: Optional[torch.Tensor]  # [B, Hq, R]
    k: torch.Tensor  # [N, S, Hk, Dk]; NaN outside the live ranges
    rope: Optional[torch.Tensor]  # [N, S, Hk, R]
    v: torch.Tensor  # [N, S, Hk, Dv]; k itself for MLA
    tables: torch.Tensor  # [B, W] int32
    lens: torch.Tensor  # [B] int32
    scale: float
    oracle: torch.Tensor  # [B, Hq, Dv] float64


def _case(kind: str, dtype: torch.dtype, lens: list[int], seed: int = 0, device: str = DEVICE,
          dead_value: float = float("nan")) -> Case:
    """Distinct random blocks for each row's live tokens; the rest of its table names dead blocks
    (the null block and spares), which like every slot past a row's length hold ``dead_value``."""
    d, gen = KINDS[kind], torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    live = [-(-n // S) for n in lens]
    blocks = sum(live) + 5
    ids = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
    dead = torch.tensor([0, *ids[sum(live):]], dtype=torch.int32)
    tables = dead[torch.randint(0, len(dead), (len(lens), W), generator=gen)]
    dead = lambda width: torch.full((blocks * S, d["hk"], width), dead_value, dtype=dtype)  # noqa: E731
    k, v, rope = dead(d["dk"]), dead(d["dv"]), dead(d["r"])
    q, q_rope = rnd(len(lens), d["hq"], d["dk"]), rnd(len(lens), d["hq"], d["r"])
    oracle, used = torch.zeros(len(lens), d["hq"], d["dv"], dtype=torch.float64), 0
    for i, n in enumerate(lens):
        tables[i, :live[i]] = torch.tensor(ids[used:used + live[i]], dtype=torch.int32)
        used += live[i]
        slots = tables[i, torch.arange(n) // S].long() * S + torch.arange(n) % S
        sk, sr = rnd(n, d["hk"], d["dk"]), rnd(n, d["hk"], d["r"])  # the row's tokens, contiguous
        sv = sk if kind == "mla" else rnd(n, d["hk"], d["dv"])
        k[slots], rope[slots], v[slots] = sk, sr, sv
        if n:
            oracle[i] = dense_attention(torch.cat([q[i:i + 1], q_rope[i:i + 1]], -1), torch.cat([sk, sr], -1), sv,
                                        (d["dk"] + d["r"]) ** -0.5)[0]
    shape = lambda t: t.view(blocks, S, *t.shape[1:]).to(device)  # noqa: E731
    k, v, rope = shape(k), shape(v), shape(rope)
    mla = kind == "mla"
    return Case(q.to(device), q_rope.to(device) if mla else None, k, rope if mla else None, k if mla else v,
                tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device),
                (d["dk"] + d["r"]) ** -0.5, oracle)


def _op(c: Case) -> torch.Tensor:
    return torch.ops.ascend_graph.triton_decode_attention(c.q, c.q_rope, c.k, c.rope, c.v, c.tables, c.lens, c.scale)


def _assert_matches(out: torch.Tensor, c: Case, dtype: torch.dtype) -> None:
    assert out.shape == c.oracle.shape and out.dtype == dtype and out.isfinite().all()
    atol = TOLERANCE[dtype] * c.oracle.abs().max().item()
    torch.testing.assert_close(out.cpu().double(), c.oracle, rtol=0, atol=atol)


@pytest.mark.parametrize("wanted", [1, 256], ids=["one_split", "split_rows"])
@pytest.mark.parametrize("lens", list(LENS), ids=list(LENS))
@pytest.mark.parametrize("kind, dtype", [("mla", torch.float32), ("mla", torch.bfloat16), ("gqa", torch.float32),
                                         ("gqa", torch.bfloat16), ("gqa", torch.float16)], ids=str)
def test_decode_reads_live_blocks_only_and_matches_the_float64_oracle(monkeypatch, kind, dtype, lens, wanted):
    """Rows of length 1, at block and tile boundaries, at full width, and mixed with rows of 0
    (zeros), each row whole in one program or split over several (then merged): finite, and the
    oracle's within the dtype's rounding."""
    splits, num_splits = [], triton_attention.num_splits
    monkeypatch.setattr(triton_attention, "_programs_wanted", lambda device: wanted)
    monkeypatch.setattr(triton_attention, "num_splits", lambda *a: splits.append(num_splits(*a)) or splits[-1])
    c = _case(kind, dtype, LENS[lens])
    out = _op(c)
    assert len(splits) == 1 and (splits[0] > 1) == (wanted > 1)  # both paths are what is tested
    _assert_matches(out, c, dtype)
    assert not out[c.lens.cpu() == 0].any()


def test_decode_takes_int64_tables_and_lengths_and_any_query_strides():
    c = _case("mla", torch.float32, LENS["mixed"], seed=3)
    q = c.q.transpose(0, 1).contiguous().transpose(0, 1)  # [B, H, C] heads outermost in memory
    out = torch.ops.ascend_graph.triton_decode_attention(q, c.q_rope, c.k, c.rope, c.v, c.tables.long(),
                                                         c.lens.long(), c.scale)
    _assert_matches(out, c, torch.float32)


@pytest.mark.parametrize("kind", list(KINDS))
def test_compiled_op_equals_the_op_eager(kind):
    """Through the backends' decode, traced by dynamo and AOTAutograd (the fake's shape) and run."""
    c = _case(kind, torch.bfloat16, LENS["mixed"], seed=1)
    if kind == "mla":  # the backend's own projections around the op: W_UK and W_UV as identities
        eye = torch.eye(c.q.shape[-1], dtype=c.q.dtype, device=c.q.device).expand(c.q.shape[1], -1, -1)
        step = lambda q, qr, k, r, t, n: TritonMLA().decode(q, qr, MLACache(k, r), DecodeMetadata(t, n),  # noqa: E731
                                                            eye, eye, c.scale)
        args = (c.q, c.q_rope, c.k, c.rope, c.tables, c.lens)
    else:
        step = lambda q, k, v, t, n: TritonPaged().decode(q, KVCache(k, v), DecodeMetadata(t, n), c.scale)  # noqa: E731
        args = (c.q, c.k, c.v, c.tables, c.lens)
    eager = step(*args)
    assert torch.equal(eager, _op(c))
    torch._dynamo.reset()
    graph = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)(*args)
    assert torch.equal(graph, eager)
    _assert_matches(graph, c, torch.bfloat16)


def test_bad_arguments_are_refused_by_name_before_anything_runs():
    c = _case("gqa", torch.float32, [5, 9])
    op = torch.ops.ascend_graph.triton_decode_attention
    with pytest.raises(ValueError, match="must be of one dtype"):
        op(c.q.double(), None, c.k, None, c.v, c.tables, c.lens, c.scale)
    with pytest.raises(ValueError, match="Hq a multiple of Hk"):
        op(c.q[:, :3], None, c.k, None, c.v, c.tables, c.lens, c.scale)
    with pytest.raises(ValueError, match="q_rope and rope_cache go together"):
        op(c.q, c.q, c.k, None, c.v, c.tables, c.lens, c.scale)
    with pytest.raises(ValueError, match="block_tables must be int32 or int64"):
        op(c.q, None, c.k, None, c.v, c.tables.float(), c.lens, c.scale)
    if DEVICE == "cpu":  # range checks cost a device sync: CPU tensors only
        with pytest.raises(ValueError, match=r"context_lens must lie in \[0, 96\]"):
            op(c.q, None, c.k, None, c.v, c.tables, c.lens + S * W, c.scale)


def test_triton_backends_run_on_cuda_only_and_come_before_the_fallbacks():
    from ascend_graph.attention import ATTENTION_BACKENDS

    for kind, cls in (("mla", TritonMLA), ("paged", TritonPaged)):
        names = [name for name, _ in ATTENTION_BACKENDS[kind]]
        assert names.index("triton") < names.index("gathered_live") < names.index("reference")
        assert not cls.supports(torch.device("cpu"), torch.bfloat16)
        assert cls.supports(torch.device("cuda"), torch.bfloat16)  # triton imports (else skipped)
        assert not cls.supports(torch.device("cuda"), torch.float64)


_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ascend_graph.kernels import triton_attention as ta, triton_decode as td


def build(fn, dtype, constants, tables="*i32"):
    pointers = dict.fromkeys(["q", "q_rope", "k_cache", "rope_cache", "v_cache", "out"], "*" + dtype)
    pointers.update(tables=tables, ctx_lens="*i32", part_out="*fp32", part_lse="*fp32")
    sig = {n: "constexpr" if n in constants else pointers.get(n, "fp32" if n == "scale_log2" else "i32")
           for n in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, constants), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=4, num_stages=2))
    assert kernel.asm["cubin"], fn.__name__


build(td.decode_partial, "bf16", ta.partial_constants(128, 512, 64, 512, 32, True, False))  # V3's MLA
build(td.decode_merge, "bf16", ta.merge_constants(512, 32))
build(td.decode_partial, "fp16", ta.partial_constants(8, 128, 0, 128, 1, False, False), tables="*i64")  # GQA
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_to_sm90_cubins_without_a_gpu(tmp_path):
    """What the interpreter does not check: Triton's own compile (types, tl.dot shapes, layouts) down
    to ptxas, for DeepSeek-V3's MLA (bf16, split rows, the merge) and GQA (fp16, int64 tables)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _SM90], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_decode(kind: str, dtype: torch.dtype, lens: list[int]):
    """A backend's decode (a function of the backend) on a CUDA case of ``lens``, and the case. Dead
    slots hold zeros: the reference reads the whole table, masked."""
    c = _case(kind, dtype, lens, seed=5, device="cuda", dead_value=0.0)
    cache = MLACache(c.k, c.rope) if kind == "mla" else KVCache(c.k, c.v)
    meta = DecodeMetadata(c.tables, c.lens)
    if kind == "mla":
        eye = torch.eye(c.q.shape[-1], dtype=dtype, device="cuda").expand(c.q.shape[1], -1, -1)
        return (lambda b: b.decode(c.q, c.q_rope, cache, meta, eye, eye, c.scale)), c
    return (lambda b: b.decode(c.q, cache, meta, c.scale)), c


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", list(KINDS))
def test_cuda_kernel_equals_the_reference_backend_and_the_oracle(kind, dtype):
    """The compiled kernel on the GPU: each batch size from 1 (split rows) to 64 (whole rows)."""
    triton_cls, reference_cls = (TritonMLA, ReferenceMLA) if kind == "mla" else (TritonPaged, ReferencePaged)
    for lens in (LENS["mixed"], [S * W], [1 + i % (S * W) for i in range(0, 64 * 7, 7)]):
        decode, c = _cuda_decode(kind, dtype, lens)
        out, reference = decode(triton_cls()), decode(reference_cls())
        _assert_matches(out, c, dtype)
        live = c.lens > 0  # the reference's padded rows read one slot: finite values the runner drops
        torch.testing.assert_close(out[live], reference[live], rtol=0,
                                   atol=2 * TOLERANCE[dtype] * reference.abs().max().item())


@needs_cuda
@pytest.mark.parametrize("kind", list(KINDS))
def test_cuda_graph_replays_follow_the_new_lengths(kind):
    """Inductor with CUDA graphs: one captured call; replays with other lengths (the same shapes)
    equal eager, the kernel's loop bounds read from the lengths tensor on the device."""
    from torch._inductor.utils import run_and_get_code

    from ascend_graph.compile.inductor import InductorBackend

    c = _case(kind, torch.bfloat16, LENS["mixed"], seed=6, device="cuda")
    op = torch.ops.ascend_graph.triton_decode_attention
    step = torch.compile(lambda lens: op(c.q, c.q_rope, c.k, c.rope, c.v, c.tables, lens, c.scale),
                         backend=InductorBackend({"triton.cudagraphs": True}), fullgraph=True, dynamic=False)
    _, code = run_and_get_code(step, c.lens.clone())
    assert "".join(code).count("ascend_graph.triton_decode_attention.default(") == 1
    for lens in ([0, 40, 4, 0, 1, 12], [0, 1, 2, 0, S * W, 5], LENS["mixed"]):  # within each row's live blocks
        lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        eager = op(c.q, c.q_rope, c.k, c.rope, c.v, c.tables, lens, c.scale)
        assert torch.equal(step(lens), eager)
