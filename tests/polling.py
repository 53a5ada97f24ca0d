"""Waiting in tests: poll a condition until it holds (blocking or async), whether a process is still alive, and
stopping one."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path


def wait_for(predicate, timeout: float = 30.0, what: str = "condition", interval: float = 0.1):
    """Poll predicate() until it returns something truthy and return that; AssertionError naming `what` (and the
    last value seen) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")
        time.sleep(interval)


async def wait_for_async(predicate, timeout: float = 5.0, what: str = "condition", interval: float = 0.01):
    """wait_for inside an event loop: the loop keeps running (e.g. a background merge) while it polls."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")
        await asyncio.sleep(interval)


def alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie (a zombie still answers kill(pid, 0))."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"  # the state follows "(comm)", which may hold spaces


def stop(proc: subprocess.Popen | None, timeout: float = 15.0) -> None:
    """Terminate `proc` if it still runs, and kill it if it has not exited after `timeout` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
