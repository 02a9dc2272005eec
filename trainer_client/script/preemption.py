"""The trainer's SIGTERM (preemption, eviction, node drain) turned into a drain of the whole world."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ..contract import messages

log = logging.getLogger(__name__)

SAME_SIGTERM_S = 1.0
"""A SIGTERM this soon after the first is the same one delivered twice, not a second request to
stop at once: a supervisor that signals the container's process group (tini -g, the e2e test
kubelet) reaches the script directly and through `splitfeed run`, which forwards it too."""


class Preemption:
    """Counts SIGTERMs in the handler; the next client call asks the world to drain (docs/agreement.md)."""

    def __init__(self, send: Callable[[messages.Message], None]) -> None:
        self._send = send
        self._sigterm = 0
        self._first_at = 0.0
        self._asked = False
        self._previous: Any = None

    def install(self) -> None:
        """Turn the first SIGTERM into a drain of the whole world.

        Only from the main thread and only over the default action: a trainer
        that handles SIGTERM itself keeps its own handler.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        self._previous = signal.SIG_DFL
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def uninstall(self) -> None:
        """Put back the handler `install` replaced, if its own is still the one."""
        if self._previous is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous)

    def reclaim(self) -> None:
        """Take SIGTERM back from a framework that replaced this handler after `install`
        (Lightning's own calls a collective inside the signal handler: every rank deadlocks)."""
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self._sigterm and now - self._first_at < SAME_SIGTERM_S:
            return  # the same SIGTERM through another path (SAME_SIGTERM_S)
        self._first_at = self._first_at or now
        self._sigterm += 1
        if self._sigterm > 1:  # the second one: the default action, now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def ask_drain(self) -> None:
        """Sockets are not signal-safe: the handler counts, the next client call asks."""
        if self._sigterm and not self._asked:
            self._asked = True
            log.warning("SIGTERM: asking the world to checkpoint at one step and stop")
            self._send(messages.Drain(reason="preempt"))

    def reset(self) -> None:
        """A new world: a SIGTERM seen before may ask again."""
        self._asked = False
