"""Sidecars that exit right after their last reply, forked as `splitfeed local` forks them.

    python -m tests.streaming.last_answer_sidecar DIRECTORY COUNT

Forks COUNT sidecars, one after the other, each serving at DIRECTORY/<i>: it
answers the first trainer's `hello` and then stops at once, as a sidecar
whose last rank just committed the drain step does, and exits the way a
forked sidecar does (`sidecar.main.serve_to_exit`, then os._exit). Prints
each child's exit code.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from splitfeed.sidecar.forks import forking
from splitfeed.sidecar import main as sidecar_main, opening
from splitfeed.sidecar.serving import service
from splitfeed.sidecar.world.settings import SidecarSettings
from splitfeed.trainer_client.contract import messages


class LastAnswer(service.Server):
    def _hello(self, peer: bytes, message: messages.Hello) -> None:
        super()._hello(peer, message)
        self.stopping.set()  # the reply is this sidecar's last, as a drained rank's `committed` is


def child(directory: Path) -> int:
    server = LastAnswer(directory=directory, ranks=[0], world_size=1, factory=lambda rank, first: iter(()),
                        steps_per_epoch=1, total_steps=1, start_step=0, resume_step=0, prefetch=1)
    settings = SidecarSettings(config=Path("unused"), socket_dir=directory)
    return sidecar_main.serve_to_exit(opening.Sidecar(server, settings, 1, failure=None))


def main() -> int:
    root, count = Path(sys.argv[1]), int(sys.argv[2])
    warnings.filterwarnings("ignore", message=forking.FORK_WARNING, category=RuntimeWarning)
    for i in range(count):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = child(root / str(i))
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
