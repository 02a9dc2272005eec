"""A StreamClient as a torch `IterableDataset`: what `DataLoader(dataset, batch_size=None)`,
Lightning and Accelerate take (torch imported only here, on first use)."""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .taking import Batch


class Client(Protocol):
    """What the dataset and DataState read of a StreamClient: a protocol, not the class, since
    client.py imports this module (through its base class in adapting)."""

    def __iter__(self) -> Iterator[Batch]: ...

    @property
    def steps_left(self) -> int: ...

    @property
    def checkpointed_step(self) -> int | None: ...

    @property
    def checkpoint_position(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def resume_step(self) -> int: ...


class Handed:
    """The global steps handed out and not yet said trained, oldest first.

    A framework that reads ahead trains its batches in the order it took them, so the
    oldest step handed out is the one its next "batch done" hook is about; counted here,
    where the batch came from, since frameworks rebuild batches without their metadata.
    """

    def __init__(self) -> None:
        self._steps: collections.deque[int] = collections.deque()

    def took(self, step: int) -> None:
        self._steps.append(step)

    def trained_one(self) -> int:
        """The steps trained once the oldest step handed out is: its global step + 1."""
        if not self._steps:
            raise RuntimeError("a batch was said trained, but none was handed out untrained")
        return self._steps.popleft() + 1

    def trained_all(self) -> int:
        """The steps trained once every step handed out is (a window of batches trained together)."""
        steps = self.trained_one()
        while self._steps:
            steps = self._steps.popleft() + 1
        return steps


class _Iterable:
    """The dataset's behaviour; `iterable_dataset` mixes it into torch's IterableDataset."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.handed = Handed()

    def __iter__(self) -> Iterator[Batch]:
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            raise RuntimeError(
                "a StreamClient cannot be read from DataLoader worker processes: use num_workers=0 "
                "(the sidecar's own workers decode and transform: spec.data.numWorkers)")
        for batch in self.client:
            self.handed.took(batch.global_step)
            yield batch

    def __len__(self) -> int:
        """Batches still to come in this world (a drain or the job's end cuts the stream there)."""
        return self.client.steps_left

    def set_epoch(self, epoch: int) -> None:
        """Nothing to do: splitfeed's epochs follow from the global step (frameworks call it)."""


@functools.cache
def _dataset_class() -> type:
    """_Iterable on torch's IterableDataset, made on first use: torch is imported only then."""
    from torch.utils.data import IterableDataset

    return type("StreamDataset", (_Iterable, IterableDataset), {})


def iterable_dataset(client: Client) -> Any:
    """`client` as a torch IterableDataset: `len()` is the steps left in this world, `set_epoch`
    does nothing, and `handed` knows which step a framework's next "trained" is of."""
    return _dataset_class()(client)


class DataState:
    """The data position as a `torch.distributed.checkpoint` Stateful, saved beside the model.

    `state_dict()` has no side effects (DCP calls it on load too, for the structure): it says the
    global step of the checkpoint this rank took last (`checkpoint()`, whose data position the
    sidecar stored), or of the steps completed before any; save between `checkpoint()` and
    `commit()`. `load_state_dict` refuses a model of another step than the one this
    world resumes at: the model and the data would disagree.
    """

    def __init__(self, client: Client) -> None:
        self.client = client

    def state_dict(self) -> dict[str, Any]:
        step = self.client.checkpointed_step
        return {"global_step": self.client.checkpoint_position if step is None else step,
                "world_size": self.client.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = int(state["global_step"])
        if step != self.client.resume_step:
            raise ValueError(
                f"this checkpoint holds global step {step}, but the world resumes its data at step "
                f"{self.client.resume_step}: load the checkpoint of step {self.client.resume_step} "
                "(client.resume_step)")
