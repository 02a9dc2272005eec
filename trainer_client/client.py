"""StreamClient: what a training script iterates (the trainer-side contract).

    client = StreamClient()
    for batch in client:             # column name -> torch.Tensor (numpy without torch)
        ...
        if client.checkpoint_requested:
            step = client.checkpoint()

Batches are mapped from the sidecar's ring without a copy. A slot goes back to
the sidecar only when nothing the trainer got from it is referenced any more:
every array handed out is a view of one per-batch root array, and a weakref
callback on that root frees the slot. Acknowledgements (the consumer commit
behind checkpoints), slot states and "I am waiting" flags live in shared
memory; a side that must wait sleeps on a futex in the control block and
its peer wakes it with one system call (the rules are in `slots`), so no
ZeroMQ message moves per batch. The trainer polls the ring for SPIN_S
before it sleeps when its last batch came that quickly; ZeroMQ carries the
handshake, checkpoints and errors.

Holding every slot's batch (ring.MAX_SLOTS) while asking for another can never
be served; after `timeout_s` that is an error that says so. A slot whose
(step, sequence) marks do not match the control block (a torn or stale write)
is looked at again until they do, and never handed out; one that stays torn
for `timeout_s` is a SidecarFailed.

Either side may restart: the client says `hello` with the next global step it
expects, so a new sidecar continues exactly there, and a new trainer process
(which sends no step) continues after the last batch its predecessor received.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, TypeVar

import zmq

from . import contract, counters, membership, messages, ring, slots, taking
from .taking import Batch as Batch
from .errors import CheckpointError, ProtocolError, SidecarFailed, SidecarUnavailable

log = logging.getLogger(__name__)

SPIN_S = 200e-6
"""How long the trainer polls the ring for its next batch before it sleeps."""

WAIT_SLICE_S = 0.01
"""A trainer asleep on the ring's `posts` futex first looks at its socket after this long (a new sidecar)."""

MAX_WAIT_SLICE_S = 0.1
"""The slices double up to this during one long wait: each look costs the trainer CPU, and the
sidecar wakes the futex itself when it sends the trainer anything (an error, the end)."""

AFTER_BARE_WAKE_SLICE_S = 0.001
"""After a wake that brought no batch, the slices start again from this short one.

Such a wake is a message on its way (the sidecar bumps `posts` after it sends; ZeroMQ's
I/O threads may hand the message over later, and the trainer looks at its socket between
slices) or a bump of something this trainer already took (`_send` bumps after its message,
which the trainer may have read; `slots.post` bumps after FILLED, and the trainer may have
taken the batch). It cannot tell which, so it keeps sleeping on the futex, where the next
batch's wake reaches it, and looks at its socket soon and then less and less often."""

TORN_RETRY_S = 200e-6
"""How long the trainer waits before looking again at a slot whose marks do not match."""

_Answer = TypeVar("_Answer", messages.Checkpointed, messages.Committed)


class StreamClient:
    """Connects to this rank's sidecar and yields its batches in order.

    `total_steps` (epochs x `steps_per_epoch`) is the grid, not a promise: under
    onTransformError=skip/warn an epoch may end early, its steps are absent, and
    the iteration ends after fewer batches (docs/preprocessing.md, "Bad rows").
    """

    def __init__(
        self,
        socket_dir: str | os.PathLike[str] | None = None,
        local_rank: int | None = None,
        *,
        timeout_s: float = 300.0,
        heartbeat_s: float = 1.0,
        as_tensors: bool = True,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        directory = socket_dir or os.environ.get(contract.SOCKET_DIR_ENV)
        if not directory:
            raise SidecarUnavailable(
                "no sidecar socket directory: set SPLITFEED_SOCKET_DIR "
                "(the operator and `splitfeed local` do this for you)"
            )
        self._dir = Path(directory)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0") if local_rank is None else local_rank)
        self._timeout_s = timeout_s
        self._heartbeat_s = heartbeat_s
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.IDENTITY, f"t{self.local_rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode())
        self._sock.connect(f"ipc://{self._dir / messages.SOCKET_NAME}")
        self._inbox: collections.deque[messages.Message] = collections.deque()
        self._taker = taking.Taker(self._dir, self.local_rank, as_tensors=as_tensors)
        self._control: ring.Control | None = None
        self._waiting = False  # this process set the control block's trainer_waiting
        self._waits = 0  # numbers this process's waits in trainer_waiting
        self._woken = 0  # the sidecar's wait (its sidecar_waiting) a `wake` was sent for
        self._spin_next = True
        self.torn_retries = 0
        """Times a slot's marks did not match and the slot was looked at again (tests read it)."""
        self._instance = ""
        self._next_step: int | None = None  # None until the first welcome: "continue"
        self._ended = False
        self._prepared: int | None = None  # step of the last checkpoint(), until committed
        self._sigterm = 0
        self._drain_asked = False
        self._previous_sigterm: Any = None
        self.drained = False
        """The world is draining and this rank's checkpoint was of the drain step: stop after saving."""
        self.world_epoch = int(os.environ.get(contract.WORLD_EPOCH_ENV, "0") or 0)
        """The world this process trains in (SPLITFEED_WORLD_EPOCH; `rejoin` moves it on)."""
        self.stats = counters.Stats(counters.stats_path(self.world_epoch))
        try:
            self._welcome(self._hello())
            self._adopt_world()
        except BaseException:
            self._sock.close(linger=0)
            raise
        self._handle_sigterm()

    # -- public API -----------------------------------------------------------

    @property
    def checkpoint_requested(self) -> bool:
        """The world agreed to checkpoint after the batch this rank just took.

        True on the same global step on every rank of the world (the sidecars
        agree on it before that batch is published; docs/agreement.md), so a
        synchronous trainer needs no collective of its own to act on it.
        """
        control, step = self._control, self._next_step
        if control is None or step is None:
            return False
        at = control.checkpoint_at
        return at >= 0 and step == at and self._prepared != at and not self.drained

    def __iter__(self) -> StreamClient:
        return self

    def __next__(self) -> Batch:
        self._flush_releases()
        self._commit_implicitly()
        self._ask_drain_on_sigterm()
        if self._ended or self.drained:
            self.stats.write(final=True)
            raise StopIteration
        started = time.perf_counter()
        batch = self._next_batch()
        if batch is None:
            self.stats.write(final=True)
            raise StopIteration
        waited = time.perf_counter() - started
        self._spin_next = waited < SPIN_S  # the last batch came within a spin: this one likely will too
        self.stats.record(batch, waited)
        return batch

    def _next_batch(self) -> Batch | None:
        """The batch of `_next_step`, from the ring; the socket only when it must wait."""
        deadline: float | None = None
        torn_since: float | None = None
        spun = not self._spin_next  # a sidecar slower than the trainer: sleep at once, leave it the CPU
        slice_s = WAIT_SLICE_S
        slept_at: int | None = None  # `posts` when the last futex sleep began
        try:
            while True:
                control = self._control
                assert control is not None  # set by the first welcome
                step = self._next_step
                assert step is not None
                if step >= control.end_step or 0 <= control.drain_at <= step:
                    self._ended = True
                    return None
                index = control.find(step)
                if index is None and not spun:
                    index, spun = self._spin(control, step), True
                if index is None:
                    # A new value before every sleep, not once per wait: the sidecar wakes once
                    # per value, and a wake spent on a bump with no batch for us must not leave
                    # the next sleep without one (slots, rule 2).
                    self._waits = slots.next_trainer_wait(self._waits)
                    control.trainer_waiting, self._waiting = self._waits, True
                    seen = control.posts  # after the flag, before the last look (slots, rule 1)
                    index = control.find(step, scan=True)  # it may have landed meanwhile
                later = control.find_after(step) if index is None and control.skipping else None
                if later is not None:
                    # The sidecar posts in rising order: with a later step in the ring, `step`
                    # is there by now if it exists (posted between the two looks), else it
                    # does not (the world's epoch ended before it).
                    index = control.find(step, scan=True)
                    if index is None:
                        index, step = later
                if index is not None:
                    batch = self._take(control, index, step)
                    if batch is not None:
                        return batch
                    # Torn or stale: the sidecar is still writing it, or wrote it wrong.
                    self.torn_retries += 1
                    torn_since = torn_since or time.monotonic()
                    if time.monotonic() - torn_since > self._timeout_s:
                        raise SidecarFailed(self._taker.why_torn(control, self._instance, index, step, self._timeout_s))
                    time.sleep(TORN_RETRY_S)
                    continue
                now = time.monotonic()
                if deadline is None:
                    deadline, quiet_since = now + self._timeout_s, now
                elif now > deadline:  # answers to heartbeats are no batch
                    raise SidecarUnavailable(self._why_no_batch())
                self._ask_drain_on_sigterm()
                if self._inbox or self._sock.poll(0):
                    message = self._receive_raw(0)
                    if isinstance(message, messages.Welcome):
                        self._welcome(message)
                    quiet_since = now  # an `end` or an answer: look at the ring again
                    continue
                if now - quiet_since > self._heartbeat_s:
                    self._say_hello()  # a silent sidecar may have restarted: its welcome says so
                    quiet_since = now
                if slept_at is not None and seen != slept_at:
                    # Woken by a bump with no batch for us: a message ZeroMQ may not have
                    # delivered yet (found under load), or a bump of a batch or message already
                    # taken. Look at the socket again soon, but go on sleeping on the futex: a
                    # wait on the socket alone missed the next batch's wake until the timeout.
                    slice_s = AFTER_BARE_WAKE_SLICE_S
                timeout_s = min(slice_s, max(0.0, deadline - now))
                # The sidecar bumps `posts` and wakes this futex when it posts a batch or sends
                # a message; the socket is also looked at between slices (a restarted sidecar).
                slept_at = seen
                control.sleep(ring.POSTS, seen, timeout_s)
                slice_s = min(slice_s * 2, max(WAIT_SLICE_S, MAX_WAIT_SLICE_S))
        finally:
            if self._waiting and self._control is not None:
                self._control.trainer_waiting, self._waiting = 0, False

    @staticmethod
    def _spin(control: ring.Control, step: int) -> int | None:
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
        deadline = time.perf_counter() + SPIN_S
        while time.perf_counter() < deadline:
            index = control.find(step)
            if index is not None:
                return index
            os.sched_yield()  # a process waiting for this core (the sidecar, on a busy machine) runs first
        return None

    def checkpoint(self) -> int:
        """Phase one: persist this rank's data position; returns the global steps completed.

        The position is that of the last batch this iterator returned (the
        consumer commit), never what the sidecar has prefetched. Save the model
        for the returned step, then `commit(step)`: only committed steps are
        resumed, so a crash in between never leaves a data position without
        its model.
        """
        step = self._next_step or 0
        reply = self._request(messages.Checkpoint(step), messages.Checkpointed)
        self._prepared = step
        self.drained = reply.drained
        return step

    def commit(self, step: int | None = None) -> None:
        """Phase two: the model for `step` (default: the last checkpoint) is saved.

        Iterating on, or `close()`, commits the last checkpoint too: a loop that
        saves its model right after `checkpoint()` is correct either way.
        """
        if step is None:
            step = self._prepared
        if step is None or step != self._prepared:
            raise CheckpointError(f"commit of step {step}, but the last checkpoint() was of step {self._prepared}")
        self._request(messages.Commit(step), messages.Committed)
        self._prepared = None

    @property
    def world(self) -> membership.World:
        """The world this process trains in, from its environment (which `rejoin` updates):
        what `membership.init_process_group` makes the process group of."""
        env = os.environ
        local_world = int(env.get(contract.LOCAL_WORLD_SIZE, "1") or 1)
        world_size = int(env.get(contract.WORLD_SIZE, "1") or 1)
        return membership.World(
            epoch=self.world_epoch, state=membership.SERVING,
            rank=int(env.get(contract.RANK, "0") or 0) - int(env.get(contract.LOCAL_RANK, "0") or 0),
            world_size=world_size, replicas=max(1, world_size // local_world),
            master_addr=env.get(contract.MASTER_ADDR, "127.0.0.1"),
            master_port=int(env.get(contract.MASTER_PORT_ENV, str(contract.MASTER_PORT))),
            resume_step=self.resume_step)

    def rejoin(self, timeout_s: float = 300.0) -> membership.World | None:
        """After this rank drained: the world it trains in next, or None to stop.

        The in-place way to follow an in-place rescale (docs/agreement.md, "Changing the
        world in place"): the pod stays, the world around it changes. Waits for the
        sidecar to start the next world, sets this process's `RANK`, `WORLD_SIZE`,
        `MASTER_PORT` and `SPLITFEED_WORLD_EPOCH` as a new pod would have them, and
        connects to it; iterating goes on from the drain step. The trainer then makes its
        process group again for the returned world and wraps its model anew (README,
        "Rescaling in place"). None when no world follows for this rank: the job ended, a
        scale-down left this pod out, or the world is replaced by new pods.
        """
        if not self.drained:
            return None
        world = membership.next_world(self._dir, after=self.world_epoch, timeout_s=timeout_s)
        if world is None:
            return None
        os.environ.update(membership.world_env(dict(os.environ), world))
        self.world_epoch = world.epoch
        self.stats.write(final=True)
        self.stats = counters.Stats(counters.stats_path(world.epoch))
        self.drained = self._ended = self._drain_asked = False
        self._prepared = self._next_step = None
        self._inbox.clear()
        self._welcome(self._hello(stale=self._instance))
        self._adopt_world()
        return self.world

    def _commit_implicitly(self) -> None:
        if self._prepared is not None:
            self.commit(self._prepared)

    def _request(self, request: messages.Checkpoint | messages.Commit, answer: type[_Answer]) -> _Answer:
        """Send `request` and wait for its `answer` (of the same step); an error reply raises CheckpointError."""
        self._sock.send(request.encode())
        step = request.step
        deadline = time.monotonic() + self._timeout_s
        held: list[messages.Message] = []
        try:
            while time.monotonic() < deadline:
                message = self._receive_raw(self._heartbeat_s)
                if message is None:
                    continue
                if isinstance(message, answer) and message.step == step:
                    return message
                if isinstance(message, messages.Error):
                    raise CheckpointError(message.message)
                held.append(message)
            raise CheckpointError(f"no answer to {request.kind} of step {step} in {self._timeout_s} s")
        finally:
            self._inbox.extendleft(reversed(held))

    # -- SIGTERM: preemption, eviction, node drain -------------------------------------

    def _handle_sigterm(self) -> None:
        """Turn the first SIGTERM into a drain of the whole world (docs/agreement.md).

        Only from the main thread and only over the default action: a trainer
        that handles SIGTERM itself keeps its own handler.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        self._previous_sigterm = signal.SIG_DFL
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self._sigterm += 1
        if self._sigterm > 1:  # the second one: the default action, now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _ask_drain_on_sigterm(self) -> None:
        """Sockets are not signal-safe: the handler counts, the next client call asks."""
        if self._sigterm and not self._drain_asked:
            self._drain_asked = True
            log.warning("SIGTERM: asking the world to checkpoint at one step and stop")
            self._sock.send(messages.Drain(reason="preempt").encode())

    def close(self) -> None:
        if self._sock.closed:
            return
        if self._previous_sigterm is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        try:
            self._commit_implicitly()
        except (CheckpointError, SidecarFailed, SidecarUnavailable) as exc:
            log.error("the last checkpoint was not committed: %s", exc)
        self.stats.write(final=True)
        try:
            self._sock.send(messages.Bye().encode(), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._sock.close(linger=100)

    def __enter__(self) -> StreamClient:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self._prepared = None  # the model may not be saved: commit nothing
        self.close()

    # -- handshake --------------------------------------------------------------

    def _adopt_world(self) -> None:
        """Take the world the sidecar serves (trainer_client.membership) where this process's
        environment says an older one: a process started before its world was known (a new
        pod of an in-place scale-up imports while the old world drains) trains in the world
        it was welcomed into. Before `init_process_group`, which reads the environment."""
        world = membership.read(self._dir)
        if world is not None and world.state in (membership.SERVING, membership.CHANGING) and (
                world.epoch > self.world_epoch or world.world_size != self.world_size):
            os.environ.update(membership.world_env(dict(os.environ), world))
            self.world_epoch = world.epoch
        membership.mark_trained(self._dir, self.local_rank, self.world_epoch)

    def _hello(self, stale: str | None = None) -> messages.Welcome:
        """Send hello until a welcome arrives; the sidecar may be (re)starting. A welcome from
        the sidecar instance `stale` (the world before, answering a hello sent while it still
        served) is not an answer."""
        deadline = time.monotonic() + self._timeout_s
        membership.mark_waiting(self._dir, self.local_rank)  # a new pod's trainer is ready to join
        while True:
            world = membership.read(self._dir)
            if world is not None and world.state == membership.LEFT:
                raise SidecarUnavailable("this pod is not in its job's world any more (an in-place "
                                         "scale-down left it out): nothing to train")
            self._say_hello()
            while True:
                message = self._receive_raw(self._heartbeat_s)
                if message is None:
                    break  # no answer yet: say hello again
                if isinstance(message, messages.Welcome) and message.instance != stale:
                    return message
                # a stale ready/end from before the resync: drop it
            if time.monotonic() > deadline:
                raise SidecarUnavailable(
                    f"no sidecar answered at {self._dir / messages.SOCKET_NAME} "
                    f"within {self._timeout_s} s")

    def _welcome(self, message: messages.Welcome) -> None:
        self._inbox.clear()
        previous = self._instance
        if message.instance != self._instance:
            if self._control is not None:
                log.warning("sidecar restarted (instance %s -> %s); continuing at step %s",
                            self._instance, message.instance, message.next_step)
            try:
                control = ring.Control(Path(message.ctl), create=False)
            except FileNotFoundError:
                raise SidecarUnavailable(
                    f"the sidecar at {self._dir} went away during the handshake") from None
            self._instance = message.instance
            self._control = control  # the old one is unmapped with its last batch (they reference it)
            self.stats.attach(control)
            self._waiting, self._woken = False, 0
            self._taker.forget_others(self._instance)
        self.rank = message.rank
        self.world_size = message.world_size
        self.resume_step = message.resume_step
        self.steps_per_epoch = self.stats.steps_per_epoch = message.steps_per_epoch
        self.total_steps = self.stats.total_steps = message.total_steps
        if self._next_step is None or message.instance != previous:
            # Only the first welcome decides where a fresh process starts; later
            # ones answer our own hello (heartbeats may be answered late).
            self._next_step = message.next_step

    # -- receiving ----------------------------------------------------------------

    def _receive_raw(self, timeout_s: float) -> messages.Message | None:
        if self._inbox:
            return self._inbox.popleft()
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        frame = self._sock.recv()
        try:
            message = messages.decode(frame)
        except ProtocolError as exc:
            log.error("sidecar sent a malformed message (%s); resynchronising", exc)
            return None
        if isinstance(message, messages.Error):
            if message.fatal:
                raise SidecarFailed(message.message)
            log.warning("sidecar: %s", message.message)
        return message

    def _say_hello(self) -> None:
        self._sock.send(messages.Hello(local_rank=self.local_rank, pid=os.getpid(),
                                       next_step=self._next_step).encode())

    def _why_no_batch(self) -> str:
        control = self._control
        if control is not None and control.sidecar_waiting & ring.Waiting.KIND == ring.Waiting.SLOT:
            held = control.states().count(ring.SlotState.TAKEN)
            return (f"no batch in {self._timeout_s} s: this process still references {held} earlier "
                    f"batches, every slot of the ring ({ring.MAX_SLOTS}); drop the batches (or tensors "
                    "viewing them) you no longer need, or copy what you keep (tensor.clone())")
        return f"no batch from the sidecar in {self._timeout_s} s"

    # -- batches --------------------------------------------------------------------

    def _take(self, control: ring.Control, slot: int, step: int) -> Batch | None:
        """Hand out slot `slot`'s batch of `step`; None (the slot left FILLED) if it is torn or stale."""
        taken = self._taker.take(control, self._instance, slot, step)
        if taken is None:
            return None
        columns, rows = taken
        control.acked = step
        self._next_step = step + 1
        self._wake_if_due(control)
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        return Batch(columns, epoch=epoch, step=in_epoch, global_step=step, rows=rows)

    def _flush_releases(self) -> None:
        """Batches freed since the last call may unblock a waiting sidecar."""
        control = self._control
        if control is not None:
            self._wake_if_due(control)

    def _wake_if_due(self, control: ring.Control) -> None:
        """Wake the sidecar once per wait, when what it waits for has happened (slots, rule 3)."""
        waiting = control.sidecar_waiting
        if slots.wake_due(control, waiting, self._woken):
            self._woken = waiting
            control.bump(ring.ROOM)
            control.wake(ring.ROOM)
