"""Shared test setup."""

import os

# Inductor's parallel compile workers oversubscribe the 2-core CI machines; compile in-process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
