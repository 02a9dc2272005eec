"""Polling with a deadline: the one way tests wait for something another process or thread does."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import time
from collections.abc import Callable
from typing import Any


def wait_for(check: Callable[[], Any], timeout: float = 30.0, what: str = "", interval: float = 0.2,
             ignore: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll `check` until it returns something truthy and return that.

    An exception of a type in `ignore` counts as "not yet" (a resource that does not
    exist yet); any other ends the wait (see `running`); on timeout an AssertionError
    names `what` and the last value seen.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except ignore as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(timeout, what or check, last))
        time.sleep(interval)


def wait_for_api(check: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
    """`wait_for` where any exception counts as "not yet": for checks that read a real API
    while what they read is still being created (a 404, a connection refused at start-up)."""
    return wait_for(check, timeout, what, ignore=(Exception,))


async def until(check: Callable[[], Any], timeout: float = 20.0, what: str = "", interval: float = 0.1) -> Any:
    """`wait_for` for a coroutine: polls `check` between `asyncio.sleep`s, so the event loop
    (an operator's handlers, an emulated API, a server) runs while the test waits. `check`
    may return an awaitable (a coroutine that asks that server), which is awaited."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(timeout, what or check, last))
        await asyncio.sleep(interval)


def running(proc: subprocess.Popen[Any]) -> bool:
    """True while `proc` runs: for a wait_for check that must end at once when the process
    it waits on exits, which raises an AssertionError with its status (and its stderr when piped)."""
    code = proc.poll()
    if code is None:
        return True
    err = proc.stderr.read() if proc.stderr is not None else ""
    raise AssertionError(f"{proc.args!r} exited with {code} while a test waited on it: {err!r}")


def _timed_out(timeout: float, what: Any, last: Any) -> str:
    return f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})"
