"""A prefill server in a child process on this machine (``python -m ascend_graph.pd.prefill``).

The control channel's secret is made fresh per run (``auth.new_secret``) and handed to the child
on its stdin (``--secret-stdin``), which it reads once and closes: never on the command line,
which ``ps`` shows to every user, and not in the environment, which every process the child
starts (inductor's compile workers, for one) would inherit and keep in ``/proc/PID/environ``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from .auth import check_secret, new_secret
from .prefill import READY


class PrefillProcess:
    """Starts a prefill server process and waits until it listens; a context manager that stops it.

    The arguments are the server's (``pd/prefill.py``); ``env`` adds environment variables.
    ``address`` is where a ``DecodeEngine`` connects, with ``secret`` (a fresh random one unless
    given). The child's stderr goes to a temporary file whose tail is quoted when it fails to start.
    """

    def __init__(self, model: str = "small", *, dtype: Optional[str] = None, block_size: int = 16,
                 num_blocks: int = 256, max_model_len: int = 512, transport: str = "auto",
                 host: str = "127.0.0.1", max_batch: int = 8, hold_timeout_s: float = 120.0,
                 threads: Optional[int] = None, env: Optional[dict] = None, ready_timeout_s: float = 180.0,
                 secret: Optional[bytes] = None, num_speculative_tokens: int = 0) -> None:
        self.secret = new_secret() if secret is None else check_secret(secret, "secret")
        cmd = [sys.executable, "-m", "ascend_graph.pd.prefill", "--model", model, "--host", host,
               "--block-size", str(block_size), "--num-blocks", str(num_blocks), "--max-model-len",
               str(max_model_len), "--transport", transport, "--max-batch", str(max_batch),
               "--hold-timeout", str(hold_timeout_s), "--secret-stdin"]
        cmd += ["--dtype", dtype] if dtype else []
        cmd += ["--threads", str(threads)] if threads else []
        cmd += ["--num-speculative-tokens", str(num_speculative_tokens)] if num_speculative_tokens else []
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, env={**os.environ, **(env or {})})
        try:
            self.proc.stdin.write(self.secret.hex() + "\n")  # hex: any secret bytes fit one line
            self.proc.stdin.close()
        except OSError:  # the child died at once: _wait_ready quotes its stderr
            pass
        self.host = host
        self.port = self._wait_ready(ready_timeout_s)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _wait_ready(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith(READY):
                    return int(line.split()[1])
                if not line:
                    break
        self.kill()
        raise RuntimeError(f"the prefill process did not start (exit code {self.proc.poll()}): {self.stderr_tail()}")

    def stderr_tail(self, chars: int = 2000) -> str:
        """The end of the child's stderr."""
        self._stderr.seek(0)
        return self._stderr.read()[-chars:]

    def kill(self) -> None:
        """SIGKILL the server at once (fault tests)."""
        if self.alive:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def suspend(self) -> None:
        """SIGSTOP the server: it hangs without closing anything (fault tests)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        """Wait for the server to exit (after a shutdown message), killing it after ``timeout_s``."""
        if self.alive:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> "PrefillProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self._stderr.close()
