"""Shared test setup."""

import atexit
import os
import shutil
import tempfile

# Inductor's parallel compile workers oversubscribe the 2-core CI machines; compile in-process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# A compile cache of the test session's own (its workers and subprocesses share it), removed at
# exit: a step an earlier run compiled or precompiled never turns a test's compile into a load.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ag-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels run in its interpreter (tests/test_triton_attention.py), which
# must be on before anything imports triton (Inductor's modules do): every @triton.jit, triton's
# own included, is defined for the interpreter or for the GPU when it is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist runs a worker per core: each worker's torch (and OpenMP) threads share the cores
# among the workers instead of each taking them all
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest (and steadiest on a shared machine) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
