"""Why a training script failed: its own error, or a collective whose peer is gone.

`splitfeed run` (trainer_client/script/agent.py) must tell the two apart the moment the script
exits. A script whose peer's pod vanished fails in a collective (gloo: "Connection closed
by peer") before the world is declared lost, and must wait for that word to go on in the
next world; a script that fails of its own (a bug, an OOM, `sys.exit(3)`) must end its
container with its exit code at once, as it would without the agent. The exit code says
neither, so the client records the script's uncaught exception (sys.excepthook, chained to
the script's own hook) in a file of its rank, owner-only, and the agent reads it.

torchelastic's `@record` writes a similar error file, but only where the script asks for
it and with no notion of which failures a peer caused; this one is always on and small.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

FILE = "trainer-{local_rank}.failed"

TRANSPORT_TEXTS = (
    "Connection closed by peer",  # gloo, a peer's process or pod is gone
    "Connection reset by peer",
    "gloo/transport",  # every gloo transport error names its source file
    "NCCL error",
    "ncclRemoteError",
    "ProcessGroupNCCL",
)
"""What torch's backends say when a collective's peer vanished. gloo raises a plain
RuntimeError, so its text is all there is; NCCL's and the stores' errors are also of
torch.distributed's DistError family, which `collective` checks by class."""


@dataclasses.dataclass(frozen=True)
class Failure:
    pid: int
    epoch: int
    exception: str
    """"module.Class: first line of the message", for the agent's log."""
    collective: bool


def collective(exc: BaseException) -> bool:
    """The exception, or one it was raised from, is a collective that failed for its peers."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if any(c.__module__.startswith("torch.distributed") and c.__name__.startswith("Dist")
               for c in type(current).__mro__):
            return True
        if any(text in str(current) for text in TRANSPORT_TEXTS):
            return True
        current = current.__cause__ or current.__context__
    return False


def describe(exc: BaseException) -> str:
    kind = type(exc)
    line = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{kind.__module__}.{kind.__qualname__}: {line}"


def record(directory: Path, local_rank: int, epoch: int, exc: BaseException) -> None:
    """Write this process's failure for the agent (owner-only, replaced in one step)."""
    failure = Failure(os.getpid(), epoch, describe(exc), collective(exc))
    path = Path(directory) / FILE.format(local_rank=local_rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(failure), f)
        os.replace(tmp, path)
    except OSError:
        pass  # a missing record makes the agent end with the exit code: what it would do anyway


def recorded_since(directory: Path, since: float) -> list[Failure]:
    """Every failure a trainer process in `directory` recorded at or after `since` (time.time()):
    the agent's child may be a launcher (torchrun) whose worker processes each have a client."""
    found = []
    for path in sorted(Path(directory).glob(FILE.format(local_rank="*"))):
        try:
            if path.stat().st_mtime >= since:
                found.append(Failure(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return found


def install(directory: Path, local_rank: int, epoch: Callable[[], int]) -> None:
    """Record an uncaught exception before the script's own hook (python's default prints it)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> Any:
        if not isinstance(value, (KeyboardInterrupt, SystemExit)):
            record(directory, local_rank, epoch(), value)
        return previous(kind, value, tb)

    if getattr(previous, "__splitfeed__", False):
        return  # one per process: a second client (a rejoin) keeps the first hook
    hook.__splitfeed__ = True  # type: ignore[attr-defined]
    sys.excepthook = hook
