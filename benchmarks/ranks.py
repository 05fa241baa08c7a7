"""Spawned worker processes a benchmark drives one command at a time, every wait bounded.

Each worker builds one object (``factory(*args)``, e.g. a tensor-parallel rank's model and
runner) and then runs the methods the coordinator asks for, replying with their results; a
worker idle for longer than its ``idle_s`` leaves on its own, so none outlives a coordinator that
died. Workers that form a gloo group keep its sockets on loopback (``GLOO_SOCKET_IFNAME=lo``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable, Iterable


class WorkerError(RuntimeError):
    """A worker raised, died, or did not answer in time; the message carries what is known."""


class Workers:
    """Named worker processes (``specs``: name -> (factory, args)), each serving one object."""

    def __init__(self, specs: dict[str, tuple[Callable[..., Any], tuple]], idle_s: float = 900.0) -> None:
        ctx = mp.get_context("spawn")
        self.replies: mp.Queue = ctx.Queue()
        self.commands = {name: ctx.Queue() for name in specs}
        self.procs = {name: ctx.Process(target=_serve, args=(name, factory, args, self.commands[name],
                                                               self.replies, idle_s), daemon=True)
                      for name, (factory, args) in specs.items()}
        for p in self.procs.values():
            p.start()

    def ready(self, timeout_s: float) -> dict[str, Any]:
        """Wait until every worker has built its object; what each factory's object reported."""
        return self._collect(list(self.procs), timeout_s, "start")

    def ask(self, names: Iterable[str], method: str, *args: Any, timeout_s: float = 300.0) -> dict[str, Any]:
        """``method(*args)`` on the objects of ``names`` (sent to all, then awaited); their results by name."""
        names = list(names)
        for name in names:
            self.commands[name].put((method, args))
        return self._collect(names, timeout_s, method)

    def _collect(self, names: list[str], timeout_s: float, what: str) -> dict[str, Any]:
        deadline, got = time.monotonic() + timeout_s, {}
        while len(got) < len(names):
            try:
                name, status, payload = self.replies.get(timeout=0.5)
            except queue.Empty:
                dead = [n for n in names if n not in got and not self.procs[n].is_alive()]
                if dead or time.monotonic() > deadline:
                    why = (f"{', '.join(dead)} exited (codes {[self.procs[n].exitcode for n in dead]})" if dead
                           else f"no answer within {timeout_s:g} s from {[n for n in names if n not in got]}")
                    raise WorkerError(f"{what}: {why}") from None
                continue
            if status == "error":
                raise WorkerError(f"{what}: worker {name} raised:\n{payload}")
            got[name] = payload
        return got

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask every worker to leave, wait up to ``timeout_s`` in all, then kill the ones left."""
        for name, p in self.procs.items():
            if p.is_alive():
                self.commands[name].put(None)
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(name: str, factory, args: tuple, commands, replies, idle_s: float) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        obj = factory(*args)
        replies.put((name, "ok", getattr(obj, "info", None)))
    except BaseException:  # noqa: BLE001  (reported to the coordinator with its traceback)
        replies.put((name, "error", traceback.format_exc()))
        return
    while True:
        try:
            command = commands.get(timeout=idle_s)
        except queue.Empty:
            command = None
        if command is None:
            break
        method, margs = command
        try:
            replies.put((name, "ok", getattr(obj, method)(*margs)))
        except BaseException:  # noqa: BLE001
            replies.put((name, "error", traceback.format_exc()))
    if hasattr(obj, "close"):
        obj.close()
