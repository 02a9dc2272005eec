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
A sidecar that went on in place to a later world never lets a trainer of the
earlier one continue in it: that hello is refused (WORLD_ENDED), and the trainer,
told WorldLost, rejoins (`rejoin`) at the step the new world starts from.

The socket is `trainer_client.transport.channel`; the handshake is `handshake`, the receive
path `receiving` (with this module's timings), checkpoints `checkpointing` and SIGTERM `preemption`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from . import adapting, counters, failures, taking
from ..contract import wellknown, membership, messages
from .checkpointing import Checkpoints
from ..contract.errors import CheckpointError, SidecarFailed, SidecarUnavailable, WorldLost
from .handshake import Session
from .preemption import Preemption
from .receiving import Pace, Receiver
from .taking import Batch as Batch
from ..transport.channel import Channel, Context

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


def pace() -> Pace:
    """The receive path's timings as this module's constants say now (tests change them here)."""
    return Pace(spin_s=SPIN_S, wait_slice_s=WAIT_SLICE_S, max_wait_slice_s=MAX_WAIT_SLICE_S,
                after_bare_wake_slice_s=AFTER_BARE_WAKE_SLICE_S, torn_retry_s=TORN_RETRY_S)


def socket_directory(socket_dir: str | os.PathLike[str] | None) -> Path:
    """The sidecar's socket directory: `socket_dir`, else SPLITFEED_SOCKET_DIR."""
    directory = socket_dir or os.environ.get(wellknown.SOCKET_DIR_ENV)
    if not directory:
        raise SidecarUnavailable(
            "no sidecar socket directory: set SPLITFEED_SOCKET_DIR "
            "(the operator and `splitfeed local` do this for you)"
        )
    return Path(directory)


class StreamClient(adapting.Adapting):
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
        context: Context | None = None,
    ) -> None:
        self._dir = socket_directory(socket_dir)
        self.local_rank = int(os.environ.get(wellknown.LOCAL_RANK, "0") if local_rank is None else local_rank)
        self._channel = Channel(context, self._dir, self.local_rank,
                                timeout_s=timeout_s, heartbeat_s=heartbeat_s,
                                lost=lambda: membership.lost(self._dir, self._session.world_epoch))
        self._taker = taking.Taker(self._dir, self.local_rank, as_tensors=as_tensors)
        self._session = Session(self._channel, self._dir, self.local_rank, timeout_s=timeout_s,
                                heartbeat_s=heartbeat_s)
        self._checkpoints = Checkpoints(self._session, self._channel, self._dir, self.local_rank, timeout_s,
                                        rehello=lambda: self._welcome(self._session.hello(stale=self._session.instance)))
        self._preemption = Preemption(self._channel.send)
        self._receiver = Receiver(self._session, self._channel, self._taker, pace(),
                                  timeout_s=timeout_s, heartbeat_s=heartbeat_s, on_welcome=self._welcome,
                                  before_wait=self._preemption.ask_drain)
        self._ended = False
        self.stats = counters.Stats(counters.stats_path(self.world_epoch))
        try:
            self._welcome(self._session.hello())
            self._adopt_world()
        except BaseException:
            self._channel.close(bye=False)
            raise
        self._preemption.install()
        failures.install(self._dir, self.local_rank, lambda: self.world_epoch)  # for `splitfeed run`

    # -- public API -----------------------------------------------------------

    @property
    def checkpoint_requested(self) -> bool:
        """The world agreed to checkpoint after the batch this rank just took.

        True on the same global step on every rank of the world (the sidecars
        agree on it before that batch is published; docs/agreement.md), so a
        synchronous trainer needs no collective of its own to act on it.
        """
        return self._checkpoints.requested()

    @property
    def drained(self) -> bool:
        """The world is draining and this rank's checkpoint was of the drain step: stop after saving."""
        return self._checkpoints.drained

    @property
    def world_epoch(self) -> int:
        """The world this process trains in (SPLITFEED_WORLD_EPOCH; `rejoin` moves it on)."""
        return self._session.world_epoch

    @property
    def torn_retries(self) -> int:
        """Times a slot's marks did not match and the slot was looked at again (tests read it)."""
        return self._receiver.torn_retries

    def __iter__(self) -> StreamClient:
        return self

    def __next__(self) -> Batch:
        self._receiver.flush_releases()
        self._checkpoints.commit_implicitly()
        self._preemption.ask_drain()
        if self._ended or self.drained:
            self.stats.write(final=True)
            raise StopIteration
        started = time.perf_counter()
        batch = self._receiver.next_batch()
        if batch is None:
            self._ended = True
            self.stats.write(final=True)
            raise StopIteration
        waited = time.perf_counter() - started
        self._receiver.spin_next = waited < SPIN_S  # the last batch came within a spin: this one likely will too
        self.stats.record(batch, waited)
        return batch

    def checkpoint(self, after_step: int | None = None) -> int:
        """Phase one: persist this rank's data position; returns the global steps completed.

        The position is after `after_step` global steps: by default the steps marked
        `trained`, else the last batch this iterator returned (the consumer commit),
        never what the sidecar has prefetched. Save the model for the returned step,
        then `commit(step)`: only committed steps are resumed, so a crash in between
        never leaves a data position without its model.
        """
        return self._checkpoints.checkpoint(after_step)

    def commit(self, step: int | None = None) -> None:
        """Phase two: the model for `step` (default: the last checkpoint) is saved.

        Iterating on, or `close()`, commits the last checkpoint too: a loop that
        saves its model right after `checkpoint()` is correct either way.
        """
        self._checkpoints.commit(step)

    @property
    def world(self) -> membership.World:
        """The world this process trains in, from its environment (which `rejoin` updates):
        what `groups.init_process_group` makes the process group of."""
        return self._session.world()

    def rejoin(self, timeout_s: float = 300.0, *, failed: bool = False) -> membership.World | None:
        """After this rank drained: the world it trains in next, or None to stop.

        The in-place way to follow an in-place rescale (docs/agreement.md, "Changing the
        world in place"): the pod stays, the world around it changes. Waits for the
        sidecar to start the next world, sets this process's `RANK`, `WORLD_SIZE`,
        `MASTER_PORT` and `SPLITFEED_WORLD_EPOCH` as a new pod would have them, and
        connects to it; iterating goes on from the drain step. The trainer then makes its
        process group again for the returned world and wraps its model anew (README,
        "Rescaling in place"). None when no world follows for this rank: the job ended, a
        scale-down left this pod out, or the world is replaced by new pods.

        `failed`: the loop raised instead (a collective whose peer's pod is gone; docs/agreement.md,
        "A member lost in place"). Waits up to `timeout_s` for the sidecar to say the world lost
        a pod (None if it does not: the failure is the trainer's own); the next world starts at
        `resume_step`, the newest complete checkpoint: load the model saved for it.
        """
        if failed and not membership.wait_lost(self._dir, self.world_epoch, timeout_s):
            return None
        if not failed and not self.drained:
            return None
        world = self._session.move_on(timeout_s)
        if world is None:
            return None
        self.stats.write(final=True)
        self.stats = counters.Stats(counters.stats_path(world.epoch))
        self._ended = False
        self._checkpoints.reset()
        self._preemption.reset()
        self._channel.clear()
        self._welcome(self._session.hello(stale=self._session.instance))
        self._adopt_world()
        return self.world

    def close(self) -> None:
        if self._channel.closed:
            return
        self._preemption.uninstall()
        try:
            self._checkpoints.commit_implicitly()
        except (CheckpointError, SidecarFailed, SidecarUnavailable, WorldLost) as exc:
            log.error("the last checkpoint was not committed: %s", exc)
        self.stats.write(final=True)
        self._channel.close()

    def __enter__(self) -> StreamClient:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self._checkpoints.prepared = None  # the model may not be saved: commit nothing
        self.close()

    # -- handshake --------------------------------------------------------------

    def _adopt_world(self) -> None:
        """The world the sidecar serves, where the environment says an older one (Session.adopt_world)."""
        self._session.adopt_world()

    def _welcome(self, message: messages.Welcome) -> None:
        control = self._session.welcome(message)
        if control is not None:  # a new sidecar: its control block
            self.stats.attach(control)
            self._receiver.new_sidecar()
        self.rank, self.world_size, self.resume_step = message.rank, message.world_size, message.resume_step
        self.dp_rank = message.data_rank if message.data_rank >= 0 else message.rank
        """Whose splits this rank is served: ranks of one model-parallel group share it
        (spec.data.ranksPerBatch; the rank itself without one)."""
        self.dp_size = message.data_size if message.data_size >= 0 else message.world_size
        """How many different batches each global step is cut into (the world size without groups)."""
        self.steps_per_epoch = self.stats.steps_per_epoch = message.steps_per_epoch
        self.total_steps = self.stats.total_steps = message.total_steps

    # What tests and benchmarks look at.
    _control = property(lambda self: self._session.control)
    _instance = property(lambda self: self._session.instance)
    _waits = property(lambda self: self._receiver.waits)
