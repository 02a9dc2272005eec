"""What frameworks that read ahead need of a StreamClient: the steps trained, the world's
agreed steps, and the torch adapters (a part of StreamClient, kept here so that its class
stays one thing: connecting and iterating)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from . import counters
from .checkpointing import Checkpoints
from .handshake import Session
from .preemption import Preemption

if TYPE_CHECKING:
    from .loading import Client
    from .taking import Batch


class Adapting:
    """StreamClient's framework-facing members (it sets these attributes)."""

    _checkpoints: Checkpoints
    _session: Session
    _preemption: Preemption
    _ended: bool
    stats: counters.Stats

    @property
    def checkpoint_step(self) -> int | None:
        """The global step count the world agreed to checkpoint after, while it is due (None: none).

        The same on every rank. A loop that reads ahead checks it against the steps it
        trained, not the batches it took: `client.checkpoint_step == trained_steps`.
        """
        return self._checkpoints.agreed()

    @property
    def checkpoint_position(self) -> int:
        """The global steps a `checkpoint()` now would record: trained, where said, else handed out."""
        return self._checkpoints.position()

    @property
    def checkpointed_step(self) -> int | None:
        """The step of this world's last `checkpoint()`, committed or not (None: none yet)."""
        return self._checkpoints.last

    @property
    def drain_step(self) -> int | None:
        """The global step this world drains at: no batch of it or after it comes in this world."""
        control = self._session.control
        return None if control is None or control.drain_at < 0 else int(control.drain_at)

    @property
    def steps_left(self) -> int:
        """Batches this world will still hand out (fewer under onTransformError skip): a loader's len()."""
        control, taken = self._session.control, self._session.next_step or 0
        if control is None or self._ended or self._checkpoints.drained:
            return 0
        end = int(control.end_step) if control.drain_at < 0 else min(int(control.end_step), int(control.drain_at))
        return max(0, end - taken)

    def as_iterable_dataset(self) -> Any:
        """This client as a torch IterableDataset, for `DataLoader(dataset, batch_size=None)`
        (pin_memory too) and the frameworks that take one (trainer_client.loading)."""
        from . import loading

        return loading.iterable_dataset(cast("Client", self))

    def data_state(self) -> Any:
        """The data position as a `torch.distributed.checkpoint` Stateful (trainer_client.loading.DataState)."""
        from . import loading

        return loading.DataState(cast("Client", self))

    def trained(self, through: Batch | int) -> None:
        """The model has trained through `through`: a batch this iterator returned, or a count of
        global steps. From then on `checkpoint_requested` and `checkpoint()` go by the steps
        trained, not by the batches handed out, which a framework that reads ahead (Lightning,
        Accelerate, a DataLoader with prefetch) takes before it trains them."""
        steps = through if isinstance(through, int) else through.global_step + 1
        self._checkpoints.mark_trained(steps)
        self.stats.trained = steps
        control = self._session.control
        if control is not None:
            control.trained = steps  # the sidecar's progress (its metrics, the operator's status) counts it

    def reclaim_sigterm(self) -> None:
        """Make this client's SIGTERM handling (a drain of the world) the process's again, after a
        framework installed its own over it (the integrations call it once training starts)."""
        self._preemption.reclaim()

