"""The StreamingJob config model: one typed, validated view of a manifest.

Used by `splitfeed local`, the sidecar (which receives the job as a mounted
ConfigMap) and the operator (which receives it from Kopf), so that all three
agree on defaults and on what is an error. Field names on the wire are the
contract in docs/architecture.md; Python names are their snake_case twins.

Parsing is table-driven rather than pydantic-based because this layer must stay
importable with pyzmq, numpy and pyarrow alone.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from . import contract, topology

API_VERSION = contract.API_VERSION
KIND = contract.KIND


class SpecError(ValueError):
    """A manifest that does not describe a valid StreamingJob; names the field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclasses.dataclass(frozen=True)
class DataSpec:
    uri: str
    """Anything `lancedb.connect` accepts: a local path, s3://bucket/db, ..."""
    table: str
    num_splits: int
    """Fixed splits the table is cut into; the unit of elasticity."""
    global_batch_size: int
    """Rows per global training step, summed over all ranks."""
    columns: tuple[str, ...] | None = None
    filter: str | None = None
    """SQL predicate applied before splitting."""
    storage_options_secret: str | None = None
    """Secret whose keys become lancedb storage options (credentials)."""
    storage_options: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Non-secret storage options (endpoint, region); never credentials."""
    shuffle: bool = True
    shuffle_seed: int = 0
    shuffle_clump_size: int = 0
    """0 shuffles rows one by one; n > 0 shuffles runs of n rows."""
    epochs: int = 1
    num_workers: int = 1
    """Loader worker processes per rank."""
    read_batch_size: int = 64
    """Rows fetched from one split per read."""
    version: int | str | None = None
    """The table version to read from start to end (lancedb time travel): a version
    number or a tag. None: the version current when the job first starts, which the
    sidecar then fixes here (as a number) so that every reader opens the same one."""


ORDER_FIELDS = (
    "uri", "table", "version", "columns", "filter", "numSplits", "shuffle", "shuffleSeed",
    "shuffleClumpSize", "globalBatchSize",
)
"""spec.data fields that decide which row is delivered at which global step: fixed
for the life of a job (CRD rules, the admission webhook) and checked against a
checkpoint's provenance before it is resumed. epochs may change (the order of
epoch e does not depend on how many follow); numWorkers and readBatchSize do not
touch the order."""


@dataclasses.dataclass(frozen=True)
class ResumeFrom:
    """Another job's checkpoints to start from (same namespace and checkpoint.uri)."""

    uid: str
    """metadata.uid of the job that wrote them; checkpoints are kept per job UID."""
    name: str | None = None
    """That job's name; None: this job's own name (a deleted and re-created job)."""


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    uri: str | None = None
    """Where data checkpoints go (local path or s3://); None disables them."""
    timeout_seconds: int = 300
    """How long a rescale waits for a complete checkpoint before giving up on it."""
    resume_from: ResumeFrom | None = None
    """Start from another job's checkpoints when this one has none of its own; a job
    otherwise never sees checkpoints it did not write (they are keyed by its UID)."""


@dataclasses.dataclass(frozen=True)
class SidecarSpec:
    image: str = "splitfeed:0.1.0"
    resources: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    shm_size: str = "2Gi"
    prefetch_batches: int = 4
    """Ring slots per rank: how far the loader may run ahead of the trainer."""


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    template: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """A PodTemplateSpec; its container named "trainer" is the user's."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
    name: str
    data: DataSpec
    namespace: str = "default"
    replicas: int = 1
    gpus_per_replica: int = 1
    suspend: bool = False
    max_restarts: int = 3
    """World restarts after pod failures before the job is marked Failed."""
    checkpoint: CheckpointSpec = dataclasses.field(default_factory=CheckpointSpec)
    sidecar: SidecarSpec = dataclasses.field(default_factory=SidecarSpec)
    trainer: TrainerSpec = dataclasses.field(default_factory=TrainerSpec)

    @property
    def world_size(self) -> int:
        return topology.world_size(self.replicas, self.gpus_per_replica)

    def check_topology(self, replicas: int | None = None) -> None:
        """Raise topology.TopologyError if `replicas` (default: spec's) is invalid."""
        topology.check(
            replicas=self.replicas if replicas is None else replicas,
            gpus_per_replica=self.gpus_per_replica,
            num_splits=self.data.num_splits,
            num_workers=self.data.num_workers,
            global_batch_size=self.data.global_batch_size,
        )

    def allowed_replicas(self) -> list[int]:
        return topology.allowed_replicas(
            gpus_per_replica=self.gpus_per_replica,
            num_splits=self.data.num_splits,
            num_workers=self.data.num_workers,
            global_batch_size=self.data.global_batch_size,
        )

    def data_config(self) -> dict[str, Any]:
        """The part of the spec the loader needs; what the ConfigMap carries."""
        return {
            "name": self.name,
            "namespace": self.namespace,
            "gpusPerReplica": self.gpus_per_replica,
            "data": _data_to_wire(self.data),
            "checkpoint": _checkpoint_to_wire(self.checkpoint),
            "sidecar": {"prefetchBatches": self.sidecar.prefetch_batches},
        }


def data_config_checksum(config: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a data config; the sidecar re-checks it."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


# --- parsing -----------------------------------------------------------------

# wire key -> (python name, kind, required, minimum); kinds are checked below.
_Field = tuple[str, str, bool, int | None]

_DATA_FIELDS: dict[str, _Field] = {
    "uri": ("uri", "str", True, None),
    "table": ("table", "str", True, None),
    "numSplits": ("num_splits", "int", True, 1),
    "globalBatchSize": ("global_batch_size", "int", True, 1),
    "columns": ("columns", "strlist", False, None),
    "filter": ("filter", "str", False, None),
    "storageOptionsSecret": ("storage_options_secret", "str", False, None),
    "storageOptions": ("storage_options", "strmap", False, None),
    "shuffle": ("shuffle", "bool", False, None),
    "shuffleSeed": ("shuffle_seed", "int", False, 0),
    "shuffleClumpSize": ("shuffle_clump_size", "int", False, 0),
    "epochs": ("epochs", "int", False, 1),
    "numWorkers": ("num_workers", "int", False, 1),
    "readBatchSize": ("read_batch_size", "int", False, 1),
    "version": ("version", "version", False, 1),
}
_CHECKPOINT_FIELDS: dict[str, _Field] = {
    "uri": ("uri", "str", False, None),
    "timeoutSeconds": ("timeout_seconds", "int", False, 1),
    "resumeFrom": ("resume_from", "resumeFrom", False, None),
}
_RESUME_FROM_FIELDS: dict[str, _Field] = {
    "uid": ("uid", "str", True, None),
    "name": ("name", "str", False, None),
}
_SIDECAR_FIELDS: dict[str, _Field] = {
    "image": ("image", "str", False, None),
    "resources": ("resources", "map", False, None),
    "shmSize": ("shm_size", "quantity", False, None),
    "prefetchBatches": ("prefetch_batches", "int", False, 1),
}
_TRAINER_FIELDS: dict[str, _Field] = {
    "template": ("template", "map", False, None),
}
_SPEC_FIELDS: dict[str, _Field] = {
    "replicas": ("replicas", "int", False, 1),
    "gpusPerReplica": ("gpus_per_replica", "int", False, 1),
    "suspend": ("suspend", "bool", False, None),
    "maxRestarts": ("max_restarts", "int", False, 0),
}
_SECTIONS = {"data", "checkpoint", "sidecar", "trainer"}


def _reject_unknown(path: str, raw: Mapping[str, Any], known: set[str]) -> None:
    for key in raw:
        if key not in known:
            hint = difflib.get_close_matches(str(key), sorted(known), n=1)
            suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
            allowed = ", ".join(sorted(known))
            raise SpecError(
                f"{path}.{key}", f"unknown field{suggestion} (known fields: {allowed})"
            )


MAXIMA: dict[str, int] = {
    "spec.gpusPerReplica": 64,
    "spec.data.numSplits": 1_000_000,
    "spec.data.numWorkers": 64,
    "spec.data.readBatchSize": 1_000_000,
    "spec.sidecar.prefetchBatches": 64,
}
"""Upper bounds, the CRD's `maximum`s (tests keep them equal). They keep every piece of
work an operator or a sidecar does per job small: status.allowedReplicas is at most a few
hundred divisors, a rank reads at most numSplits/worldSize splits in numWorkers processes,
a read is at most 10^6 rows, a ring at most 64 slots."""


def _convert(path: str, kind: str, value: Any, minimum: int | None) -> Any:
    if kind == "str":
        if not isinstance(value, str) or not value:
            raise SpecError(path, f"must be a non-empty string, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, f"must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise SpecError(path, f"must be at least {minimum}, got {value}")
        if path in MAXIMA and value > MAXIMA[path]:
            raise SpecError(path, f"must be at most {MAXIMA[path]}, got {value}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise SpecError(path, f"must be true or false, got {value!r}")
        return value
    if kind == "strlist":
        if not isinstance(value, list) or not value or not all(
            isinstance(v, str) and v for v in value
        ):
            raise SpecError(path, f"must be a non-empty list of column names, got {value!r}")
        if len(set(value)) != len(value):
            raise SpecError(path, f"lists a column twice: {value!r}")
        return tuple(value)
    if kind == "strmap":
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise SpecError(path, f"must map strings to strings, got {value!r}")
        return dict(value)
    if kind == "map":
        if not isinstance(value, Mapping):
            raise SpecError(path, f"must be a mapping, got {value!r}")
        return dict(value)
    if kind == "version":
        if isinstance(value, str):
            return _convert(path, "str", value, None)
        return _convert(path, "int", value, minimum)
    if kind == "resumeFrom":
        source = ResumeFrom(**_section(path, value, _RESUME_FROM_FIELDS))
        for key, part in (("uid", source.uid), ("name", source.name)):
            if part is not None and ("/" in part or part in (".", "..")):
                raise SpecError(f"{path}.{key}", f"names a checkpoint directory and cannot be {part!r}")
        return source
    if kind == "quantity":
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise SpecError(path, f"must be a Kubernetes quantity such as 2Gi, got {value!r}")
        parse_quantity_bytes(str(value), path)
        return str(value)
    raise AssertionError(f"unknown kind {kind}")  # a bug in the tables above


def _section(path: str, raw: Any, fields: dict[str, _Field]) -> dict[str, Any]:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise SpecError(path, f"must be a mapping, got {raw!r}")
    _reject_unknown(path, raw, set(fields))
    out: dict[str, Any] = {}
    for key, (name, kind, required, minimum) in fields.items():
        if key not in raw or raw[key] is None:
            if required:
                raise SpecError(f"{path}.{key}", "is required")
            continue
        out[name] = _convert(f"{path}.{key}", kind, raw[key], minimum)
    return out


_QUANTITY_SUFFIXES = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1,
}


def parse_quantity_bytes(value: str, path: str = "quantity") -> int:
    """Bytes in a Kubernetes memory quantity ("2Gi", "512Mi", "1000000")."""
    for suffix in sorted(_QUANTITY_SUFFIXES, key=len, reverse=True):
        if value.endswith(suffix):
            number = value[: len(value) - len(suffix)] if suffix else value
            if number.isdigit():
                return int(number) * _QUANTITY_SUFFIXES[suffix]
    raise SpecError(path, f"must be a quantity such as 2Gi or 512Mi, got {value!r}")


def parse_job(manifest: Mapping[str, Any], *, check_replicas: bool = True) -> JobSpec:
    """Turn a StreamingJob manifest (already loaded from YAML/JSON) into a JobSpec.

    Checks types, bounds and unknown fields, and (unless `check_replicas` is
    False, for callers that choose the world size themselves) the divisibility
    rules for the requested replica count; the row-count rule needs the table
    and is checked by the sidecar. Raises SpecError or topology.TopologyError.
    """
    if not isinstance(manifest, Mapping):
        raise SpecError("manifest", "must be a mapping (a StreamingJob object)")
    if manifest.get("apiVersion") != API_VERSION:
        raise SpecError("apiVersion", f"must be {API_VERSION!r}, got {manifest.get('apiVersion')!r}")
    if manifest.get("kind") != KIND:
        raise SpecError("kind", f"must be {KIND!r}, got {manifest.get('kind')!r}")
    _reject_unknown("", manifest, {"apiVersion", "kind", "metadata", "spec", "status"})
    metadata = manifest.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise SpecError("metadata", "must be a mapping")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError("metadata.name", "is required")
    raw_spec = manifest.get("spec")
    if not isinstance(raw_spec, Mapping):
        raise SpecError("spec", "is required and must be a mapping")
    _reject_unknown("spec", raw_spec, set(_SPEC_FIELDS) | _SECTIONS)
    spec_kwargs = _section("spec", {k: v for k, v in raw_spec.items() if k in _SPEC_FIELDS}, _SPEC_FIELDS)
    if "data" not in raw_spec:
        raise SpecError("spec.data", "is required")
    job = JobSpec(
        name=name,
        namespace=str(metadata.get("namespace") or "default"),
        data=DataSpec(**_section("spec.data", raw_spec["data"], _DATA_FIELDS)),
        checkpoint=CheckpointSpec(
            **_section("spec.checkpoint", raw_spec.get("checkpoint"), _CHECKPOINT_FIELDS)
        ),
        sidecar=SidecarSpec(**_section("spec.sidecar", raw_spec.get("sidecar"), _SIDECAR_FIELDS)),
        trainer=TrainerSpec(**_section("spec.trainer", raw_spec.get("trainer"), _TRAINER_FIELDS)),
        **spec_kwargs,
    )
    if check_replicas:
        job.check_topology()
    return job


def _data_to_wire(data: DataSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, (name, _kind, _req, _min) in _DATA_FIELDS.items():
        value = getattr(data, name)
        if isinstance(value, tuple):
            value = list(value)
        if value is None or (key == "storageOptions" and not value):
            continue
        out[key] = value
    return out


def _checkpoint_to_wire(checkpoint: CheckpointSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"uri": checkpoint.uri, "timeoutSeconds": checkpoint.timeout_seconds}
    source = checkpoint.resume_from
    if source is not None:
        out["resumeFrom"] = {"uid": source.uid, **({"name": source.name} if source.name else {})}
    return out


def order_fields(data: DataSpec) -> dict[str, Any]:
    """The ORDER_FIELDS of `data` by wire name (columns as a list, absent ones None)."""
    out: dict[str, Any] = {}
    for key in ORDER_FIELDS:
        value = getattr(data, _DATA_FIELDS[key][0])
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def parse_data_config(config: Mapping[str, Any]) -> JobSpec:
    """Inverse of JobSpec.data_config(): rebuild the loader's view of the job."""
    manifest = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": config.get("name"), "namespace": config.get("namespace")},
        "spec": {
            "gpusPerReplica": config.get("gpusPerReplica", 1),
            "data": config.get("data"),
            "checkpoint": config.get("checkpoint"),
            "sidecar": config.get("sidecar"),
        },
    }
    return parse_job(manifest, check_replicas=False)
