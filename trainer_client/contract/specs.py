"""The StreamingJob config model: one typed, validated view of a manifest.

Used by `splitfeed local`, the sidecar (which receives the job as a mounted
ConfigMap) and the operator (which receives it from Kopf), so that all three
agree on defaults and on what is an error. Field names on the wire are the
contract in docs/architecture.md; Python names are their snake_case twins.

Each field is declared once, on the dataclasses below: type and default in Python,
a `fields.Rule` (kind, minimum, maximum) in its metadata, its wire name its camelCase
twin; trainer_client/contract/fields.py reads manifests by those rules. Parsing reads them rather than using pydantic because this layer must stay
importable with pyzmq, numpy and pyarrow alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import urllib.parse
from collections.abc import Mapping
from typing import Any

from . import wellknown, fields, topology

API_VERSION = wellknown.API_VERSION
KIND = wellknown.KIND


SpecError = fields.SpecError
"""What parse_job raises for a manifest that is not a valid StreamingJob (defined in fields.py)."""


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """lancedb's pack_sequences, eos_id, pad_id, blocks_per_epoch and the token column."""

    column: str = dataclasses.field(metadata=fields.rule("str"))
    block_size: int = dataclasses.field(metadata=fields.rule("int", 1))
    eos_id: int = dataclasses.field(metadata=fields.rule("int"))
    pad_id: int = dataclasses.field(metadata=fields.rule("int"))
    blocks_per_epoch: int | str = dataclasses.field(metadata=fields.rule("blocksPerEpoch", 1))
    """A multiple of numSplits, or "auto" (estimated once, from epoch 0, for the job)."""


ON_TRANSFORM_ERROR = ("raise", "fill", "skip", "warn")
DROPPING = ("skip", "warn")
"""Accepted spec.data.onTransformError values: raise, fill (a substitute row), and lancedb's
skip/warn (the row is dropped; the world agrees where each epoch ends, docs/preprocessing.md)."""


RESCALES = ("recreate", "inPlace")
"""Accepted spec.rescale values: recreate replaces every pod at a rescale; inPlace keeps the
pods that stay and changes their world at the agreed step (docs/operator.md)."""
RECREATE, IN_PLACE = RESCALES


MAX_TRANSFORM_PARALLELISM = 256
"""More transform threads than that per loader process only adds contention."""
DEFAULT_TRANSFORM_QUEUE_DEPTH = 4
MAX_TRANSFORM_QUEUE_DEPTH = 64
"""A queue of 64 read batches per split already holds ~ 64 x readBatchSize decoded rows
per split in memory; more would only hide a slow trainer."""


DEFAULT_READ_AHEAD = "256Mi"
"""spec.data.readAheadBytes when absent: fits beside a 2Gi ring in a sidecar of a few GiB."""


@dataclasses.dataclass(frozen=True)
class DataSpec:
    uri: str = dataclasses.field(metadata=fields.rule("str"))
    """Anything `lancedb.connect` accepts: a local path, s3://bucket/db, ..."""
    table: str = dataclasses.field(metadata=fields.rule("str"))
    num_splits: int = dataclasses.field(metadata=fields.rule("int", 1, 1_000_000))
    """Fixed splits the table is cut into; the unit of elasticity."""
    global_batch_size: int = dataclasses.field(metadata=fields.rule("int", 1))
    """Rows per global training step, summed over all ranks."""
    columns: tuple[str, ...] | None = dataclasses.field(default=None, metadata=fields.rule("strlist"))
    filter: str | None = dataclasses.field(default=None, metadata=fields.rule("str"))
    """SQL predicate applied before splitting."""
    storage_options_secret: str | None = dataclasses.field(default=None, metadata=fields.rule("str"))
    """Secret whose keys become lancedb storage options (credentials)."""
    storage_options: Mapping[str, str] = dataclasses.field(default_factory=dict, metadata=fields.rule("strmap"))
    """Non-secret storage options (endpoint, region); never credentials."""
    shuffle: bool = dataclasses.field(default=True, metadata=fields.rule("bool"))
    shuffle_seed: int = dataclasses.field(default=0, metadata=fields.rule("int", 0))
    shuffle_clump_size: int = dataclasses.field(default=0, metadata=fields.rule("int", 0))
    """0 shuffles rows one by one; n > 0 shuffles runs of n rows."""
    epochs: int = dataclasses.field(default=1, metadata=fields.rule("int", 1))
    num_workers: int = dataclasses.field(default=1, metadata=fields.rule("int", 1, 64))
    """Loader worker processes per rank."""
    read_batch_size: int = dataclasses.field(default=64, metadata=fields.rule("int", 1, 1_000_000))
    """Rows fetched from one split per read."""
    read_ahead_bytes: str = dataclasses.field(default=DEFAULT_READ_AHEAD, metadata=fields.rule("quantity"))
    """Bytes of table reads a sidecar keeps in flight ahead of the trainer (its loaders share
    them): with an object store's 10-50 ms per request, throughput is (requests in flight x
    rows per request / latency), so reads of several steps overlap up to this budget
    (sidecar/data/reading.py)."""
    version: int | str | None = dataclasses.field(default=None, metadata=fields.rule("version", 1))
    """The table version to read from start to end (lancedb time travel): a version
    number or a tag. None: the version current when the job first starts, which the
    sidecar then fixes here (as a number) so that every reader opens the same one."""
    transform: str | None = dataclasses.field(default=None, metadata=fields.rule("importPath"))
    """"package.module:function", applied by the sidecar to each read batch exactly as
    lancedb's StreamingDataset(transform=...) does (docs/preprocessing.md)."""
    transform_args: str | None = dataclasses.field(default=None, metadata=fields.rule("jsonObject"))
    """A JSON object: keyword arguments bound to the transform (see transform_kwargs)."""
    on_transform_error: str = dataclasses.field(default="raise", metadata=fields.rule("onTransformError"))
    """One of ON_TRANSFORM_ERROR: what a row whose transform fails becomes."""
    pack_sequences: PackSpec | None = dataclasses.field(
        default=None, metadata=fields.rule("packSequences", model=PackSpec))
    """Sequence packing (lancedb's pack_sequences) of one token-list column."""
    transform_parallelism: int | None = dataclasses.field(
        default=None, metadata=fields.rule("int", 1, MAX_TRANSFORM_PARALLELISM))
    """Transform threads per loader process (lancedb's transform_parallelism). None: the
    CPUs the sidecar may use (affinity and cgroup quota), shared among numWorkers
    processes (streaming.transform_parallelism, docs/preprocessing.md)."""
    transform_queue_depth: int = dataclasses.field(
        default=DEFAULT_TRANSFORM_QUEUE_DEPTH, metadata=fields.rule("int", 1, MAX_TRANSFORM_QUEUE_DEPTH))
    """Transformed read batches a split may hold ahead of the step being assembled
    (lancedb's transform_queue_depth): bounds decoded rows in memory while the ring is full."""
    ranks_per_batch: int = dataclasses.field(default=1, metadata=fields.rule("int", 1))
    """Ranks that take the same batch: the model-parallel degree (tensor x context x pipeline).
    Splits follow the data-parallel rank (topology.Groups.rank); 1 is plain data
    parallelism. Not an order field: the global batch of a step does not depend on it."""
    pipeline_stages: int = dataclasses.field(default=1, metadata=fields.rule("int", 1))
    """Of ranksPerBatch, the pipeline-parallel degree, laid out outside data parallelism as
    torchtitan and Megatron-LM order their meshes (README, "Model parallelism"; docs/architecture.md)."""

    @property
    def drops_rows(self) -> bool:
        """onTransformError skip/warn on a transform: a row that fails is dropped, so an epoch
        may end early, where the world agrees (docs/preprocessing.md)."""
        return bool(self.transform) and self.on_transform_error in DROPPING

    @property
    def groups(self) -> topology.Groups:
        """Which ranks share a batch (README, "Model parallelism"; docs/architecture.md)."""
        return topology.Groups(self.ranks_per_batch, self.pipeline_stages)

    @property
    def transform_kwargs(self) -> dict[str, Any]:
        """transformArgs decoded (checked to be a JSON object when parsed)."""
        return dict(json.loads(self.transform_args)) if self.transform_args else {}


ORDER_FIELDS = (
    "uri", "table", "version", "columns", "filter", "numSplits", "shuffle", "shuffleSeed",
    "shuffleClumpSize", "globalBatchSize", "transform", "transformArgs", "onTransformError",
    "packSequences",
)
"""spec.data fields that decide which row is delivered at which global step: fixed
for the life of a job (CRD rules, the admission webhook) and checked against a
checkpoint's provenance before it is resumed. epochs may change (the order of
epoch e does not depend on how many follow); numWorkers and readBatchSize do not
touch the order."""


@dataclasses.dataclass(frozen=True)
class ResumeFrom:
    """Another job's checkpoints to start from (same namespace and checkpoint.uri)."""

    uid: str = dataclasses.field(metadata=fields.rule("str"))
    """metadata.uid of the job that wrote them; checkpoints are kept per job UID."""
    name: str | None = dataclasses.field(default=None, metadata=fields.rule("str"))
    """That job's name; None: this job's own name (a deleted and re-created job)."""


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    uri: str | None = dataclasses.field(default=None, metadata=fields.rule("str"))
    """Where data checkpoints go (local path or s3://); None disables them."""
    timeout_seconds: int = dataclasses.field(default=300, metadata=fields.rule("int", 1))
    """How long a rescale waits for a complete checkpoint before giving up on it."""
    resume_from: ResumeFrom | None = dataclasses.field(default=None, metadata=fields.rule("resumeFrom", model=ResumeFrom))
    """Start from another job's checkpoints when this one has none of its own; a job
    otherwise never sees checkpoints it did not write (they are keyed by its UID)."""


@dataclasses.dataclass(frozen=True)
class SidecarSpec:
    image: str = dataclasses.field(default="splitfeed:0.1.0", metadata=fields.rule("str"))
    resources: Mapping[str, Any] = dataclasses.field(default_factory=dict, metadata=fields.rule("map"))
    shm_size: str = dataclasses.field(default="2Gi", metadata=fields.rule("quantity"))
    prefetch_batches: int = dataclasses.field(default=4, metadata=fields.rule("int", 1, 64))
    """Ring slots per rank: how far the loader may run ahead of the trainer."""


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    template: Mapping[str, Any] = dataclasses.field(default_factory=dict, metadata=fields.rule("map"))
    """A PodTemplateSpec; its container named "trainer" is the user's."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
    name: str
    """metadata.name (not a spec field: no rule)."""
    data: DataSpec = dataclasses.field(metadata=fields.rule("section", model=DataSpec))
    namespace: str = "default"
    """metadata.namespace (not a spec field: no rule)."""
    replicas: int = dataclasses.field(default=1, metadata=fields.rule("int", 1))
    gpus_per_replica: int = dataclasses.field(default=1, metadata=fields.rule("int", 1, 64))
    suspend: bool = dataclasses.field(default=False, metadata=fields.rule("bool"))
    max_restarts: int = dataclasses.field(default=3, metadata=fields.rule("int", 0))
    """World restarts after pod failures before the job is marked Failed."""
    status_interval_seconds: int = dataclasses.field(default=15, metadata=fields.rule("int", 5))
    """How often the operator asks a running world for its progress (status.progress)."""
    rescale: str = dataclasses.field(default=RECREATE, metadata=fields.rule("rescale"))
    """recreate or inPlace: what a change of replicas does to the pods that stay."""
    checkpoint: CheckpointSpec = dataclasses.field(
        default_factory=CheckpointSpec, metadata=fields.rule("section", model=CheckpointSpec))
    sidecar: SidecarSpec = dataclasses.field(default_factory=SidecarSpec, metadata=fields.rule("section", model=SidecarSpec))
    trainer: TrainerSpec = dataclasses.field(default_factory=TrainerSpec, metadata=fields.rule("section", model=TrainerSpec))

    @property
    def world_size(self) -> int:
        return topology.world_size(self.replicas, self.gpus_per_replica)

    @property
    def in_place(self) -> bool:
        """spec.rescale is inPlace: pods are named by replica alone and outlive a world."""
        return self.rescale == IN_PLACE

    def check_topology(self, replicas: int | None = None) -> None:
        """Raise topology.TopologyError if `replicas` (default: spec's) is invalid."""
        topology.check(
            replicas=self.replicas if replicas is None else replicas,
            gpus_per_replica=self.gpus_per_replica,
            num_splits=self.data.num_splits,
            num_workers=self.data.num_workers,
            global_batch_size=self.data.global_batch_size,
            ranks_per_batch=self.data.ranks_per_batch,
        )

    def allowed_replicas(self) -> list[int]:
        return topology.allowed_replicas(
            gpus_per_replica=self.gpus_per_replica,
            num_splits=self.data.num_splits,
            num_workers=self.data.num_workers,
            global_batch_size=self.data.global_batch_size,
            ranks_per_batch=self.data.ranks_per_batch,
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

_DATA_FIELDS = fields.wire_fields(DataSpec)


MAXIMA: dict[str, int] = fields.maxima("spec", JobSpec)
"""Upper bounds, the CRD's `maximum`s (tests keep them equal). They keep every piece of
work an operator or a sidecar does per job small: status.allowedReplicas is at most a few
hundred divisors, a rank reads at most numSplits/worldSize splits in numWorkers processes,
a read is at most 10^6 rows, a ring at most 64 slots."""


def _resume_from(path: str, rule: fields.Rule, value: Any) -> ResumeFrom:
    source = ResumeFrom(**_READER.section(path, value, ResumeFrom))
    for key, part in (("uid", source.uid), ("name", source.name)):
        if part is not None and ("/" in part or part in (".", "..")):
            raise SpecError(f"{path}.{key}", f"names a checkpoint directory and cannot be {part!r}")
    return source


def _pack_sequences(path: str, value: Any) -> PackSpec:
    return PackSpec(**_READER.section(path, value, PackSpec))


def _import_path(path: str, rule: fields.Rule, value: Any) -> str:
    """Check "package.module:function" syntax; importing happens in the sidecar."""
    text = fields.to_str(path, value)
    module, sep, attr = text.partition(":")
    if not sep or not all(part.isidentifier() for part in module.split(".")) or not all(
        part.isidentifier() for part in attr.split(".")
    ):
        raise SpecError(
            path, f"must be an import path 'package.module:function', got {text!r}"
        )
    return text


def _json_object(path: str, rule: fields.Rule, value: Any) -> str:
    text = fields.to_str(path, value)
    try:
        decoded = json.loads(text)
    except ValueError as exc:
        raise SpecError(path, f"must be a JSON object such as '{{\"size\": 224}}': {exc}") from None
    if not isinstance(decoded, dict):
        raise SpecError(path, f"must be a JSON object of keyword arguments, got {text!r}")
    return text


def _on_transform_error(path: str, rule: fields.Rule, value: Any) -> str:
    return _one_of(path, value, ON_TRANSFORM_ERROR)


def _one_of(path: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise SpecError(path, f"must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)


def _blocks_per_epoch(path: str, rule: fields.Rule, value: Any) -> int | str:
    if value == "auto":
        return "auto"
    if isinstance(value, str):
        raise SpecError(path, f"must be a positive integer or 'auto', got {value!r}")
    return fields.to_int(path, value, rule.minimum, rule.maximum)


def _quantity(path: str, rule: fields.Rule, value: Any) -> str:
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise SpecError(path, f"must be a Kubernetes quantity such as 2Gi, got {value!r}")
    parse_quantity_bytes(str(value), path)
    return str(value)


def _check_preprocessing(data: DataSpec) -> None:
    """Rules between the preprocessing fields (lancedb's own, made manifest errors)."""
    pack = data.pack_sequences
    if data.transform_args and not data.transform:
        raise SpecError("spec.data.transformArgs", "needs spec.data.transform")
    if pack is None:
        return
    if data.transform:
        raise SpecError(
            "spec.data.packSequences",
            "cannot be combined with spec.data.transform (lancedb packs raw token lists); "
            "tokenise into a column first, or drop one of them",
        )
    if data.columns is not None and list(data.columns) != [pack.column]:
        raise SpecError(
            "spec.data.columns",
            f"with packSequences must be [{pack.column!r}] or absent, got {list(data.columns)!r}",
        )
    bpe = pack.blocks_per_epoch
    if isinstance(bpe, int) and bpe % data.num_splits:
        raise SpecError(
            "spec.data.packSequences.blocksPerEpoch",
            f"must be a multiple of spec.data.numSplits={data.num_splits}, got {bpe}",
        )
    if pack.pad_id == pack.eos_id:
        raise SpecError(
            "spec.data.packSequences.padId",
            "must differ from eosId (padding is masked by input_ids == padId)",
        )


_READER = fields.Reader(
    kinds={
        "quantity": _quantity,
        "resumeFrom": _resume_from,
        "importPath": _import_path,
        "jsonObject": _json_object,
        "onTransformError": _on_transform_error,
        "rescale": lambda path, rule, value: _one_of(path, value, RESCALES),
        "blocksPerEpoch": _blocks_per_epoch,
        "packSequences": lambda path, rule, value: _pack_sequences(path, value),
    },
    checks={DataSpec: _check_preprocessing},
)
"""The StreamingJob's own kinds beside fields.SHARED_KINDS, and its one cross-field check."""


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
    fields.reject_unknown("", manifest, {"apiVersion", "kind", "metadata", "spec", "status"})
    metadata = manifest.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise SpecError("metadata", "must be a mapping")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError("metadata.name", "is required")
    raw_spec = manifest.get("spec")
    if not isinstance(raw_spec, Mapping):
        raise SpecError("spec", "is required and must be a mapping")
    job = JobSpec(name=name, namespace=str(metadata.get("namespace") or "default"),
                  **_READER.section("spec", raw_spec, JobSpec))
    _check_checkpoint_uri(job.checkpoint.uri)
    _check_parallelism(job.data)
    if check_replicas:
        job.check_topology()
    return job


CHECKPOINT_SCHEMES = ("", "file", "s3")
"""What the checkpoint store writes to (sidecar/world/checkpoints.py: pyarrow's local and S3
filesystems); lancedb reads more (gs://, az://), so spec.data.uri takes those."""


def _check_checkpoint_uri(uri: str | None) -> None:
    """An unsupported store is refused when the job is applied, not when its first sidecar
    starts on a GPU node (docs/credentials.md says how to reach GCS through S3)."""
    if uri is None:
        return
    scheme = urllib.parse.urlparse(uri).scheme
    if scheme not in CHECKPOINT_SCHEMES:
        raise SpecError("spec.checkpoint.uri", (
            f"must be a local path or s3://bucket/prefix, got {scheme}://: checkpoints are written "
            "through S3 or a mounted volume (an S3-compatible endpoint such as GCS's "
            "https://storage.googleapis.com works as s3:// with storageOptions aws_endpoint)"))


def _check_parallelism(data: DataSpec) -> None:
    """topology.Groups' own rule, said with the field's name and the fix."""
    try:
        data.groups
    except ValueError:
        raise SpecError("spec.data.pipelineStages", (
            f"must divide spec.data.ranksPerBatch={data.ranks_per_batch}, got {data.pipeline_stages}: "
            "ranksPerBatch counts every rank of a model-parallel group, its pipeline stages included")) from None


def idle_fields(data: DataSpec) -> list[str]:
    """Fields set on this job that change nothing in it, each as a warning naming the fix.

    Warnings, not errors: a job admitted with them before must keep running on a newer
    operator, and they are harmless; a user who set them expected an effect, though.
    """
    out = []
    preprocessing = "spec.data.transform or spec.data.packSequences"
    if not data.transform and data.pack_sequences is None:
        if data.transform_parallelism is not None:
            out.append(f"spec.data.transformParallelism does nothing without {preprocessing}; remove it")
        if data.transform_queue_depth != DEFAULT_TRANSFORM_QUEUE_DEPTH:
            out.append(f"spec.data.transformQueueDepth does nothing without {preprocessing}; remove it")
    if not data.transform and data.on_transform_error != "raise":
        out.append(f"spec.data.onTransformError={data.on_transform_error} does nothing without "
                   "spec.data.transform (no row can fail a transform); remove it")
    return out


def _wire_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, PackSpec):
        return {key: getattr(value, field.name) for key, field in fields.wire_fields(PackSpec).items()}
    if isinstance(value, Mapping):
        return dict(value)
    return value


def _data_to_wire(data: DataSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in _DATA_FIELDS.items():
        value = _wire_value(getattr(data, field.name))
        if value is None or (key == "storageOptions" and not value):
            continue
        if key == "onTransformError" and value == "raise" and not data.transform:
            continue  # the default, kept off configs of jobs without a transform
        if key == "transformQueueDepth" and value == DEFAULT_TRANSFORM_QUEUE_DEPTH:
            continue  # the default: configs of jobs that leave it out stay as they were
        if key == "readAheadBytes" and value == DEFAULT_READ_AHEAD:
            continue
        if key in ("ranksPerBatch", "pipelineStages") and value == 1:
            continue  # plain data parallelism: configs of jobs that leave them out stay as they were
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
    return {key: _wire_value(getattr(data, _DATA_FIELDS[key].name)) for key in ORDER_FIELDS}


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
