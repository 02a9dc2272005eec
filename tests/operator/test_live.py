"""operator/cluster/live.py: live status.progress from a coordinator's answer, and a rescale's timeline."""

from __future__ import annotations

import dataclasses
import datetime

from splitfeed.operator.cluster import live
from splitfeed.operator.objects import planning
from splitfeed.trainer_client.contract import wellknown, messages
from tests.support.builders import status_answer

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)
KEY = ("ml", "job")


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def answer(step: int, *, resume: int = 0, drain_step: int | None = None, filled_rows: int = 0) -> messages.Status:
    return status_answer(global_step=step, steps_per_epoch=20, total_steps=60, resume_step=resume, rows=100,
                         rows_per_s=50.0, wait_s=1.0, wall_s=10.0, drain_step=drain_step, filled_rows=filled_rows)


def test_a_running_worlds_answer_becomes_status_progress():
    patch, events = live.Poller().observe(KEY, {"worldEpoch": 0, "phase": "Running"}, answer(23), at(0))
    assert patch["progress"]["globalStep"] == 23 and patch["progress"]["epoch"] == 1
    assert patch["progress"]["dataStallShare"] == 0.1
    assert patch["progress"]["updatedAt"] == "2026-01-01T12:00:00Z"
    assert "dataReady" in patch["progress"] and events == []


def test_no_answer_writes_nothing():
    assert live.Poller().observe(KEY, {"worldEpoch": 0, "phase": "Running"}, None, at(0)) == ({}, [])


def test_a_rescales_timeline_is_reported_once_the_new_world_took_a_batch():
    poller = live.Poller()
    draining = {"worldEpoch": 0, "phase": "Rescaling", "replicas": 4, "progress": {"globalStep": 30},
                "drain": {"reason": "Rescale", "requestedAt": "2026-01-01T12:00:00Z", "targetReplicas": 2}}
    assert poller.observe(KEY, draining, answer(31), at(3))[1] == []
    assert poller.observe(KEY, draining, answer(32, drain_step=33), at(6))[1] == []  # agreed
    new = {"worldEpoch": 1, "phase": "Rescaling", "replicas": 2, "progress": {"globalStep": 33},
           "drain": {"reason": "Rescale", "step": "StartingNewWorld"}}
    assert poller.observe(KEY, new, None, at(20))[1] == []  # the old world is gone
    # The new world resumed at 33 but has taken nothing yet: no report.
    assert "lastRescale" not in poller.observe(KEY, {**new, "phase": "Running"}, answer(33, resume=33), at(25))[0]
    patch, events = poller.observe(KEY, {**new, "phase": "Running"}, answer(34, resume=33), at(31))
    assert patch["lastRescale"] == {
        "fromReplicas": 4, "toReplicas": 2, "requestedAt": "2026-01-01T12:00:00Z",
        "checkpointAgreedAt": "2026-01-01T12:00:06Z", "oldWorldGoneAt": "2026-01-01T12:00:20Z",
        "firstBatchAt": "2026-01-01T12:00:31Z", "latencySeconds": 31.0, "stepsRedone": 0}
    assert [e.reason for e in events] == [live.RESCALE_REPORT]
    assert "31.0 s" in events[0].message and "checkpoint agreed after 6 s" in events[0].message
    assert KEY not in poller.rescales  # reported once


def test_a_rescale_is_timed_to_the_first_batch_the_world_dated_not_to_the_look_that_saw_it():
    poller = live.Poller()
    draining = {"worldEpoch": 0, "phase": "Rescaling", "replicas": 4, "progress": {"globalStep": 30},
                "drain": {"reason": "Rescale", "requestedAt": "2026-01-01T12:00:00Z", "targetReplicas": 2,
                          "inPlace": True}}
    assert poller.observe(KEY, draining, answer(31), at(1))[1] == []
    new = {"worldEpoch": 1, "phase": "Running", "replicas": 2, "progress": {"globalStep": 33}}
    said = dataclasses.replace(answer(33, resume=33), first_batch_at=at(1.3).timestamp())
    patch, events = poller.observe(KEY, new, said, at(4))  # seen a timer pass later
    assert patch["lastRescale"]["latencySeconds"] == 1.3
    assert patch["lastRescale"]["firstBatchAt"] == "2026-01-01T12:00:01Z"
    assert "1.3 s" in events[0].message


def test_a_first_batch_dated_outside_the_rescale_is_held_between_the_request_and_the_look():
    for skewed, latency in ((at(-5).timestamp(), 0.0), (at(9).timestamp(), 4.0)):
        poller = live.Poller()
        poller.observe(KEY, {"worldEpoch": 0, "phase": "Rescaling", "replicas": 4,
                             "drain": {"reason": "Rescale", "requestedAt": "2026-01-01T12:00:00Z",
                                       "targetReplicas": 2}}, None, at(1))
        said = dataclasses.replace(answer(33, resume=33), first_batch_at=skewed)
        patch, _ = poller.observe(KEY, {"worldEpoch": 1, "phase": "Running", "replicas": 2}, said, at(4))
        assert patch["lastRescale"]["latencySeconds"] == latency


def test_steps_taken_past_the_new_worlds_resume_step_are_counted_as_redone():
    poller = live.Poller()
    poller.observe(KEY, {"worldEpoch": 0, "phase": "Rescaling", "replicas": 4, "progress": {"globalStep": 40},
                         "drain": {"reason": "Rescale", "requestedAt": "2026-01-01T12:00:00Z",
                                   "targetReplicas": 2}}, None, at(1))
    patch, _ = poller.observe(KEY, {"worldEpoch": 1, "phase": "Running", "replicas": 2},
                              answer(37, resume=35), at(50))
    assert patch["lastRescale"]["stepsRedone"] == 5


def test_the_coordinator_is_replica_0_of_the_running_world_by_pod_ip():
    def pod(epoch: int, replica: int, ip: str, phase: str = "Running") -> dict:
        return {"metadata": {"name": planning.pod_name("job", epoch, replica),
                             "labels": {wellknown.LABEL_EPOCH: str(epoch), wellknown.LABEL_REPLICA: str(replica)}},
                "status": {"podIP": ip, "phase": phase}}

    pods = [pod(0, 0, "10.0.0.1"), pod(1, 1, "10.0.0.3"), pod(1, 0, "10.0.0.2")]
    assert planning.coordinator_of("job", 1, pods) == "tcp://10.0.0.2:29501"
    assert planning.coordinator_of("job", 1, [pod(1, 0, "10.0.0.2", "Succeeded")]) is None


def test_a_drain_agreed_between_two_passes_is_dated_by_the_drained_checkpoint():
    poller = live.Poller()
    poller.observe(KEY, {"worldEpoch": 0, "phase": "Rescaling", "replicas": 2, "progress": {"globalStep": 30},
                         "lastCheckpoint": {"step": 20, "time": "2026-01-01T11:50:00Z"},  # an older one
                         "drain": {"reason": "Rescale", "requestedAt": "2026-01-01T12:00:00Z",
                                   "targetReplicas": 1}}, None, at(3))
    assert poller.rescales[KEY].agreed_at is None
    poller.observe(KEY, {"worldEpoch": 1, "phase": "Rescaling", "replicas": 1, "progress": {"globalStep": 33},
                         "lastCheckpoint": {"step": 33, "time": "2026-01-01T12:00:02Z"}}, None, at(9))
    patch, _ = poller.observe(KEY, {"worldEpoch": 1, "phase": "Running", "replicas": 1},
                              answer(34, resume=33), at(30))
    assert patch["lastRescale"]["checkpointAgreedAt"] == "2026-01-01T12:00:02Z"
    assert patch["lastRescale"]["oldWorldGoneAt"] == "2026-01-01T12:00:09Z"


def test_a_world_is_asked_every_interval_and_every_pass_while_it_rescales():
    poller = live.Poller()
    running = {"spec": {"statusIntervalSeconds": 3600}, "status": {"phase": "Running", "worldEpoch": 0}}
    assert poller.due(KEY, running)  # never asked yet
    poller.last[KEY] = live.time.monotonic()
    assert not poller.due(KEY, running)
    draining = {**running, "status": {**running["status"], "phase": "Rescaling", "drain": {"reason": "Rescale"}}}
    assert poller.due(KEY, draining)
    assert not poller.due(KEY, {"status": {"phase": "Succeeded"}})


def test_filled_rows_of_every_world_add_up_in_status_progress():
    poller = live.Poller()
    patch, _ = poller.observe(KEY, {"worldEpoch": 0, "phase": "Running"}, answer(5, filled_rows=2), at(0))
    assert patch["progress"]["filledRows"] == 2
    world1 = {"worldEpoch": 1, "phase": "Running", "progress": patch["progress"]}
    patch, _ = poller.observe(KEY, world1, answer(9, resume=7, filled_rows=1), at(30))
    assert patch["progress"]["filledRows"] == 3  # world 0's 2, carried, and world 1's 1


def test_steps_redone_by_rescales_add_up_in_the_operators_counter():
    from splitfeed.operator.cluster import metrics

    observed = metrics.OperatorMetrics()
    observed.rescaled("ns", "job", {"lastRescale": {"latencySeconds": 12.0, "stepsRedone": 0}})
    assert observed.registry.get_sample_value("splitfeed_operator_steps_redone_total",
                                              {"namespace": "ns", "job": "job"}) == 0.0
    observed.rescaled("ns", "job", {"lastRescale": {"latencySeconds": 30.0, "stepsRedone": 5}})
    observed.rescaled("ns", "job", {"progress": {"globalStep": 9}})  # not a rescale's report
    assert observed.registry.get_sample_value("splitfeed_operator_steps_redone_total",
                                              {"namespace": "ns", "job": "job"}) == 5.0


def test_a_world_restarted_after_a_failure_announces_the_steps_it_trains_again():
    poller = live.Poller()
    failing = {"worldEpoch": 2, "phase": "Rescaling", "replicas": 2, "progress": {"globalStep": 41},
               "drain": {"reason": "Restart", "requestedAt": "2026-01-01T12:00:00Z", "targetReplicas": 2}}
    assert poller.observe(KEY, failing, None, at(1)) == ({}, [])
    new = {"worldEpoch": 3, "phase": "Running", "replicas": 2}
    patch, events = poller.observe(KEY, new, answer(31, resume=30), at(40))
    assert "lastRescale" not in patch  # not a rescale
    assert [(e.type, e.reason) for e in events] == [("Warning", live.STEPS_REDONE)]
    assert "resumed at global step 30" in events[0].message and "11 steps are trained again" in events[0].message
    assert poller.take_redone(KEY) == 11 and poller.take_redone(KEY) == 0
    exact = live.Poller()  # a replacement that resumed where its predecessor stopped says nothing
    exact.observe(KEY, {**failing, "drain": {**failing["drain"], "reason": "WorldDrained"}}, None, at(1))
    assert exact.observe(KEY, new, answer(42, resume=41), at(40))[1] == [] and exact.take_redone(KEY) == 0
