"""The trainer's batch receive path: the next step's batch from the ring, and the wait for it (spin, futex sleep, socket)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

from ..contract import messages
from ..transport.channel import Channel
from ..transport import ring, slots
from . import taking
from ..contract.errors import SidecarFailed, SidecarUnavailable
from .handshake import Session
from .taking import Batch


@dataclasses.dataclass(frozen=True, slots=True)
class Pace:
    """The receive path's timings, given to it (script.client makes them from its constants,
    which tests change there)."""

    spin_s: float
    wait_slice_s: float
    max_wait_slice_s: float
    after_bare_wake_slice_s: float
    torn_retry_s: float


@dataclasses.dataclass
class _Wait:
    """One call's wait for its batch."""

    spun: bool
    slice_s: float
    deadline: float | None = None
    quiet_since: float = 0.0
    torn_since: float | None = None
    seen: int = 0  # `posts` when this process last said it waits
    slept_at: int | None = None  # `posts` when the last futex sleep began


class Receiver:
    """Takes this process's batches from its rank's ring in step order, and wakes the sidecar
    when what it waits for (room in the ring) has happened (slots, rules 1-4)."""

    def __init__(self, session: Session, channel: Channel, taker: taking.Taker, pace: Pace, *,
                 timeout_s: float, heartbeat_s: float, on_welcome: Callable[[messages.Welcome], None],
                 before_wait: Callable[[], None]) -> None:
        self._session = session
        self._channel = channel
        self._taker = taker
        self._pace = pace
        self._timeout_s = timeout_s
        self._heartbeat_s = heartbeat_s
        self._on_welcome = on_welcome
        self._before_wait = before_wait
        self.waiting = False  # this process set the control block's trainer_waiting
        self.waits = 0  # numbers this process's waits in trainer_waiting
        self._woken = 0  # the sidecar's wait (its sidecar_waiting) a `wake` was sent for
        self.spin_next = True
        self.torn_retries = 0

    def new_sidecar(self) -> None:
        """A new control block: this process neither waits nor has woken anyone in it, and
        holds nothing of another sidecar's."""
        self.waiting, self._woken = False, 0
        self._taker.forget_others(self._session.instance)

    def next_batch(self) -> Batch | None:
        """The batch of the session's next step, from the ring; the socket only when it must
        wait. None when the stream ended (or the world drains) before that step."""
        at = self._due()
        if at is None:
            return None
        control, step = at
        index = control.find(step)
        if index is None:  # not posted yet: the wait's loop, which looks first again
            return self._wait_for(self._wait())
        batch = self._take(control, index, step)
        if batch is not None:  # the common case: no wait, no loop
            return batch
        wait = self._wait()
        self._torn(control, index, step, wait)
        return self._wait_for(wait)

    def _due(self) -> tuple[ring.Control, int] | None:
        """(control block, the session's next step) while that step is still to come: None
        once the stream ended, or the world drains, before it."""
        control = self._session.control
        assert control is not None  # set by the first welcome
        step = self._session.next_step
        assert step is not None
        if step >= control.end_step or 0 <= control.drain_at <= step:
            return None
        return control, step

    def _wait(self) -> _Wait:
        # A sidecar slower than the trainer: sleep at once, leave it the CPU.
        return _Wait(spun=not self.spin_next, slice_s=self._pace.wait_slice_s)

    def _wait_for(self, wait: _Wait) -> Batch | None:
        """next_batch once the batch was not there at the first look: look, spin, sleep, look again."""
        try:
            while True:
                at = self._due()
                if at is None:
                    return None
                control, step = at
                index, step = self._look(control, step, wait)
                if index is None:
                    self._idle(control, wait)
                    continue
                batch = self._take(control, index, step)
                if batch is not None:
                    return batch
                self._torn(control, index, step, wait)
        finally:
            if self.waiting and self._session.control is not None:
                self._session.control.trainer_waiting, self.waiting = 0, False

    def _look(self, control: ring.Control, step: int, wait: _Wait) -> tuple[int | None, int]:
        """The slot of `step` (or, in a skip job, of the next step that exists) if posted."""
        index = control.find(step)
        if index is None and not wait.spun:
            index, wait.spun = self._spin(control, step), True
        if index is None:
            # A new value before every sleep, not once per wait: the sidecar wakes once
            # per value, and a wake spent on a bump with no batch for us must not leave
            # the next sleep without one (slots, rule 2).
            self.waits = slots.next_trainer_wait(self.waits)
            control.trainer_waiting, self.waiting = self.waits, True
            wait.seen = control.posts  # after the flag, before the last look (slots, rule 1)
            index = control.find(step, scan=True)  # it may have landed meanwhile
        later = control.find_after(step) if index is None and control.skipping else None
        if later is not None:
            # The sidecar posts in rising order: with a later step in the ring, `step`
            # is there by now if it exists (posted between the two looks), else it
            # does not (the world's epoch ended before it).
            index = control.find(step, scan=True)
            if index is None:
                index, step = later
        return index, step

    def _torn(self, control: ring.Control, index: int, step: int, wait: _Wait) -> None:
        """Torn or stale: the sidecar is still writing it, or wrote it wrong."""
        self.torn_retries += 1
        wait.torn_since = wait.torn_since or time.monotonic()
        if time.monotonic() - wait.torn_since > self._timeout_s:
            raise SidecarFailed(self._taker.why_torn(control, self._session.instance, index, step,
                                                     self._timeout_s))
        time.sleep(self._pace.torn_retry_s)

    def _idle(self, control: ring.Control, wait: _Wait) -> None:
        """No batch yet: read what the socket has, say hello when it is quiet, else sleep a slice."""
        now = time.monotonic()
        if wait.deadline is None:
            wait.deadline, wait.quiet_since = now + self._timeout_s, now
        elif now > wait.deadline:  # answers to heartbeats are no batch
            raise SidecarUnavailable(self._why_no_batch())
        self._before_wait()
        if self._channel.pending():
            message = self._channel.receive(0)
            if isinstance(message, messages.Welcome):
                self._on_welcome(message)
            wait.quiet_since = now  # an `end` or an answer: look at the ring again
            return
        if now - wait.quiet_since > self._heartbeat_s:
            self._session.say_hello()  # a silent sidecar may have restarted: its welcome says so
            wait.quiet_since = now
        if wait.slept_at is not None and wait.seen != wait.slept_at:
            # Woken by a bump with no batch for us: a message ZeroMQ may not have
            # delivered yet (found under load), or a bump of a batch or message already
            # taken. Look at the socket again soon, but go on sleeping on the futex: a
            # wait on the socket alone missed the next batch's wake until the timeout.
            wait.slice_s = self._pace.after_bare_wake_slice_s
        timeout_s = min(wait.slice_s, max(0.0, wait.deadline - now))
        # The sidecar bumps `posts` and wakes this futex when it posts a batch or sends
        # a message; the socket is also looked at between slices (a restarted sidecar).
        wait.slept_at = wait.seen
        control.sleep(ring.POSTS, wait.seen, timeout_s)
        wait.slice_s = min(wait.slice_s * 2, max(self._pace.wait_slice_s, self._pace.max_wait_slice_s))

    def _spin(self, control: ring.Control, step: int) -> int | None:
        """Poll the ring for up to SPIN_S before sleeping on the `posts` futex.

        A sidecar that keeps up usually posts the batch within the spin, and
        the spin saves both sides a sleep and a wake-up. Only after a batch
        that came within SPIN_S: when the sidecar is the slower side (large
        batches), the spin would only take the CPU its copy needs on a small
        machine, so the trainer sleeps at once (make bench, transport). Each
        poll yields the core: on an idle one that returns at once, on a busy
        one the sidecar (or whoever waits for the core) runs first; it halved
        the trainer's CPU per 1 MiB batch at load 10 on 2 cores.
        """
        deadline = time.perf_counter() + self._pace.spin_s
        while time.perf_counter() < deadline:
            index = control.find(step)
            if index is not None:
                return index
            os.sched_yield()  # a process waiting for this core (the sidecar, on a busy machine) runs first
        return None

    def _take(self, control: ring.Control, slot: int, step: int) -> Batch | None:
        """Hand out slot `slot`'s batch of `step`; None (the slot left FILLED) if it is torn or stale."""
        taken = self._taker.take(control, self._session.instance, slot, step)
        if taken is None:
            return None
        columns, rows = taken
        control.acked = step
        self._session.next_step = step + 1
        self._wake_if_due(control)
        epoch, in_epoch = divmod(step, self._session.steps_per_epoch)
        return Batch(columns, epoch=epoch, step=in_epoch, global_step=step, rows=rows)

    def flush_releases(self) -> None:
        """Batches freed since the last call may unblock a waiting sidecar."""
        control = self._session.control
        if control is not None:
            self._wake_if_due(control)

    def _wake_if_due(self, control: ring.Control) -> None:
        """Wake the sidecar once per wait, when what it waits for has happened (slots, rule 3)."""
        waiting = control.sidecar_waiting
        if waiting and slots.wake_due(control, waiting, self._woken):  # `waiting`: the common no at once
            self._woken = waiting
            control.bump(ring.ROOM)
            control.wake(ring.ROOM)

    def _why_no_batch(self) -> str:
        control = self._session.control
        if control is not None and control.sidecar_waiting & ring.Waiting.KIND == ring.Waiting.SLOT:
            held = control.states().count(ring.SlotState.TAKEN)
            return (f"no batch in {self._timeout_s} s: this process still references {held} earlier "
                    f"batches, every slot of the ring ({ring.MAX_SLOTS}); drop the batches (or tensors "
                    "viewing them) you no longer need, or copy what you keep (tensor.clone())")
        return f"no batch from the sidecar in {self._timeout_s} s"
