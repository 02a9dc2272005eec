"""End-to-end fixtures: one cluster (control plane, test kubelet, helm-installed operator) per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.cluster import Cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    try:
        with Cluster.start(tmp_path_factory.mktemp("e2e")) as c:
            yield c
    except AssertionError as exc:
        if "run make envtest" in str(exc):
            pytest.fail(str(exc), pytrace=False)
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """A failed end-to-end test's report carries the cluster's pods, jobs, events and logs."""
    rep = yield
    cluster = getattr(item, "funcargs", {}).get("cluster")
    if rep.when == "call" and rep.failed and isinstance(cluster, Cluster):
        rep.sections.append(("cluster state at the failure", cluster.dump()))
    return rep
