"""Whether a StreamingJob (or a new replica count for one) may be admitted.

Pure. Called by the validating webhooks (create/update and the scale subresource)
and again by `lifecycle` before every reshape, so both say the same thing. On
UPDATE it also refuses what the CRD's transition rules refuse (order-defining
fields changed; a scale or suspend with nowhere to checkpoint), for clusters
where those rules do not run.
The divisibility rules live in trainer_client.topology and the field rules in
trainer_client.specs; this module adds what only a pod-building operator cares
about (names that fit DNS, a "trainer" container, reserved volume names) and
phrases a rejection: the rule that failed and the replica counts that would pass.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from splitfeed.trainer_client.contract import wellknown, errors, specs, topology

from . import planning, redaction

MAX_NAME_LENGTH = 45
"""Pod names are `<job>-w<epoch>-<replica>` and double as hostnames (63 characters)."""
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class Rejected(errors.SplitfeedError, ValueError):
    """A job or scale request that breaks a rule; the message is for the user."""

    def __init__(self, rule: str, detail: str, allowed: list[int] | None = None) -> None:
        self.rule = rule
        self.detail = detail
        self.allowed = allowed
        text = redaction.redact_text(f"rule {rule!r} failed: {detail}")
        if allowed is not None and "Valid replica counts" not in detail:
            text += f". Valid replica counts for this job: [{', '.join(map(str, allowed))}]"
        super().__init__(text)


def _allowed_or_none(job: specs.JobSpec) -> list[int] | None:
    try:
        return job.allowed_replicas()
    except Exception:  # noqa: BLE001 - only a hint for the message
        return None


def check_name(name: str) -> None:
    if len(name) > MAX_NAME_LENGTH or not _DNS_1035.match(name):
        raise Rejected(
            "metadata.name is a DNS-1035 label of at most 45 characters",
            f"{name!r} is not: it names the headless Service and prefixes pod hostnames",
        )


MAXIMA = specs.MAXIMA
"""The CRD's `maximum`s. Parsing refuses a value over one (specs.SpecError, so `splitfeed
local` and `plan` say the same); they keep every job's planning, status and loader small."""


_CREDENTIAL_KEY = re.compile(
    r"secret|password|passwd|token|credential|private_key|account_key|access_key|master_key|sas_key|"
    r"signature|api_key|apikey", re.IGNORECASE)


def check_storage_options(job: specs.JobSpec) -> None:
    """Credentials belong in the Secret named by data.storageOptionsSecret, never in the spec
    (anyone who may read the job, or its ConfigMap, would see them)."""
    found = sorted(k for k in job.data.storage_options if _CREDENTIAL_KEY.search(k))
    if found:
        secret = job.data.storage_options_secret or "<a Secret>"
        raise Rejected(
            "spec.data.storageOptions holds no credentials",
            f"{', '.join(found)} look{'s' if len(found) == 1 else ''} like credentials: remove "
            f"{'it' if len(found) == 1 else 'them'} from spec.data.storageOptions and put "
            f"{'it' if len(found) == 1 else 'them'} in the Secret named by spec.data.storageOptionsSecret "
            f"(kubectl create secret generic {secret} --from-literal={found[0]}=...): one key per option, "
            "mounted only into the loader sidecar",
        )


_CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


def _shape(path: str, value: Any, kind: type, problems: list[str]) -> Any:
    if value is None:
        return kind()
    if not isinstance(value, kind):
        problems.append(f"{path} must be a{'n' if kind is list else ''} {'list' if kind is list else 'mapping'}, "
                        f"got {type(value).__name__}")
        return kind()
    return value


def _string_map(path: str, value: Any, problems: list[str]) -> None:
    for k, v in _shape(path, value, dict, problems).items():
        if not isinstance(k, str) or not isinstance(v, str):
            problems.append(f"{path} must map strings to strings, got {k!r}: {v!r}")


def template_problems(template: Mapping[str, Any]) -> list[str]:
    """What in the template's shape would stop the operator from building pods from it.

    Only the parts `planning.pod` reads and extends (metadata labels and annotations,
    containers, their env and mounts, volumes): a full PodSpec validation is the
    apiserver's (a dry-run at admission, and a 422 at creation fails the job). This
    keeps a malformed template a clear InvalidSpec condition instead of a crash.
    """
    problems: list[str] = []
    base = "spec.trainer.template"
    meta = _shape(f"{base}.metadata", template.get("metadata"), dict, problems)
    for key in ("labels", "annotations"):
        _string_map(f"{base}.metadata.{key}", meta.get(key), problems)
    spec = _shape(f"{base}.spec", template.get("spec"), dict, problems)
    for key in _CONTAINER_LISTS:
        for i, c in enumerate(_shape(f"{base}.spec.{key}", spec.get(key), list, problems)):
            at = f"{base}.spec.{key}[{i}]"
            if not isinstance(c, dict):
                problems.append(f"{at} must be a mapping, got {type(c).__name__}")
                continue
            if not isinstance(c.get("name"), str) or not c.get("name"):
                problems.append(f"{at}.name must be a non-empty string")
            for sub, required in (("env", ("name",)), ("volumeMounts", ("name", "mountPath")),
                                  ("volumeDevices", ("name", "devicePath"))):
                for j, item in enumerate(_shape(f"{at}.{sub}", c.get(sub), list, problems)):
                    if not isinstance(item, dict) or not all(isinstance(item.get(r), str) and item.get(r)
                                                             for r in required):
                        problems.append(f"{at}.{sub}[{j}] must be a mapping with {' and '.join(required)}")
    for i, v in enumerate(_shape(f"{base}.spec.volumes", spec.get("volumes"), list, problems)):
        if not isinstance(v, dict) or not isinstance(v.get("name"), str) or not v.get("name"):
            problems.append(f"{base}.spec.volumes[{i}] must be a mapping with a name")
    if not isinstance(spec.get("restartPolicy", "Never"), str):
        problems.append(f"{base}.spec.restartPolicy must be a string")
    return problems


def check_template(job: specs.JobSpec) -> None:
    """The pod template must be something `planning.pod` can inject into."""
    template: Mapping[str, Any] = job.trainer.template
    problems = template_problems(template)
    if problems:
        raise Rejected("spec.trainer.template is a pod template", "; ".join(problems[:5])
                       + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    spec = template.get("spec") or {}
    containers = spec.get("containers") or []
    names = [c.get("name") for c in containers]
    if wellknown.TRAINER_NAME not in names:
        raise Rejected(
            "spec.trainer.template has a container named 'trainer'",
            f"containers are {names or 'missing'}",
        )
    taken = {c.get("name") for c in (spec.get("initContainers") or [])}
    if wellknown.SIDECAR_NAME in set(names) | taken:
        raise Rejected(
            f"container name {wellknown.SIDECAR_NAME!r} is reserved",
            "the operator injects its loader sidecar under that name",
        )
    clash = sorted({v.get("name") for v in spec.get("volumes") or []} & set(wellknown.RESERVED_VOLUMES))
    if clash:
        raise Rejected("volume names splitfeed-* are reserved", f"template uses {clash}")
    mounts = sorted({f"{c.get('name')} mounts {m['name']}"
                     for key in _CONTAINER_LISTS for c in spec.get(key) or []
                     for m in (c.get("volumeMounts") or []) + (c.get("volumeDevices") or [])
                     if m["name"] in wellknown.RESERVED_VOLUMES})
    if mounts:
        raise Rejected(
            "the template's containers mount none of the sidecar's volumes",
            f"{'; '.join(mounts)}: splitfeed-* volumes are the loader's (its storage credentials, "
            "config, pod info and ring); the operator mounts the ring into the trainer itself",
        )
    if spec.get("restartPolicy", "Never") not in ("Never", "OnFailure"):
        raise Rejected(
            "spec.trainer.template.spec.restartPolicy is Never or OnFailure",
            f"got {spec.get('restartPolicy')!r}: a pod that always restarts never finishes",
        )


def check_job(job: specs.JobSpec) -> None:
    """Every rule about a parsed job except its replica count (see check_replicas)."""
    check_name(job.name)
    check_storage_options(job)
    check_template(job)


def check_replicas(job: specs.JobSpec, replicas: int) -> None:
    """The divisibility rules for `replicas` (docs/architecture.md, "Validity rules")."""
    try:
        job.check_topology(replicas)
    except topology.TopologyError as exc:
        rules = "; ".join(v.rule for v in exc.violations)
        raise Rejected(rules, f"replicas={replicas}: {exc}", exc.allowed) from exc


def with_defaults(manifest: Mapping[str, Any], sidecar: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest with the operator's sidecar defaults filled in where the job is silent."""
    out = dict(manifest)
    spec = out.get("spec") or {}
    if sidecar and isinstance(spec, Mapping) and isinstance(spec.get("sidecar", {}), Mapping):
        out["spec"] = {**spec, "sidecar": {**sidecar, **(spec.get("sidecar") or {})}}
    return out


def parse(manifest: Mapping[str, Any], sidecar_defaults: Mapping[str, Any] | None = None) -> specs.JobSpec:
    """A JobSpec without the replica check (callers decide which count to check)."""
    try:
        return specs.parse_job(with_defaults(manifest, sidecar_defaults or {}), check_replicas=False)
    except specs.SpecError as exc:
        raise Rejected(f"field {exc.field}", str(exc)) from exc


def review_job(manifest: Mapping[str, Any], sidecar_defaults: Mapping[str, Any] | None = None) -> specs.JobSpec:
    """Every admission rule for a whole StreamingJob; returns the parsed spec or raises Rejected."""
    job = parse(manifest, sidecar_defaults)
    check_job(job)
    check_replicas(job, job.replicas)
    return job


def review_scale(manifest: Mapping[str, Any], replicas: int) -> None:
    """A scale request: the job as stored, with `replicas` instead of its own count."""
    job = parse(manifest)
    check_replicas(job, replicas)
    check_stop_has_store(job, dataclasses.replace(job, replicas=replicas))


STORE_RULE = "spec.checkpoint.uri is set before replicas or suspend change"
_STORE_DETAIL = (
    "changing replicas or setting suspend to true stops the running world, which needs "
    "somewhere to save its data position: set spec.checkpoint.uri (a local path or s3://) in "
    "an update of its own first, then scale or suspend; or create a new StreamingJob with the "
    "replica count you want"
)


def check_unchanged_order(old: specs.JobSpec, new: specs.JobSpec) -> None:
    """The fields that fix which row comes at which step cannot change (the CRD's rules say
    the same; this is the only guard where CEL is absent)."""
    before, after = specs.order_fields(old.data), specs.order_fields(new.data)
    changed = [key for key in specs.ORDER_FIELDS if before[key] != after[key]]
    if changed:
        details = "; ".join(f"data.{key}: {before[key]!r} -> {after[key]!r}" for key in changed)
        raise Rejected(
            ", ".join(f"data.{key} is immutable" for key in changed),
            f"{details}. They decide which rows make each global step, and a job resumes its "
            f"checkpoints only in the order that wrote them: create a new StreamingJob to change "
            f"{', '.join(changed)}",
        )


def check_stop_has_store(old: specs.JobSpec, new: specs.JobSpec) -> None:
    """A scale or suspend drains the world into a checkpoint; without a store it would lose
    the job's data position."""
    stops = new.replicas != old.replicas or (new.suspend and not old.suspend)
    if stops and not (old.checkpoint.uri and new.checkpoint.uri):
        raise Rejected(STORE_RULE, _STORE_DETAIL)


def review_update(old: Mapping[str, Any], new: Mapping[str, Any],
                  sidecar_defaults: Mapping[str, Any] | None = None) -> specs.JobSpec:
    """An UPDATE of a whole StreamingJob: every rule of a new job, plus what may not change.

    An old object that no longer parses (admitted before a rule existed) is judged as new.
    """
    job = review_job(new, sidecar_defaults)
    try:
        before = parse(old, sidecar_defaults)
    except Rejected:
        return job
    check_unchanged_order(before, job)
    check_stop_has_store(before, job)
    return job


def allowed_replicas(job: specs.JobSpec) -> list[int]:
    return _allowed_or_none(job) or []
