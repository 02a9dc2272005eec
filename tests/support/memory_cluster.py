"""An in-memory cluster (a job's status, its pods) that the operator's pure life-cycle
function is walked against step by step, deciding and applying as reconciling does
(tests/operator/test_rescaling.py and the modules that walk other endings)."""

from __future__ import annotations

import copy
import datetime
import pathlib

import yaml

from splitfeed.operator.lifecycle import deciding
from splitfeed.operator.objects import planning
from splitfeed.trainer_client.contract import messages, specs
from tests.support.builders import OWNER, T0, manifest

SETTINGS = planning.Settings()


def _status_schema() -> dict:
    crd = yaml.safe_load((pathlib.Path(__file__).resolve().parents[2] / "crds" / "streamingjob.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]


STATUS_SCHEMA = _status_schema()


def assert_declared(value, schema: dict, path: str = "status") -> None:
    """Every field the operator writes is in the CRD's status schema (the apiserver prunes the rest)."""
    if not isinstance(value, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    props = schema.get("properties")
    assert props is not None, f"{path} has no declared fields"
    for key, child in value.items():
        assert key in props, f"{path}.{key} is not in the CRD: the apiserver would prune it"
        assert_declared(child, props[key], f"{path}.{key}")


def merge(target: dict, patch: dict) -> dict:
    out = copy.deepcopy(target)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class Cluster:
    """Status + pods; `step()` decides and applies, like reconciling does (status first)."""

    def __init__(self, prune: bool = False, **spec):
        self.prune = prune  # a CRD schema without status.drain drops it on every write
        self.manifest = manifest(**spec)
        self.status: dict = {}
        self.pods: dict[str, dict] = {}
        self.others: dict[str, dict] = {}
        self.now = T0
        self.log: list[deciding.Decision] = []
        self.next_world: messages.Status | None = None
        """What the next world's coordinator answers `status` with (an in-place change), if it serves."""

    @property
    def job(self):
        return specs.parse_job(self.manifest, check_replicas=False)

    def decide(self):
        return deciding.decide(self.job, self.status, list(self.pods.values()), owner=OWNER,
                                settings=SETTINGS, now=self.now, generation=1, next_world=self.next_world)

    def step(self, *, act: bool = True) -> deciding.Decision:
        d = self.decide()
        self.log.append(d)
        assert_declared(d.status, STATUS_SCHEMA)
        self.status = merge(self.status, d.status)
        if self.prune:
            self.status.pop("drain", None)
        if act:
            for obj in d.create:
                if obj["kind"] == "Pod":
                    self.pods.setdefault(obj["metadata"]["name"], merge(obj, {"status": {"phase": "Pending"}}))
                else:
                    self.others[f'{obj["kind"]}/{obj["metadata"]["name"]}'] = obj
            for name, ann in d.annotate.items():
                self.pods[name]["metadata"].setdefault("annotations", {}).update(ann)
            for name, labels in d.label.items():
                self.pods[name]["metadata"]["labels"].update(labels)
            for name in d.delete:
                self.pods.pop(name, None)
        return d

    def set_phase(self, phase: str, *names: str) -> None:
        for n in names or list(self.pods):
            self.pods[n]["status"]["phase"] = phase

    def epochs(self) -> set[int]:
        return {int(p["metadata"]["labels"]["splitfeed.io/world-epoch"]) for p in self.pods.values()}

    def reason(self, type_: str = "Rescaling") -> str | None:
        for c in self.status.get("conditions", []):
            if c["type"] == type_:
                return c["reason"]
        return None

    def scale(self, n: int) -> None:
        self.manifest["spec"]["replicas"] = n

    def past_backoff(self) -> "Cluster":
        """Move the clock to status.nextRestartAt, when the next world may start."""
        if self.status.get("nextRestartAt"):
            self.now = max(self.now, datetime.datetime.fromisoformat(self.status["nextRestartAt"].replace("Z", "+00:00")))
        return self

    def running(self) -> "Cluster":
        self.step()
        assert self.status["phase"] == "Running"
        self.set_phase("Running")
        self.step()
        return self


def in_place(replicas: int, **spec: object) -> Cluster:
    """A job with spec.rescale inPlace, its world running, each pod with an IP (the operator
    asks replica 0's coordinator at it)."""
    c = Cluster(replicas=replicas, rescale="inPlace", **spec)
    c.running()
    for i, p in enumerate(c.pods.values()):
        p["status"]["podIP"] = f"10.0.0.{i + 1}"
    return c


def env_of(pod: dict, container: str) -> dict[str, str]:
    """A container's environment by name (None for a value from elsewhere: valueFrom)."""
    (found,) = [x for x in pod["spec"].get("initContainers", []) + pod["spec"]["containers"] if x["name"] == container]
    return {e["name"]: e.get("value") for e in found["env"]}


def ts(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")
