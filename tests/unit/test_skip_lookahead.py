"""onTransformError=skip/warn: the look-ahead, the ledgers of split positions and resumes
that rewind past them (pure logic with the real AgreedSteps, WorldView and SkipLedgers; no
sockets). Each test was written against a defect found in review and failed before its fix."""

from __future__ import annotations

import queue
import threading

import pyarrow as pa

from splitfeed.sidecar.world import agreement
from splitfeed.sidecar.serving import service

SPE = 100


def rank_steps(last: int):
    """A rank whose splits did not run dry: it holds every step of epoch 0 and on."""
    batch = pa.record_batch({"x": [0]})
    for step in range(last):
        yield step, batch


def wait_for_reach(outbox: queue.SimpleQueue, reach: int) -> None:
    while True:
        news = outbox.get(timeout=60)
        if isinstance(news, service.Assembled) and news.reach >= reach:
            return


def test_a_frozen_publishers_look_ahead_holds_no_step_the_world_already_dropped():
    """A drain whose cut moved past an epoch's end (S - 1 OUT) asks every rank to read on to
    the next epoch's first step while its publisher is frozen. A rank whose own splits did
    not run dry reads the rest of that epoch: steps already OUT (the world's end is known),
    which nobody will ever publish. They should not pile up in memory; held is bounded by
    the look-ahead, not by the epoch's length."""
    world = service.WorldView(SPE)
    stop = threading.Event()
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    steps = service.AgreedSteps(rank_steps(2 * SPE), first_step=0, rank=0, world=world, lookahead=2,
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


def test_the_positions_of_the_last_step_before_an_epochs_end_outlive_the_steps_the_world_dropped():
    """The trainer takes step E - 1 (the world's last of epoch 0) and checkpoints at E, a drain
    committed at S = E or the trainer's own end-of-epoch save: the sidecar writes the positions
    it recorded after step E - 1 (SkipLedgers.state: ledger.get(step - 1), else SidecarFailed).
    Meanwhile this rank's reader goes on: the steps E..SPE-1 its own splits still hold are OUT
    and the publisher drops them at once, so nothing bounds how many it reads before the
    trainer's checkpoint but the epoch's length. The ledger keeps the newest KEEP steps it
    read, so an epoch that lost more than KEEP steps for the world (but not for this rank)
    evicts step E - 1: the checkpoint of step E fails ("holds no split positions")."""
    from splitfeed.sidecar.data import skipping
    from splitfeed.sidecar.data.ledgers import Ledger, SkipLedgers

    keep = SkipLedgers.KEEP
    spe = keep + 200
    ledger = Ledger(keep)
    batch = pa.record_batch({"x": [0]})

    def read(last: int):  # what workers.iter_rank_batches does: the ledger at read time
        for step in range(last):
            ledger[step] = skipping.Passed({0: step + 1}, 0)
            yield step, batch

    world = service.WorldView(spe)
    stop = threading.Event()
    steps = service.AgreedSteps(read(2 * spe), first_step=0, rank=0, world=world, lookahead=2,
                                total_steps=2 * spe, stop=stop, outbox=queue.SimpleQueue(), signal=None)
    try:
        world.update(4, {0: 5}, -1)  # another rank's split ran dry after step 4: E = 5
        taken = [next(steps)[0] for _ in range(5)]  # the publisher posts 0..4 (Publisher: on_published)
        for step in taken:
            ledger.published(step)
        assert taken == [0, 1, 2, 3, 4]
        world.update(spe + 1, {0: 5}, -1)  # every other rank holds the next epoch's first steps
        assert next(steps)[0] == spe  # the publisher drops 5..spe-1 (OUT) and posts step spe
        ledger.published(spe)
        assert 4 in ledger, (f"the checkpoint of step 5 (after step 4) finds no positions: the "
                             f"ledger holds steps {min(ledger)}..{max(ledger)}")
    finally:
        stop.set()
        steps.close()


def test_a_trainer_restarted_in_place_resumes_a_skip_job_at_the_worlds_complete_step():
    """restartPolicy OnFailure: a new trainer process says hello without next_step and the
    sidecar rewinds its publisher to the world's newest complete step W (service._hello), whose
    reader starts from `resume_state(rank, W)`, i.e. SkipLedgers.state -> the ledger's entry of
    step W - 1. The ledger keeps only the newest KEEP steps the reader read, so a job that
    checkpoints less often than every KEEP steps (KEEP = 4096; every 5000 steps is common)
    cannot resume its restarted trainer: the rank fails with "holds no split positions", where
    raise/fill jobs resume. The positions of W - 1 were written to the store at checkpoint()."""
    from splitfeed.sidecar.data import skipping
    from splitfeed.sidecar.data.ledgers import SkipLedgers
    from splitfeed.trainer_client.contract import specs

    data = specs.DataSpec(uri="unused", table="t", num_splits=2, global_batch_size=2,
                          transform="tests.transforms:fragile", on_transform_error="skip")
    spe = 100_000
    ledgers = SkipLedgers(data, spe, start_step=0, resume_state=None)
    ledger = ledgers.ledger(0)
    assert ledger is not None
    checkpoint_step = 1000  # the trainer checkpointed (and the world committed) step 1000 ...
    ledger[checkpoint_step - 1] = skipping.Passed({0: checkpoint_step, 1: checkpoint_step}, 0)
    saved = ledgers.state(0, checkpoint_step)  # ... with the positions the ledger held then
    for step in range(checkpoint_step, checkpoint_step + 10_000):  # then trained 10,000 more steps
        ledger[step] = skipping.Passed({0: step + 1, 1: step + 1}, 0)
        ledgers.published(0, step)
    assert checkpoint_step - 1 not in ledger  # forgotten by now: the checkpoint's state serves
    start, state = ledgers.resume_from(0, checkpoint_step)  # the restarted trainer's publisher
    assert (start, state) == (checkpoint_step, saved)
    # A step neither the ledger nor a checkpoint knows: read again from the epoch's start.
    ledgers2 = SkipLedgers(data, spe, start_step=0, resume_state=None)
    assert ledgers2.resume_from(0, 7) == (0, None)
