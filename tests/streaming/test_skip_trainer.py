"""A skip job's trainer never passes over a step that exists (a real sidecar).

`StreamClient._next_batch` looks for step k (`find(k, scan=True)`) and, not finding it,
takes the lowest later step posted (`find_after(k)`): "a later step posted means k does
not exist". The two looks are not one: a sidecar that posts k and k + 1 between them
(the trainer's thread descheduled for the time of two small posts; prefetchBatches >= 2)
makes the trainer take k + 1 and pass over k, which exists.
"""

from __future__ import annotations


import numpy as np

from splitfeed.trainer_client.transport import ring
from splitfeed.trainer_client.script.client import StreamClient

from tests.streaming.harness import coordinator_address
from tests.support.skipping import expected_steps, job
from tests.support.waiting import wait_for


def test_a_step_posted_between_the_trainers_two_looks_is_not_passed_over(pods, table_uri, plan,
                                                                        monkeypatch):
    real = ring.Control.find_after
    delayed = []

    def descheduled(self: ring.Control, step: int):  # type: ignore[no-untyped-def]
        """The trainer's thread loses its core right before this look, once: meanwhile the
        sidecar posts `step` and `step + 1` (it posts in rising order)."""
        if not delayed:
            delayed.append(step)
            wait_for(lambda: np.any((self.state == ring.SlotState.FILLED) & (self.step == step + 1)), 10,
                     f"the sidecar to post step {step + 1}", interval=0.001)
        return real(self, step)

    monkeypatch.setattr(ring.Control, "find_after", descheduled)
    pod = pods("pod", job(table_uri, plan["bad"]), replicas=1, replica=0,
               coordinator=coordinator_address()).start_thread()
    with StreamClient(pod.socket_dir, 0, timeout_s=20) as client:
        got = [batch.global_step for batch in client]
    expected = sorted(expected_steps(plan, 1, 0))
    assert delayed, "the trainer never waited for a step"
    assert got == expected, f"steps taken start {got[:4]}, expected {expected[:4]}"
