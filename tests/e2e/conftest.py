"""End-to-end fixtures: one cluster (control plane, test kubelet, helm-installed operator) per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.cluster import NS, SYSTEM_NS, Cluster, wait_for
from tests.support import guards


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    try:
        with Cluster.start(tmp_path_factory.mktemp("e2e")) as c:
            yield c
    except AssertionError as exc:
        if "run make envtest" in str(exc):
            pytest.fail(str(exc), pytrace=False)
        raise


@pytest.fixture(autouse=True)
def jobs_removed(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test leaves the cluster as it found it: its jobs deleted and their pods gone from the node.

    The test kubelet runs pods as children of this process, so a pod still stopping when a
    test ends would otherwise count as that test's leak (tests/conftest.py). Torn down
    before the leak check, which is set up first (root conftest)."""
    yield
    if "cluster" not in request.fixturenames:
        return
    cluster: Cluster = request.getfixturevalue("cluster")
    cluster.kubectl("-n", NS, "delete", "sj", "--all", "--wait=false", check=False)
    wait_for(lambda: not [r for r in list(cluster.kubelet.runs.values()) if r.namespace == NS], 120,
             "the test's pods to be gone from the test kubelet")
    # The operator's pod is the cluster's: a test that kills it sees its Deployment start another
    # process (or pod), which is no leak of that test.
    system = [r for r in list(cluster.kubelet.runs.values()) if r.namespace == SYSTEM_NS]
    guards.Snapshot.adopt_running({c.proc.pid for r in system for c in r.containers if c.proc is not None},
                                  {r.shm.name for r in system})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """A failed end-to-end test's report carries the cluster's pods, jobs, events and logs."""
    rep = yield
    cluster = getattr(item, "funcargs", {}).get("cluster")
    if rep.when == "call" and rep.failed and isinstance(cluster, Cluster):
        rep.sections.append(("cluster state at the failure", cluster.dump()))
    return rep
