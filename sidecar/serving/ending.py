"""Whether a sidecar's trainers are gone: a SIGTERM after they returned is no preemption.

A trainer that returns without `client.close()` (a `max_steps` loop, an early stop:
issue 21) sends no `bye`; its sidecar cannot tell it from a trainer busy in a long step.
Then a SIGTERM reaches the sidecar: from the kubelet stopping a native sidecar once the
pod's regular containers exited, or from the operator deleting the pod of a world whose
trainers all returned (docs/operator.md, "Trainers that stop early"). The sidecar's SIGTERM
handler treats SIGTERM as a preemption (it asks the world to drain and serves until this
pod's ranks commit the agreed step); with no trainer left to commit, that wait only ends
with the kubelet's SIGKILL, and the report with it. `trainers_gone` tells the handler to
stop at once instead: the report then says `drained: false` and the step the trainers
reached (`globalStep`), which is what the operator reads.

A trainer is connected while its ZeroMQ DEALER holds a connection to the sidecar's ipc
socket; the kernel lists each accepted connection of a bound unix socket, under the
socket's path, in /proc/net/unix (per network namespace, which a pod's containers
share), and ZeroMQ closes its end as soon as the trainer's process is gone.
"""

from __future__ import annotations

from pathlib import Path

from splitfeed.trainer_client.contract import messages

from . import service

PROC_NET_UNIX = Path("/proc/net/unix")
CONNECTED = "03"
"""SS_CONNECTED in /proc/net/unix's St column (a listening socket shows 01)."""


def connections(socket_path: Path, table: Path = PROC_NET_UNIX) -> int | None:
    """Accepted connections to the unix socket bound at `socket_path`; None where the kernel
    does not say (no /proc/net/unix: then nobody is known to be gone)."""
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return None
    want = str(socket_path)
    count = 0
    for line in lines:
        fields = line.split()
        # Num RefCount Protocol Flags Type St Inode Path
        if len(fields) >= 8 and fields[5] == CONNECTED and " ".join(fields[7:]) == want:
            count += 1
    return count


def trainers_gone(server: service.Server, table: Path = PROC_NET_UNIX) -> bool:
    """Every local rank's trainer has been here (said hello) and none is connected any more,
    or each said bye or drained. A rank whose trainer never came is not gone: it may still be
    starting (the SIGTERM is then a preemption as before)."""
    sessions = [f.session for f in server.feeds]
    if not sessions or any(s.peer is None for s in sessions):
        return False
    if all(s.said_bye or s.drained for s in sessions):
        return True
    return connections(server.directory / messages.SOCKET_NAME, table) == 0
