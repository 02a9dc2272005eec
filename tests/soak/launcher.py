"""One `splitfeed local` run of the soak's job, as a user starts it, watched from outside."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support import processes

E2E_TRAINER = Path(__file__).parents[1] / "e2e" / "trainer.py"
_CONTROL = re.compile(r"rescale while it runs: echo N > (\S+)")


class Launcher:
    """`splitfeed local -f JOB --replicas N`: its stderr collected by a thread, its work dir
    (where the `replicas` control file goes) taken from its first lines."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, preexec_fn=processes.die_with_parent(signal.SIGINT))
        self.lines: list[str] = []
        self.judged = False
        """Whether the soak has judged this run's exit."""
        self._reader = threading.Thread(target=self._read, name="soak-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def control(self) -> Path | None:
        """The run's control file, once the launcher said where it is."""
        for line in list(self.lines):
            found = _CONTROL.search(line)
            if found:
                return Path(found.group(1))
        return None

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None:
            self._reader.join(10)
        return code

    def text(self) -> str:
        return "\n".join(self.lines)

    def ask_replicas(self, replicas: int, timeout_s: float = 30.0) -> None:
        """Write `replicas` to the control file, whole (the launcher reads and removes it)."""
        deadline = time.monotonic() + timeout_s
        while (control := self.control) is None:
            if time.monotonic() > deadline or self.poll() is not None:
                raise AssertionError(f"the launcher never named its control file:\n{self.text()[-2000:]}")
            time.sleep(0.05)
        tmp = control.with_name(".replicas.tmp")
        tmp.write_text(f"{replicas}\n")
        os.replace(tmp, control)

    def stop(self) -> None:
        """Ctrl-C, then SIGKILL (a soak that gives up must leave nothing running)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(10)


def command(job_file: Path, replicas: int, mode: str, resume: str, logs: Path, stop_file: Path,
            sleep_file: Path, sleep_s: float, checkpoint_every: int) -> list[str]:
    """The launcher's argv: real DDP trainers (tests/e2e/trainer.py) checkpointing every few steps."""
    return [sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f", str(job_file),
            "--replicas", str(replicas), "--resume", resume, "--rescale", mode, "--quiet", "--",
            sys.executable, str(E2E_TRAINER), str(logs), "--sleep-s", str(sleep_s), "--sleep-file", str(sleep_file),
            "--checkpoint-every", str(checkpoint_every), "--stop-file", str(stop_file), "--timeout-s", "60"]
