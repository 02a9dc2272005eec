"""Polling with a deadline: the one way tests wait for something another process or thread does."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(check: Callable[[], Any], timeout: float = 30.0, what: str = "", interval: float = 0.2,
             ignore: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll `check` until it returns something truthy and return that.

    An exception of a type in `ignore` counts as "not yet" (a resource that does not
    exist yet); on timeout an AssertionError names `what` and the last value seen.
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
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what or check} (last: {last!r})")
        time.sleep(interval)
