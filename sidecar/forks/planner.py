"""Each epoch's plan built ahead of the readers, in a child process of the sidecar.

lancedb's builder holds the whole permutation (~16 B a row) and its sort pool while
it runs: in a child process that memory goes back when the build ends, so a
sidecar's own memory stays its splits' row ids, and it keeps serving meanwhile
(replica 0's coordinator keeps answering its world). Where the job has a store to
share plans, replica 0's sidecar builds them and every sidecar reads them; without
one, each sidecar builds its own. The epoch a world starts in is built before its
first batch; the next EPOCHS_AHEAD epochs' while the current one is read.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import threading
import traceback
from collections.abc import Mapping
from typing import Any, cast

from splitfeed.trainer_client.contract import errors, specs

from ..data import reading
from ..table import cgroups, planning, plans
from . import forking, workers

log = logging.getLogger(__name__)

_OK, _DATA_ERROR, _USER_ERROR, _FAILURE = "ok", "data", "user", "failure"

IN_PROCESS_ROWS = 4_000_000
"""Up to this many rows a plan is built in the sidecar itself: lancedb holds 64 MB of
permutation for a moment, while a child opens the table again (and, where the sidecar has
no helper to fork it from, waits seconds for a fork server to import lancedb). Past it, the
child's memory is the point."""


def _build_main(conn: multiprocessing.connection.Connection, data: specs.DataSpec,
                storage_options: dict[str, str], location: plans.Location, epoch: int,
                rows: int) -> None:
    """In the child: open the pinned table, build and publish the plan, say how it went."""
    workers.exit_with_parent()
    planning.size_pool(rows, cgroups.free_memory()[0])  # before lancedb's threads read the environment
    kind, text = _OK, ""
    try:
        table = reading.open_table(data, storage_options)
        planning.build_and_publish(table, data, location, epoch, rows=rows)
    except errors.DataError as exc:
        kind, text = _DATA_ERROR, str(exc)
    except errors.UserError as exc:
        kind, text = _USER_ERROR, str(exc)
    except BaseException as exc:  # noqa: BLE001 - reported to the sidecar, which fails with it
        kind, text = _FAILURE, "".join(traceback.format_exception(exc)).rstrip()
    try:
        conn.send((kind, text))
    finally:
        conn.close()


def build_in_child(data: specs.DataSpec, storage_options: Mapping[str, str],
                   location: plans.Location, epoch: int, rows: int) -> None:
    """Build and publish one plan in a child process (lancedb already imported there): forked
    from the sidecar's helper (sidecar/forks/forking.py) where it has one, else from the loader
    workers' fork server; its errors are raised here as they were there."""
    args = (data, dict(storage_options), location, epoch, rows)
    try:
        kind, text = _in_child(args, epoch)
    except forking.ChildDied as exc:
        raise errors.SidecarFailed(
            f"the plan builder of epoch {epoch} exited (code {exc.code}) without a result: "
            "if it was OOM-killed, raise spec.sidecar.resources.limits.memory") from None
    if kind == _DATA_ERROR:
        raise plans.PlanError(text)
    if kind == _USER_ERROR:
        raise errors.UserError(text)
    if kind != _OK:
        raise errors.SidecarFailed(f"the plan builder of epoch {epoch} failed:\n{text}")


def _in_child(args: tuple[Any, ...], epoch: int) -> tuple[str, str]:
    """(kind, text) of a build in a child of the helper, or of the fork server without one."""
    helper = forking.helper()
    if helper is not None:
        try:
            return cast(tuple[str, str], helper.run(_build_main, *args))
        except (OSError, EOFError) as exc:  # the helper is gone: the fork server still works
            log.warning("the sidecar's build helper is gone (%s): building from the fork server", exc)
            forking.stop()
    return _from_fork_server(args, epoch)


def _from_fork_server(args: tuple[Any, ...], epoch: int) -> tuple[str, str]:
    """(kind, text) of a build in a child of multiprocessing's fork server."""
    context = workers.fork_context(args[0])
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_build_main, name=f"splitfeed-plan-{epoch}", daemon=True,
                              args=(sender, *args))
    process.start()
    sender.close()
    try:
        return cast(tuple[str, str], receiver.recv())
    except EOFError:
        process.join(5)
        raise forking.ChildDied(process.exitcode or 0) from None
    finally:
        receiver.close()
        process.join(5)


def builds_in_child(builder: Planner | None) -> bool:
    """Whether `builder` (None: this sidecar builds no plan) builds its plans in a child."""
    return builder is not None and builder.rows > IN_PROCESS_ROWS


EPOCHS_AHEAD = 3
"""Plans built ahead of the epoch being read. One was not enough where an epoch is read
about as fast as its plan is built (1M narrow rows: 0.19-0.25 s against 0.1-0.3 s on a
loaded machine): the build of epoch e+1 began at e's first step and ended after e's
readers had read ahead into e+1. With two, a builder that ran back to back still let a
few plans in a hundred land after their readers; three give it two epochs of slack.
Each costs one more stored plan (8 B a row)."""


class Planner:
    """Makes sure the plans of this sidecar's job exist at `location`, EPOCHS_AHEAD epochs ahead."""

    def __init__(self, data: specs.DataSpec, storage_options: Mapping[str, str],
                 location: plans.Location, *, rows: int, private: bool = False) -> None:
        self.data = data
        self.private = private
        """The plans are this sidecar's alone (no store): removed when it closes."""
        self.location = location
        self._options = dict(storage_options)
        self.rows = rows
        self._key = plans.PlanKey.of(data)
        self._cond = threading.Condition()
        self._reached = -1
        self._built: set[int] = set()
        self._closed = False
        self.failure: str | None = None
        self._thread: threading.Thread | None = None
        self._checked = False
        """The store's plans were found built by this image's lancedb (`plans.check_builder`):
        once per builder, as every plan it adds after is its own. Checked at every build, it
        read every stored plan's footer, 3 requests a plan on an object store: a job's 100th
        epoch took 300 requests to build."""
        self._table: Any = None
        """The table, opened at the first build this process runs (an open is several
        requests on an object store)."""

    def ensure(self, epoch: int) -> None:
        """Epoch `epoch`'s plan exists and is whole once this returns (built if need be)."""
        if epoch in self._built or epoch >= self.data.epochs:
            return
        if plans.verify(self.location, self._key, epoch) is None:
            plans.clear_failed(self.location, epoch)
            log.info("building the plan of epoch %d (%d rows) at %s", epoch, self.rows,
                     self.location.uri)
            try:
                if not self._checked:
                    plans.check_builder(self.location)
                    self._checked = True
                if self.rows <= IN_PROCESS_ROWS:
                    if self._table is None:
                        self._table = reading.open_table(self.data, self._options)
                    planning.build_and_publish(self._table, self.data, self.location, epoch, rows=self.rows)
                else:
                    build_in_child(self.data, self._options, self.location, epoch, self.rows)
            except Exception as exc:
                plans.mark_failed(self.location, epoch, str(exc))
                raise
        self._built.add(epoch)

    def start(self, epoch: int) -> None:
        """Build `epoch` now (raising what stops it), then each next epoch in the background."""
        self.ensure(epoch)
        self.reached(epoch)
        self._thread = threading.Thread(target=self._ahead, name="splitfeed-planner", daemon=True)
        self._thread.start()

    def reached(self, epoch: int) -> None:
        """A rank of this sidecar published a step of `epoch`: its next epoch is wanted."""
        with self._cond:
            if epoch > self._reached:
                self._reached = epoch
                self._cond.notify_all()

    def _wanted(self) -> int | None:
        """The first epoch of the next EPOCHS_AHEAD not built yet."""
        for epoch in range(self._reached + 1, self._reached + 1 + EPOCHS_AHEAD):
            if epoch not in self._built:
                return epoch
        return None

    def _ahead(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._wanted() is None:
                    self._cond.wait()
                if self._closed:
                    return
                epoch = self._wanted()
                assert epoch is not None
            if epoch >= self.data.epochs:
                return
            try:
                self.ensure(epoch)
            except Exception as exc:  # noqa: BLE001 - told to the readers waiting for it
                self.failure = f"the plan of epoch {epoch}: {exc}"
                log.error("%s", self.failure)
                return

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self.private:  # location_for's own directory, above plans/<digest>
            fs, root = self.location.filesystem()
            with contextlib.suppress(OSError):
                fs.delete_dir(root.rsplit("/plans/", 1)[0])


def location(data: specs.DataSpec, store_where: str | None,
             storage_options: Mapping[str, str]) -> plans.Location:
    """Plans next to the job's checkpoints (shared by its worlds), else this sidecar's own."""
    return plans.location_for(data, store_where, storage_options if store_where else None)
