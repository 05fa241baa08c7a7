"""The kernels' builds (``ascend_graph.kernels.build``): each instruction set's build computes what
the kernel computes (oracle: float64 over the same bfloat16 values, rounded once), whatever this
CPU's native build; the built library is kept for later processes under a key over every source
and header; a failed build is loud, naming the log that holds the compilers' output."""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from ascend_graph import kernels
from test_expert_rows import _assert_one_rounding, _oracle, needs_kernel


@functools.cache
def _scratch() -> str:
    """One directory for this process's shared test builds, removed at exit."""
    d = tempfile.mkdtemp(prefix="ascend_graph-test-build-")
    atexit.register(shutil.rmtree, d, True)
    return d


@pytest.mark.skipif(kernels.compiler() is None, reason="needs a C compiler")
@pytest.mark.parametrize("name", ["vec_avx2.h", "matmul.h", "decode_attention.c"])
def test_the_cache_key_changes_with_every_source_and_header(tmp_path, monkeypatch, name):
    """A later process must not load a build of other sources: editing any one file under
    ``csrc/`` (a header too) changes the key the built library is kept under."""
    csrc = tmp_path / "csrc"
    shutil.copytree(kernels.build.CSRC, csrc)
    monkeypatch.setattr(kernels.build, "CSRC", str(csrc))
    cc, flags = kernels.compiler(), ["-O3", "-march=native"]
    before = kernels.build._build_key(cc, flags)
    with open(csrc / name, "a") as f:
        f.write("\n/* edited */\n")
    assert kernels.build._build_key(cc, flags) != before


@pytest.mark.skipif(kernels.compiler() is None, reason="needs a C compiler")
def test_a_build_without_an_entry_point_is_refused_unless_bound_as_an_older_one(tmp_path):
    """The package binds its build strictly: a build lacking an entry point (here the sources
    without ``decode_attention.c``, as an older revision's) is an AttributeError. Bound as an
    older build (``required=False``) it keeps the entry points it has, and only the missing one
    is the AttributeError."""
    units = tuple(p for p in kernels.SOURCES if os.path.basename(p) != "decode_attention.c")
    path = kernels.build._compile(kernels.compiler(), ["-O3", "-shared", "-fPIC"], str(tmp_path / "older.so"), units)
    assert path is not None
    with pytest.raises(AttributeError, match="decode_attention"):
        kernels.build._bind(ctypes.CDLL(path))
    older = kernels.build._bind(ctypes.CDLL(path), required=False)
    assert older.expert_rows.restype is ctypes.c_int and len(older.kn_rows.argtypes) == 9
    with pytest.raises(AttributeError, match="decode_attention"):
        older.decode_attention


def _fresh_process(script: str, cache: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ASCEND_GRAPH_KERNEL_CACHE": cache}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


@needs_kernel
def test_a_later_process_loads_the_built_kernel_without_compiling(tmp_path):
    """The first process builds the kernel into the cache directory; the next one loads it and
    runs no compiler (a guard on subprocess.run refuses a build)."""
    cache = str(tmp_path / "kernels")
    first = _fresh_process("from ascend_graph import kernels; assert kernels.available()", cache)
    assert first.returncode == 0, first.stderr[-2000:]
    built = sorted(os.listdir(cache))  # the build's log, the library and the lock its build held
    assert len(built) == 3 and built[1].startswith("kernels-") and built[1].endswith(".so"), built
    assert built[0] == f"{built[1][:-3]}.log" and built[2] == f"{built[1]}.lock"
    assert "exit status 0" in open(os.path.join(cache, built[0])).read()
    second = _fresh_process("""
import subprocess
run = subprocess.run
def guarded(cmd, *a, **k):
    assert "-shared" not in cmd, "the kernel was built again"
    return run(cmd, *a, **k)
subprocess.run = guarded
import torch
from ascend_graph import kernels
assert kernels.available()
x, w = torch.ones(3, 40, dtype=torch.bfloat16), torch.ones(7, 40, dtype=torch.bfloat16)
assert (torch.ops.ascend_graph.rows_mm(x, w) == 40).all()
""", cache)
    assert second.returncode == 0, second.stderr[-2000:]
    assert sorted(os.listdir(cache)) == built


@needs_kernel
def test_an_unwritable_cache_directory_still_builds_the_kernel(tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    done = _fresh_process("from ascend_graph import kernels; assert kernels.available()",
                          str(blocker / "kernels"))  # cannot be created: its parent is a file
    assert done.returncode == 0, done.stderr[-2000:]


# The kernel's builds: compiler flags, what ``expert_rows_available`` reports, the CPU flags it runs on.
BUILDS = {
    "avx2": (["-mavx2", "-mfma"], 256, {"avx2", "fma"}),
    "avx512-bf16": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx2", "-mfma"], 512,
                    {"avx512f", "avx512_bf16"}),  # a CPU with avx512_bf16 has bw, vl and dq
}


def build_for(name: str) -> ctypes.CDLL:
    """The kernels' C sources built with ``BUILDS[name]``'s flags and bound, once per process (the
    tests only read a build; skip without a C compiler that takes them)."""
    cc = kernels.compiler()
    if cc is None:
        pytest.skip("needs a C compiler")
    path = _built_for(cc, name)
    if path is None:
        pytest.skip(f"the C compiler does not build for {name} ({' '.join(BUILDS[name][0])})")
    return kernels.build._bind(ctypes.CDLL(path))


@functools.cache
def _built_for(cc: str, name: str) -> str | None:
    out = os.path.join(_scratch(), f"{name}.so")
    return kernels.build._compile(cc, ["-O3", *BUILDS[name][0], "-shared", "-fPIC"], out)


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_each_build_runs_the_form_its_instructions_allow(name):
    """A build for AVX512-BF16 has the AVX-512 kernel, one for AVX2 and FMA the AVX2 kernel. Runs on
    any CPU: ``expert_rows_available`` returns a constant, no vector instruction. (A build whose
    AVX-512 test read ``#ifdef KERNEL`` before anything defined it ran the AVX2 form on every CPU.)"""
    assert build_for(name).expert_rows_available() == BUILDS[name][1]


def test_the_native_build_is_the_widest_form_this_cpu_runs():
    from ascend_graph.runtime import machine

    if kernels.compiler() is None:
        pytest.skip("needs a C compiler")
    flags = set(machine()["cpu_flags"])
    widest = next((bits for _, bits, needs in sorted(BUILDS.values(), key=lambda b: -b[1]) if needs <= flags), 0)
    lib = kernels.build._library()
    assert (lib.expert_rows_available() if lib is not None else 0) == widest


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_each_build_computes_what_the_kernel_computes(name):
    """Each build as it runs on a CPU that has its instructions, whatever the native build here:
    ``expert_rows`` through the forms that build has (one weight row at a time for the fewest rows,
    ``AG_STREAM_ROWS``; AVX-512: tiles to 4 rows, 5-8 pairs, 9 and more wide; AVX2: its tiles at
    every count, part tiles of rows and of weight rows), with K
    tails, ``expert_rows_f32`` likewise (float32 sums: within K * 2^-23 of the sum of |products|), and ``kn_rows`` (interleaved panels, a partial column block, an odd K) within one
    rounding of float64, as the tests above hold the native build. So a machine with AVX512-BF16
    keeps the AVX2 forms tested too (``decode_attention``'s builds:
    ``test_decode_attention.test_each_instruction_set_build_computes_the_same_attention``)."""
    from ascend_graph.runtime import machine

    if not BUILDS[name][2] <= set(machine()["cpu_flags"]):
        pytest.skip(f"needs an x86 CPU with {', '.join(sorted(BUILDS[name][2]))}")
    dll = build_for(name)
    gen = torch.Generator().manual_seed(3)
    for n, k in [(300, 2048), (125, 80), (9, 33), (7, 47)]:
        counts = torch.tensor([1, 2, 3, 0, 4, 5, 8, 12, 40])
        ends = counts.cumsum(0).to(torch.int32)
        w = torch.randn(len(counts), n, k, generator=gen).to(torch.bfloat16)
        x = torch.randn(int(ends[-1]), k, generator=gen).to(torch.bfloat16)
        out = torch.full((x.shape[0], n), float("nan"), dtype=torch.bfloat16)
        assert dll.expert_rows(x.data_ptr(), w.data_ptr(), ends.data_ptr(), out.data_ptr(), len(counts), n, k, 1) == 0
        _assert_one_rounding(out, _oracle(x, w, ends))
        xf, wf = x.float() * 1.5, w.float() * 0.75  # values that are not all bf16
        out = torch.full((x.shape[0], n), float("nan"))
        assert dll.expert_rows_f32(xf.data_ptr(), wf.data_ptr(), ends.data_ptr(), out.data_ptr(), len(counts), n, k,
                                   1) == 0
        exact = _oracle(xf, wf, ends)
        bound = _oracle(xf.abs(), wf.abs(), ends) * k * 2 ** -23  # float32 sums in any order
        assert ((out.double() - exact).abs() <= bound).all()
    for e, rows, k, n in [(3, 5, 65, 80), (2, 16, 512, 512)]:
        x = torch.randn(e, rows, k, generator=gen).to(torch.bfloat16)
        w = torch.randn(e, k, n, generator=gen).to(torch.bfloat16)
        out = torch.full((e, rows, n), float("nan"), dtype=torch.bfloat16)
        assert dll.kn_rows(x.data_ptr(), w.data_ptr(), k * n, out.data_ptr(), e, rows, k, n, 1) == 0
        _assert_one_rounding(out, x.double() @ w.double())


def test_a_failed_build_warns_naming_its_log_which_holds_the_compilers_output(tmp_path, monkeypatch):
    """Compilers that print an error and exit 1 (``$CC`` and ``$CXX`` scripts): the build returns
    None with a KernelBuildWarning naming one log per build key (with and without OpenMP) in the
    kernel cache, and each log holds both compilers' commands, text and exit status."""
    scripts = {}
    for name in ("cc", "cxx"):
        script = tmp_path / f"fake-{name}"
        script.write_text(f'#!/bin/sh\necho "fake-{name}: error: simulated failure of $*" >&2\nexit 1\n')
        script.chmod(0o755)
        scripts[name] = str(script)
    monkeypatch.setenv("CC", scripts["cc"])
    monkeypatch.setenv("CXX", scripts["cxx"])
    monkeypatch.setenv("ASCEND_GRAPH_KERNEL_CACHE", str(tmp_path / "cache"))
    cc, cxx = kernels.build.compiler(), kernels.build.cxx_compiler()
    assert (cc, cxx) == (scripts["cc"], scripts["cxx"])
    with pytest.warns(kernels.build.KernelBuildWarning, match="did not build") as caught:
        assert kernels.build._built(cc, cxx) is None
    logs = re.findall(r"(/\S+\.log)", str(caught[0].message))
    assert len(set(logs)) == 2 and all(os.path.dirname(log) == str(tmp_path / "cache") for log in logs)
    for log, openmp in zip(logs, (True, False)):
        text = open(log).read()
        assert "fake-cc: error: simulated failure of -O3 -march=native" in text
        assert "fake-cxx: error: simulated failure of -O1" in text and text.count("exit status 1") == 2
        assert ("-fopenmp" in text) is openmp
