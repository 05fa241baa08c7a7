"""The native kernels' build: the C sources under ``csrc/`` compiled into one shared object with the
system C compiler (``$CC``, else ``cc``, else ``gcc``) for this CPU (``-march=native``, with OpenMP
where the compiler has it), kept in ``cache_dir()`` under a key over every source and header, the
compiler, its flags and the CPU, and loaded through ctypes on first use.

The build runs the widest form this CPU has (``isa()``): AVX512-BF16, else AVX2 and FMA. Where
there is no compiler, neither instruction set, or ``ASCEND_GRAPH_EXPERT_KERNEL=0``, ``available()``
is False and the callers keep their aten forms. Design, forms and measurements:
``docs/cpu-kernels.md``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

import torch

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# The translation units linked into the one shared object: every ``csrc/*.c`` (they include ``csrc/*.h``).
SOURCES = tuple(sorted(os.path.join(CSRC, name) for name in os.listdir(CSRC) if name.endswith(".c")))


def source_files() -> list[str]:
    """Every file the build reads: the sources and the headers under ``csrc/``, sorted."""
    return sorted(os.path.join(CSRC, name) for name in os.listdir(CSRC) if name.endswith((".c", ".h")))


def cache_dir() -> str:
    """Where built kernels are kept between processes: ``$ASCEND_GRAPH_KERNEL_CACHE``, else
    ``ascend_graph`` under ``$XDG_CACHE_HOME`` (default ``~/.cache``)."""
    return os.environ.get("ASCEND_GRAPH_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ascend_graph")


def _build_key(cc: str, flags: list[str]) -> str:
    """A digest of what the built library depends on: every source and header (name and text),
    the compiler and its flags, and this CPU (``-march=native``; a cache directory may be shared
    between machines)."""
    h = hashlib.sha256()
    for path in source_files():
        with open(path, "rb") as f:
            h.update(repr((os.path.basename(path), f.read())).encode())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    h.update(repr((os.path.realpath(cc), version, flags, platform.machine())).encode())
    try:
        with open("/proc/cpuinfo") as f:
            h.update(next((line for line in f if line.startswith(("flags", "Features"))), "").encode())
    except OSError:
        h.update(platform.processor().encode())
    return h.hexdigest()[:32]


def _built(cc: str) -> str | None:
    """The library's path, built by an earlier process (kept in ``cache_dir()``) or now; None
    where it does not compile, with OpenMP or without."""
    for openmp in (["-fopenmp"], []):
        flags = ["-O3", "-march=native", *openmp, "-shared", "-fPIC"]
        path = os.path.join(cache_dir(), f"expert_rows-{_build_key(cc, flags)}.so")
        if os.path.exists(path) or (path := _compile(cc, flags, path)):
            return path
    return None


def _compile(cc: str, flags: list[str], path: str, sources: tuple[str, ...] = SOURCES) -> str | None:
    """Build ``sources`` into ``path`` under a temporary name, then rename (a concurrent process
    never loads half a file); where its directory cannot be written, into a temporary directory of
    its own (the caller loads and removes it). None where it does not compile."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    except OSError:
        path = None
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=tempfile.mkdtemp(prefix="ascend_graph-kernel-"))
    os.close(fd)
    if subprocess.run([cc, *flags, *sources, "-o", tmp], capture_output=True).returncode != 0:
        if path is None:
            shutil.rmtree(os.path.dirname(tmp), ignore_errors=True)
        else:
            os.unlink(tmp)
        return None
    if path is None:
        return tmp
    os.replace(tmp, path)
    return path


def compiler() -> str | None:
    """The system C compiler's path: ``$CC`` (default ``cc``), else ``gcc``; None where there is none."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built or this CPU has neither AVX512-BF16 nor AVX2 and FMA."""
    cc = compiler()
    lib = cc and _built(cc)
    if not lib:
        return None
    dll = ctypes.CDLL(lib)
    if os.path.dirname(lib) != cache_dir():  # a temporary build: the loaded library outlives its file
        shutil.rmtree(os.path.dirname(lib), ignore_errors=True)
    return _bind(dll) if dll.expert_rows_available() else None


# Each entry point's argument types (every one returns an int status): ``expert_rows`` and
# ``expert_rows_f32`` (``csrc/moe.c``; float32: ``csrc/matmul_f32.c``), ``kn_rows`` (``csrc/matmul_kn.c``), ``decode_attention`` (``csrc/decode_attention.c``).
_ENTRIES = (
    ("expert_rows", (ctypes.c_void_p,) * 4 + (ctypes.c_long,) * 3 + (ctypes.c_int,)),
    ("expert_rows_f32", (ctypes.c_void_p,) * 4 + (ctypes.c_long,) * 3 + (ctypes.c_int,)),
    ("kn_rows", (ctypes.c_void_p,) * 2 + (ctypes.c_long, ctypes.c_void_p) + (ctypes.c_long,) * 4 + (ctypes.c_int,)),
    ("decode_attention", (ctypes.c_void_p,) * 8 + (ctypes.c_long,) * 6 + (ctypes.c_void_p,) + (ctypes.c_long,) * 2
     + (ctypes.c_float, ctypes.c_int, ctypes.c_int)),
)


def _bind(dll: ctypes.CDLL, required: bool = True) -> ctypes.CDLL:
    """``dll`` (a build of the sources) with its entry points' argument types set (``_ENTRIES``).
    An entry point the build lacks is an AttributeError, unless ``required`` is False (a build of
    an older revision's sources, ``benchmarks.kernel_builds``): then it is left unbound, and
    calling it is the AttributeError."""
    for name, argtypes in _ENTRIES:
        try:
            entry = getattr(dll, name)
        except AttributeError:
            if required:
                raise
            continue
        entry.restype = ctypes.c_int
        entry.argtypes = list(argtypes)
    return dll


def isa() -> str | None:
    """The instructions the kernel runs here: "AVX512-BF16", "AVX2" (its 256-bit forms), or None
    where it does not run."""
    if not available():
        return None
    return {512: "AVX512-BF16", 256: "AVX2"}[_library().expert_rows_available()]


@torch.compiler.assume_constant_result  # traced, the choice is made once, at compile time
def available() -> bool:
    """Whether ``expert_rows_mm`` runs here (see the module docstring)."""
    return os.environ.get("ASCEND_GRAPH_EXPERT_KERNEL", "1") != "0" and _library() is not None


# Whether compiled steps run one-row bf16 products over row-major weights in the kernel, per build
# (``one_row_kernel``): the dense ones as ``rows_mm`` (``DecodeMatmulPass``) and the routed experts
# of one token as ``expert_rows_mm`` (``RoutedExperts.decode``), instead of Inductor's generated
# reductions. Why per build: docs/cpu-kernels.md ("One row").
ONE_ROW_KERNEL = {"AVX2": True, "AVX512-BF16": False}


@torch.compiler.assume_constant_result  # traced (RoutedExperts.decode), a compile-time choice
def one_row_kernel() -> bool:
    """Whether compiled steps run one-row bf16 products in the kernel here (``ONE_ROW_KERNEL``)."""
    return ONE_ROW_KERNEL.get(isa(), False)
