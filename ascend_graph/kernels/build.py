"""The native kernels' build: the C sources under ``csrc/`` (``SOURCES``) compiled with the
system C compiler (``$CC``, else ``cc``, else ``gcc``) for this CPU (``-march=native``, with OpenMP
where the compiler has it), and ``csrc/ops.cpp``, their ops' dispatcher kernels, with the C++
compiler (``$CXX``, else ``c++``, else ``g++``) against the running torch's headers, linked into
one shared object. It is kept in ``cache_dir()`` under a key over every source and header, both
compilers, their flags, torch's build and the CPU, and loaded on first use (``_library()``):
loading registers the ``ascend_graph::*`` ops' CPU kernels.

The build runs the widest form this CPU has (``isa()``): AVX512-BF16, else AVX2 and FMA. Where
either compiler is missing, the CPU has neither instruction set, or ``ASCEND_GRAPH_EXPERT_KERNEL=0``,
``available()`` is False and the callers keep their aten forms. Design, forms and measurements:
``docs/cpu-kernels.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings

import torch

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# The C translation units (every ``csrc/*.c``; they include ``csrc/*.h``): what ``_compile`` builds alone.
SOURCES = tuple(sorted(os.path.join(CSRC, name) for name in os.listdir(CSRC) if name.endswith(".c")))
# The ops' dispatcher kernels, linked beside ``SOURCES`` in the library the package loads.
OPS_SOURCE = os.path.join(CSRC, "ops.cpp")


def source_files() -> list[str]:
    """Every file the build reads: the sources and the headers under ``csrc/``, sorted."""
    return sorted(os.path.join(CSRC, name) for name in os.listdir(CSRC) if name.endswith((".c", ".h", ".cpp")))


def cache_dir() -> str:
    """Where built kernels are kept between processes: ``$ASCEND_GRAPH_KERNEL_CACHE``, else
    ``ascend_graph`` under ``$XDG_CACHE_HOME`` (default ``~/.cache``)."""
    return os.environ.get("ASCEND_GRAPH_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ascend_graph")


def _build_key(cc: str, flags: list[str], cxx: str | None = None) -> str:
    """A digest of what the built library depends on: every source and header (name and text),
    the compilers (``cxx``: the C++ one, where the build has ``ops.cpp``) and their flags, torch's
    version, headers and C++ ABI (``ops.cpp`` is compiled against them), and this CPU
    (``-march=native``; a cache directory may be shared between machines)."""
    h = hashlib.sha256()
    for path in source_files():
        with open(path, "rb") as f:
            h.update(repr((os.path.basename(path), f.read())).encode())
    for tool in (cc, cxx) if cxx else (cc,):
        version = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
        h.update(repr((os.path.realpath(tool), version)).encode())
    h.update(repr((flags, platform.machine())).encode())
    if cxx:
        h.update(repr((torch.__version__, torch.__file__, _cxx_flags(), _torch_link_flags())).encode())
    try:
        with open("/proc/cpuinfo") as f:
            h.update(next((line for line in f if line.startswith(("flags", "Features"))), "").encode())
    except OSError:
        h.update(platform.processor().encode())
    return h.hexdigest()[:32]


def _cxx_flags() -> list[str]:
    """``ops.cpp``'s compile flags: torch's headers and C++ ABI (glue code: ``-O1`` builds fastest)."""
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    return ["-O1", "-std=c++20", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{include}", f"-I{os.path.join(include, 'torch', 'csrc', 'api', 'include')}"]


def _torch_link_flags() -> list[str]:
    """The libraries ``ops.cpp`` calls into (the dispatcher, ``at::empty``), found where torch lies."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return [f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]


class KernelBuildWarning(RuntimeWarning):
    """The kernels did not build (the callers keep their aten forms) or built without OpenMP;
    the message names the log that holds the compilers' output."""


def _built(cc: str, cxx: str) -> str | None:
    """The library's path, built by an earlier process (kept in ``cache_dir()``) or now (one
    process at a time per key; the others wait and load it); None where it does not build, with
    OpenMP or without. Each build writes its compilers' commands and output to a log beside the
    library, ``kernels-<key>.log``; a failed build is a ``KernelBuildWarning`` naming it."""
    failed = []
    for openmp in (["-fopenmp"], []):
        flags = ["-O3", "-march=native", *openmp, "-fPIC"]
        path = library = os.path.join(cache_dir(), f"kernels-{_build_key(cc, flags, cxx)}.so")
        with _one_builder(path):
            if not os.path.exists(path):
                log = _log_path(path)
                path = _write_atomically(path, lambda out: _link(cc, cxx, flags, out, log))
                if path and os.path.dirname(log) != os.path.dirname(library):
                    os.unlink(log)  # a temporary log of a build that worked
            if path:
                if failed:
                    warnings.warn(KernelBuildWarning(
                        f"the CPU kernels built without OpenMP (one thread per call): the build with -fopenmp "
                        f"failed; the compilers' output is in {failed[0]}"), stacklevel=2)
                return path
        failed.append(log)
    warnings.warn(KernelBuildWarning(
        f"the CPU kernels did not build with {cc} and {cxx}, so the aten forms run instead; the compilers' "
        f"output is in {' and '.join(failed)}"), stacklevel=2)
    return None


def _log_path(library: str) -> str:
    """Where the build of ``library`` logs its compilers' output: beside it (``.log`` for ``.so``),
    or, where that directory cannot be written, a file of its own in the temporary directory."""
    stem = os.path.splitext(library)[0]
    try:
        os.makedirs(os.path.dirname(stem), exist_ok=True)
        with open(f"{stem}.log", "a"):
            return f"{stem}.log"
    except OSError:
        fd, log = tempfile.mkstemp(prefix=f"{os.path.basename(stem)}-", suffix=".log")
        os.close(fd)
        return log


def _log_run(log, cmd: list[str], returncode: int, output: str) -> bool:
    """Append one command, its output and its exit status to the open ``log``; whether it succeeded."""
    tail = "" if not output or output.endswith("\n") else "\n"
    log.write(f"$ {shlex.join(cmd)}\n{output}{tail}exit status {returncode}\n\n")
    return returncode == 0


@contextlib.contextmanager
def _one_builder(path: str):
    """Held while ``path`` is checked and built: an exclusive lock on ``path.lock`` (none where the
    directory cannot be written: that build goes to a directory of its own)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(f"{path}.lock", "a")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _link(cc: str, cxx: str, flags: list[str], out: str, log: str) -> bool:
    """``SOURCES`` compiled with ``flags`` and ``ops.cpp`` against torch (the two side by side),
    linked into the shared object ``out``; False where any step fails. Every command, its output
    and exit status go to the file ``log`` (written anew)."""
    openmp = [f for f in flags if f == "-fopenmp"]
    c_cmd = [cc, *flags, "-c", *SOURCES]
    ops_cmd = [cxx, *_cxx_flags(), "-c", OPS_SOURCE]
    with tempfile.TemporaryDirectory(prefix="ascend_graph-objects-") as d, open(log, "w") as f:
        ops_cmd += ["-o", os.path.join(d, "ops.o")]
        with open(os.path.join(d, "cc.out"), "w+") as c_out:
            c = subprocess.Popen(c_cmd, cwd=d, stdout=c_out, stderr=subprocess.STDOUT, text=True)
            ops = subprocess.run(ops_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            c.wait()
            c_out.seek(0)
            c_ok = _log_run(f, c_cmd, c.returncode, c_out.read())
        if not (_log_run(f, ops_cmd, ops.returncode, ops.stdout) and c_ok):
            return False
        objects = sorted(os.path.join(d, name) for name in os.listdir(d) if name.endswith(".o"))
        link_cmd = [cxx, "-shared", *openmp, *objects, *_torch_link_flags(), "-o", out]
        done = subprocess.run(link_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return _log_run(f, link_cmd, done.returncode, done.stdout)


def _compile(cc: str, flags: list[str], path: str, sources: tuple[str, ...] = SOURCES) -> str | None:
    """The C ``sources`` alone (no ops: the entry points for ctypes, as the tests
    bind them) built with ``flags`` into ``path``
    (``_write_atomically``); None where they do not compile. The compiler's command and output
    go to ``_log_path(path)``."""
    log = _log_path(path)

    def build(out: str) -> bool:
        cmd = [cc, *flags, *sources, "-o", out]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with open(log, "w") as f:
            return _log_run(f, cmd, done.returncode, done.stdout)

    return _write_atomically(path, build)


def _write_atomically(path: str, build) -> str | None:
    """``build(out)`` into a temporary name, then renamed to ``path`` (a concurrent process never
    loads half a file); where its directory cannot be written, into a temporary directory of its
    own, whose path is returned (the caller loads and removes it). None where ``build`` fails."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    except OSError:
        path = None
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=tempfile.mkdtemp(prefix="ascend_graph-kernel-"))
    os.close(fd)
    if not build(tmp):
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


def cxx_compiler() -> str | None:
    """The system C++ compiler's path: ``$CXX`` (default ``c++``), else ``g++``; None where there is none."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The built kernels, loaded (the ``ascend_graph::*`` ops' CPU kernels registered), or None
    where they cannot be built or this CPU has neither AVX512-BF16 nor AVX2 and FMA."""
    cc, cxx = compiler(), cxx_compiler()
    lib = cc and cxx and _built(cc, cxx)
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
    sources that lack one): then it is left unbound, and
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
ONE_ROW_KERNEL = {"AVX2": True, "AVX512-BF16": True}


@torch.compiler.assume_constant_result  # traced (RoutedExperts.decode), a compile-time choice
def one_row_kernel() -> bool:
    """Whether compiled steps run one-row bf16 products in the kernel here (``ONE_ROW_KERNEL``)."""
    return ONE_ROW_KERNEL.get(isa(), False)
