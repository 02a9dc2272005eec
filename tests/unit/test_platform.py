"""The Linux-only part (the shared-memory ring: futex(2) on a mapped control block) refuses
to load elsewhere with an error that says so, instead of calling whatever system call has
the futex's number there."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from splitfeed.trainer_client.contract import errors
from splitfeed.trainer_client.transport import ring


def load_ring_as(platform: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Execute ring.py afresh, under another module name, as on `platform`."""
    monkeypatch.setattr(sys, "platform", platform)
    spec = importlib.util.spec_from_file_location("splitfeed.trainer_client.transport._ring_elsewhere", ring.__file__)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.mark.parametrize("platform", ["darwin", "win32"])
def test_the_ring_refuses_to_load_off_linux_saying_what_it_needs(platform, monkeypatch):
    with pytest.raises(errors.UnsupportedPlatform) as refused:
        load_ring_as(platform, monkeypatch)
    assert "need Linux" in str(refused.value) and platform in str(refused.value)
    assert isinstance(refused.value, ImportError)  # the dispatcher's "command cannot load"


def test_the_ring_loads_on_linux(monkeypatch):
    load_ring_as("linux", monkeypatch)
