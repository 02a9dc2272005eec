"""The trainer's SIGTERM handler (trainer_client/script/preemption.py): one SIGTERM delivered twice at
once (to the container's process group and forwarded by `splitfeed run`) asks the world to drain
once; a second SIGTERM later still stops the trainer at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, time
    from splitfeed.trainer_client.script.preemption import SAME_SIGTERM_S, Preemption
    sent = []
    p = Preemption(sent.append)
    p.install()
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # the same one, through the agent
    time.sleep(0.05)
    p.ask_drain()
    print(f"asked {len(sent)}: {[m.reason for m in sent]}", flush=True)
    time.sleep(SAME_SIGTERM_S + 0.1)
    os.kill(os.getpid(), signal.SIGTERM)  # a second request: the default action
    time.sleep(2)
    print("still alive", flush=True)
""")


def test_a_sigterm_delivered_twice_at_once_asks_once_and_a_later_one_stops_at_once() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30)
    assert done.stdout.splitlines() == ["asked 1: ['preempt']"], (done.stdout, done.stderr)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr)
