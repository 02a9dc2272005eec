"""Sidecars for `splitfeed local`, forked from one process that has done the imports.

A sidecar's start is mostly imports: lancedb, and torch through
`lancedb.streaming` (seconds of CPU each). A live rescale starts a world of
sidecars at once, and on a small machine those imports were most of the
rescale's time. `splitfeed local` runs this server once; it imports what a
sidecar imports and then forks one child per sidecar, which runs the same CLI
entry point a fresh `python -m splitfeed.trainer_client.cli sidecar ...` would,
with the environment and log file it is given, in a session of its own.

Forking after the imports is safe here because nothing has run yet: lancedb
restarts its background loop and its Rust runtime in a forked child (its
at-fork hooks) and warns that an operation in flight at fork time could
deadlock; this process never starts one. Torch starts no thread pool on
import. Trainers are not forked: their command is the user's.

Wire format, one JSON object per line. In (stdin): {"argv": [...], "env": {...},
"log": path}. Out (stdout): {"pid": N} for each request, in order, then
{"exited": N, "code": C} when a child ends (a negative code: killed by that
signal, as Popen reports it). The server ends when its stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from splitfeed.sidecar.forks.forking import FORK_WARNING

STREAMING_ENV = "SPLITFEED_FORKSERVER_STREAMING"
"""Set to 1 when the job is read through StreamingDataset: its children import torch then."""


def _child(argv: Sequence[str], env: Mapping[str, str], log: str) -> None:
    """In the forked child: become a fresh sidecar process, run it, never return."""
    code = 1
    try:
        os.setsid()  # a process group of its own: `splitfeed local` signals the group
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        # New file objects: the server's may hold a lock or buffered bytes of its pipe.
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["splitfeed", *argv]
        from splitfeed.trainer_client import cli

        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the log, as an interpreter would
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        os._exit(code)


def _reap(out: IO[str]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        out.write(json.dumps({"exited": pid, "code": code}) + "\n")
        out.flush()


def serve(inp: IO[str], out: IO[str]) -> int:
    """Answer fork requests until `inp` closes; single-threaded, so a fork copies no held lock."""
    import splitfeed.sidecar.main  # noqa: F401  (the imports every child would do)
    from splitfeed.trainer_client import cli  # noqa: F401

    if os.environ.get(STREAMING_ENV) == "1":
        from splitfeed.sidecar.data import streaming

        streaming.import_streaming()  # and torch: the jobs StreamingDataset reads

    warnings.filterwarnings("ignore", message=FORK_WARNING, category=RuntimeWarning)
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    buffered = ""
    fd = inp.fileno()
    while True:
        readable, _, _ = select.select([fd], [], [], 0.1)
        _reap(out)
        if not readable:
            continue
        chunk = os.read(fd, 65536).decode()
        if not chunk:
            return 0
        buffered += chunk
        while "\n" in buffered:
            line, buffered = buffered.split("\n", 1)
            request = json.loads(line)
            out.flush()
            pid = os.fork()
            if pid == 0:
                _child(request["argv"], request["env"], request["log"])
            out.write(json.dumps({"pid": pid}) + "\n")
            out.flush()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the launcher's death (PDEATHSIG) ends it at once
    sys.exit(serve(sys.stdin, sys.stdout))


class Forked:
    """A forked sidecar as `splitfeed local` sees it: the part of Popen's interface it uses."""

    def __init__(self, server: Server, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"sidecar {self.pid}", timeout or 0.0)
            with self.server.changed:
                self.server.changed.wait(0.05)
        assert self.returncode is not None
        return self.returncode


class Server:
    """The launcher's end: starts the server, asks it for sidecars, learns how they ended."""

    def __init__(self, log: str, preexec_fn: Callable[[], object] | None = None, *,
                 streaming: bool = False) -> None:
        import subprocess
        import threading

        self._log = open(log, "wb")
        env = {**os.environ, STREAMING_ENV: "1" if streaming else "0"}
        self.proc = subprocess.Popen([sys.executable, "-m", "splitfeed.local.forkserver"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, start_new_session=True, preexec_fn=preexec_fn, env=env)
        self.changed = threading.Condition()
        self._codes: dict[int, int] = {}
        self._pids: list[int] = []
        self._ready = False
        self._lock = threading.Lock()  # one request at a time: replies come in order
        threading.Thread(target=self._read, name="splitfeed-forkserver", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "ready" in message:
                    self._ready = True
                elif "pid" in message:
                    self._pids.append(int(message["pid"]))
                elif "exited" in message:
                    self._codes[int(message["exited"])] = int(message["code"])
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_code(self, pid: int) -> int | None:
        with self.changed:
            code = self._codes.get(pid)
        if code is None and not self.alive():
            return -signal.SIGKILL  # the server is gone, and with it (PDEATHSIG) its children
        return code

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], log: str, timeout_s: float = 120.0) -> Forked:
        """A sidecar running `splitfeed <argv>`; waits for the server's imports the first time."""
        import time

        assert self.proc.stdin is not None
        with self._lock:
            deadline = time.monotonic() + timeout_s
            with self.changed:
                before = len(self._pids)
                self.proc.stdin.write(json.dumps({"argv": list(argv), "env": dict(env), "log": log}) + "\n")
                self.proc.stdin.flush()
                while len(self._pids) == before:
                    if not self.alive() or time.monotonic() > deadline:
                        raise RuntimeError(f"the sidecar fork server did not answer (exit code {self.proc.poll()})")
                    self.changed.wait(0.1)
                return Forked(self, self._pids[before])

    def close(self) -> None:
        """Its stdin closed, the server ends (the sidecars have been stopped by then)."""
        import subprocess

        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
