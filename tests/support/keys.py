"""The test session's job keypair (trainer_client.keys).

Every coordinator a test starts is a CURVE server and every client of it needs the job's
keypair, as in a pod. One keypair for the whole session, named by SPLITFEED_KEYS_DIR in the
test process's environment: sidecars in threads, `splitfeed sidecar` processes (harness.Pod)
and the tests' own `worlds.request_*` calls all find it there. `splitfeed local` makes its own
per run, as it does for a user.
"""

from __future__ import annotations

import os
from pathlib import Path

from splitfeed.trainer_client.contract import wellknown
from splitfeed.trainer_client.transport import keys


def install(directory: Path) -> keys.Keypair:
    """Write a fresh keypair into `directory` and point this process's environment at it."""
    keypair = keys.create(directory)
    os.environ[wellknown.KEYS_DIR_ENV] = str(directory)
    return keypair


def session_dir() -> Path:
    """The directory `install` pointed the environment at."""
    return Path(os.environ[wellknown.KEYS_DIR_ENV])


def session_keypair() -> keys.Keypair:
    """The keypair `install` wrote, for coordinators and members a test makes itself."""
    return keys.load(session_dir())
