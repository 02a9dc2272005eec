"""`make bench`'s rescale case on a loaded machine: a run that could not happen as planned is
tried with more room, then recorded as not measured with its reason, never a traceback."""

from __future__ import annotations

from pathlib import Path

from tests.bench import rescale


def test_a_run_that_cannot_happen_as_planned_is_retried_with_more_epochs_then_recorded(monkeypatch, tmp_path):
    tried = []

    def one_run(mode: str, uri: str, work: Path, attempt: int, epochs: int) -> dict:
        tried.append(epochs)
        raise rescale.NotMeasured(f"{mode}: the third world never trained:\nlog lines")

    monkeypatch.setattr(rescale, "one_run", one_run)
    run = rescale.measured_run("agent", "uri", tmp_path, 0)
    assert tried == list(rescale.RETRY_EPOCHS)
    assert run["not_measured"] == "agent: the third world never trained:" and "load_average" in run


def test_verdicts_leave_out_runs_not_measured_and_say_so():
    measured = {"changes": [{"seconds": 0.3, "after_drain_s": 0.1}, {"seconds": 2.4, "after_drain_s": 0.2}],
                "step_s": 0.05, "redone": [0, 0], "load_average": 1.0}
    lines = rescale.verdicts({"floor_s": [2.0], "ddp_start_s": [2.5], "runs": {
        "agent": [{"not_measured": "agent: the third world never trained:", "load_average": 12.0}],
        "in-process": [measured, {"not_measured": "x", "load_average": 3.0}]}})
    assert lines[0] == "agent: not measured (agent: the third world never trained:)"
    assert "worst 2.40 s" in lines[1] and "(1 of 2 runs not measured)" in lines[1]
