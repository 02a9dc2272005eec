"""Review findings on onTransformError=skip/warn's agreement (pure logic, no sockets)."""

from __future__ import annotations

import queue
import threading

import pyarrow as pa

from splitfeed.sidecar import agreement, serving

SPE = 100


def rank_steps(last: int):
    """A rank whose splits did not run dry: it holds every step of epoch 0 and on."""
    batch = pa.record_batch({"x": [0]})
    for step in range(last):
        yield step, batch


def wait_for_reach(outbox: queue.SimpleQueue, reach: int) -> None:
    while True:
        news = outbox.get(timeout=60)
        if isinstance(news, serving.Assembled) and news.reach >= reach:
            return


def test_a_frozen_publishers_look_ahead_holds_no_step_the_world_already_dropped():
    """A drain whose cut moved past an epoch's end (S - 1 OUT) asks every rank to read on to
    the next epoch's first step while its publisher is frozen. A rank whose own splits did
    not run dry reads the rest of that epoch: steps already OUT (the world's end is known),
    which nobody will ever publish. They should not pile up in memory; held is bounded by
    the look-ahead, not by the epoch's length."""
    world = serving.WorldView(SPE)
    stop = threading.Event()
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    steps = serving.AgreedSteps(rank_steps(2 * SPE), first_step=0, rank=0, world=world, lookahead=2,
                                total_steps=2 * SPE, stop=stop, outbox=outbox, signal=None)
    try:
        world.update(4, {0: 5}, -1)  # another rank's split ran dry after step 4: E = 5
        taken = [next(steps)[0] for _ in range(5)]  # the publisher lets 0..4 through ...
        assert taken == [0, 1, 2, 3, 4]
        # ... then freezes (a drain: S = 6, step 5 OUT, so S moves to SPE + 1 and the
        # coordinator needs step SPE to be known); nothing calls next() until the commit.
        world.update(4, {0: 5}, SPE)
        wait_for_reach(outbox, SPE)
        held = len(steps._held)
        assert held <= 2 + 2, f"the frozen look-ahead holds {held} steps, {held - 1} of them OUT"
    finally:
        stop.set()
        steps.close()
