"""Shared test setup."""

import os

# Inductor's parallel compile workers oversubscribe the 2-core CI machines; compile in-process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest (and steadiest on a shared machine) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
