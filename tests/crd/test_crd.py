"""The StreamingJob CRD: its CEL rules, its schema, and its agreement with specs.py.

The CEL rules run in the `common-expression-language` evaluator the way the
apiserver runs them: on the object after structural defaulting, with `self`
bound to the node that carries the rule (and `oldSelf` for transition rules).
The openAPIV3Schema is turned into a JSON Schema (draft 2020-12) to check the
examples. And every field, default, bound and required flag is compared with
the config model, `splitfeed.trainer_client.contract.specs`, so that the CRD and the
model can never drift apart.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import pathlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import cel
import jsonschema
import kubernetes_validate
import pytest
import yaml

from splitfeed.trainer_client.contract import progress, specs, topology

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "streamingjob.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
MINIMAL = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
FULL = yaml.safe_load((ROOT / "examples" / "streamingjob.yaml").read_text())

# Fields the CRD deliberately leaves undefaulted: the operator fills them from
# its Helm values (sidecar.image / shmSize / prefetchBatches), whose defaults
# tests/chart pins to the config model's.
OPERATOR_DEFAULTED = {("sidecar", "image"), ("sidecar", "shmSize"), ("sidecar", "prefetchBatches")}

# Optional fields the complete example leaves out because setting them changes
# what it does: a pinned table version or tag must exist in the user's table,
# resumeFrom names another job's UID, and the example has no preprocessing (the
# transform's thread pool and queue only act with one).
NOT_IN_THE_EXAMPLE = {("spec", "data", "version"), ("spec", "checkpoint", "resumeFrom"),
                      ("spec", "data", "transform"), ("spec", "data", "transformArgs"),
                      ("spec", "data", "packSequences"), ("spec", "data", "transformParallelism"),
                      ("spec", "data", "transformQueueDepth")}

PACK = {"column": "tokens", "blockSize": 512, "eosId": 2, "padId": 0, "blocksPerEpoch": 96}

# The spec-level transition rule that is not about immutability.
STORE_RULE_PATH = ".checkpoint.uri"


# --- helpers: the apiserver's view of the schema -------------------------------

Path = tuple[str, ...]


def walk(node: Mapping[str, Any], path: Path = ()) -> Iterator[tuple[Path, Mapping[str, Any]]]:
    """Every schema node with its path; '*' stands for map values, '[]' for items."""
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, (*path, name))
    if isinstance(node.get("additionalProperties"), Mapping):
        yield from walk(node["additionalProperties"], (*path, "*"))
    if "items" in node:
        yield from walk(node["items"], (*path, "[]"))


def cel_rules() -> list[tuple[Path, dict[str, Any]]]:
    return [
        (path, rule)
        for path, node in walk(SCHEMA)
        for rule in node.get("x-kubernetes-validations", [])
    ]


def is_transition(rule: Mapping[str, Any]) -> bool:
    return "oldSelf" in rule["rule"]


def at(obj: Any, path: Path) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def has(obj: Any, path: Path) -> bool:
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return False
        obj = obj[key]
    return True


def apply_defaults(node: Mapping[str, Any], obj: Any) -> Any:
    """Structural defaulting as the apiserver does it, top-down: a defaulted
    object ({} for checkpoint, sidecar, trainer) gets its own fields' defaults."""
    obj = copy.deepcopy(obj)
    if isinstance(obj, dict):
        for name, child in node.get("properties", {}).items():
            if name not in obj and "default" in child:
                obj[name] = copy.deepcopy(child["default"])
            if name in obj:
                obj[name] = apply_defaults(child, obj[name])
        if isinstance(node.get("additionalProperties"), Mapping):
            for key in obj:
                obj[key] = apply_defaults(node["additionalProperties"], obj[key])
    elif isinstance(obj, list) and "items" in node:
        obj = [apply_defaults(node["items"], item) for item in obj]
    return obj


def to_json_schema(node: Mapping[str, Any]) -> dict[str, Any]:
    """A Kubernetes structural schema as JSON Schema 2020-12.

    x-kubernetes-* keys are dropped, with their meaning kept where JSON Schema
    has one: list-type set -> uniqueItems. The apiserver *prunes* fields the
    schema does not declare (drops them silently, it does not reject them), so
    here every object with declared properties and no
    x-kubernetes-preserve-unknown-fields gets additionalProperties: false — a
    field that fails here is one the cluster would throw away, which is why the
    admission webhook (specs.parse_job) rejects it by name.
    """
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "format":
            continue
        if key == "properties":
            out[key] = {name: to_json_schema(child) for name, child in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, Mapping):
            out[key] = to_json_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [to_json_schema(child) for child in value]
        else:
            out[key] = copy.deepcopy(value)
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


JSON_SCHEMA = {"$schema": "https://json-schema.org/draft/2020-12/schema", **to_json_schema(SCHEMA)}


def schema_errors(obj: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(JSON_SCHEMA)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def evaluate(path: Path, rule: Mapping[str, Any], obj: Any, old: Any = None) -> bool:
    """One rule on a whole (defaulted) object, `self` scoped to the rule's node."""
    context = {"self": at(obj, path)}
    if is_transition(rule):
        context["oldSelf"] = at(old, path)
    result = cel.evaluate(rule["rule"], context)
    assert isinstance(result, bool), f"{rule['rule']!r} returned {result!r}, not a bool"
    return result


def failing_rules(obj: Any, old: Any = None) -> list[str]:
    """The rule text of every rule that the (defaulted) object breaks."""
    failed = []
    for path, rule in cel_rules():
        if (is_transition(rule) and (old is None or not has(old, path))) or not has(obj, path):
            continue  # transition rules run on updates only, and only where both values exist
        if not evaluate(path, rule, obj, old):
            failed.append(rule["rule"])
    return failed


def job(**changes: Any) -> dict[str, Any]:
    """The full example, defaulted, with dotted-path changes ('data.numSplits': 24)."""
    manifest = copy.deepcopy(FULL)
    for dotted, value in changes.items():
        node = manifest["spec"]
        *parents, last = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        if value is _DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return apply_defaults(SCHEMA, manifest)


_DELETE = object()


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


# --- the CRD object itself ---------------------------------------------------------


class TestTheDefinition:
    def test_is_a_valid_kubernetes_1_30_object(self):
        assert kubernetes_validate.validate(CRD, "1.30.0", strict=True)

    def test_names_group_version_and_scope_are_the_contract(self):
        spec = CRD["spec"]
        assert CRD["metadata"]["name"] == "streamingjobs.splitfeed.io"
        assert (spec["group"], spec["scope"]) == ("splitfeed.io", "Namespaced")
        assert spec["names"]["kind"] == specs.KIND
        assert spec["names"]["plural"] == "streamingjobs"
        assert spec["names"]["shortNames"] == ["sj"]
        assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]
        assert f"{spec['group']}/{VERSION['name']}" == specs.API_VERSION
        assert VERSION["served"] and VERSION["storage"]

    def test_the_scale_subresource_points_at_replicas_and_the_selector(self):
        assert VERSION["subresources"] == {
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            },
        }
        assert SCHEMA["properties"]["status"]["properties"]["selector"]["type"] == "string"

    def test_printer_columns_show_replicas_world_phase_epoch_step_age(self):
        columns = {c["name"]: c["jsonPath"] for c in VERSION["additionalPrinterColumns"]}
        assert columns == {
            "Replicas": ".spec.replicas",
            "World": ".status.worldSize",
            "Phase": ".status.phase",
            "Epoch": ".status.progress.epoch",
            "Step": ".status.progress.step",
            "Stall": ".status.progress.dataStallShare",
            "Age": ".metadata.creationTimestamp",
        }
        assert list(columns) == ["Replicas", "World", "Phase", "Epoch", "Step", "Stall", "Age"]

    def test_status_has_the_documented_fields(self):
        status = SCHEMA["properties"]["status"]["properties"]
        assert status["phase"]["enum"] == ["Pending", "Running", "Rescaling", "Suspended", "Succeeded", "Failed"]
        assert set(status) >= {
            "phase", "replicas", "worldSize", "worldEpoch", "allowedReplicas", "lastCheckpoint",
            "progress", "restarts", "conditions", "selector", "observedGeneration",
        }
        assert set(status["lastCheckpoint"]["properties"]) == {"step", "epoch", "worldSize", "time"}
        counts = set(progress.ROW_COUNTS.values())  # else the apiserver prunes a new count
        assert set(status["progress"]["properties"]) == {
            "globalStep", "epoch", "step", "stepsPerEpoch", "rowsPerSecond", "dataStallShare", "dataReady",
            "updatedAt", progress.CARRIED} | counts
        assert set(status["progress"]["properties"][progress.CARRIED]["properties"]) == {"worldEpoch"} | counts
        assert set(status["progress"]["properties"]["dataReady"]["properties"]) == {
            "p50Seconds", "p95Seconds", "p99Seconds"}

    def test_conditions_have_the_metav1_condition_shape(self):
        conditions = SCHEMA["properties"]["status"]["properties"]["conditions"]
        assert conditions["x-kubernetes-list-type"] == "map"
        assert conditions["x-kubernetes-list-map-keys"] == ["type"]
        item = conditions["items"]
        assert set(item["required"]) == {"type", "status", "lastTransitionTime", "reason", "message"}
        assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
        assert item["properties"]["lastTransitionTime"]["format"] == "date-time"

    def test_the_trainer_template_keeps_unknown_fields(self):
        template = SPEC_SCHEMA["properties"]["trainer"]["properties"]["template"]
        assert template["x-kubernetes-preserve-unknown-fields"] is True

    def test_the_schema_is_structural(self):
        for path, node in walk(SCHEMA):
            where = ".".join(path) or "<root>"
            typed = "type" in node or node.get("x-kubernetes-int-or-string") or node.get(
                "x-kubernetes-preserve-unknown-fields"
            )
            assert typed, f"{where} has no type"
            assert not ("properties" in node and "additionalProperties" in node), (
                f"{where}: properties and additionalProperties exclude each other in a structural schema"
            )

    def test_every_string_and_list_that_cel_can_see_is_bounded(self):
        # The apiserver estimates each rule's worst-case cost from maxLength and
        # maxItems; unbounded ones are sized by the request limit and can push
        # a rule over the per-rule cost budget, so the CRD would be refused.
        for rule_path, _ in cel_rules():
            subtree = at_schema(rule_path)
            for path, node in walk(subtree, rule_path):
                if node.get("x-kubernetes-preserve-unknown-fields"):
                    continue
                if node.get("type") == "string" and "enum" not in node:
                    assert "maxLength" in node, f"{'.'.join(path)} needs maxLength"
                if node.get("type") == "array":
                    assert "maxItems" in node, f"{'.'.join(path)} needs maxItems"

    def test_every_rule_says_what_to_do(self):
        for path, rule in cel_rules():
            assert rule.get("message"), f"rule at {'.'.join(path)} has no message"
            # The apiserver refuses a CRD whose messages contain line breaks.
            for key in ("rule", "message", "messageExpression"):
                assert "\n" not in rule.get(key, ""), (path, key)
            if is_transition(rule):
                assert "create a new StreamingJob" in rule["message"]
            else:
                assert re.search(r"choose|set|pick", rule["message"]), rule["message"]


def at_schema(path: Path) -> Mapping[str, Any]:
    node: Mapping[str, Any] = SCHEMA
    for key in path:
        node = node["items"] if key == "[]" else node["additionalProperties"] if key == "*" else node["properties"][key]
    return node


# --- CEL rules -------------------------------------------------------------------


class TestDivisibilityRules:
    def test_there_are_exactly_the_four_topology_rules_on_spec(self):
        on_spec = [rule["rule"] for path, rule in cel_rules() if path == ("spec",) and not is_transition(rule)]
        assert len(on_spec) == 4

    @pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
    def test_the_examples_pass_every_rule(self, example):
        manifest = apply_defaults(SCHEMA, yaml.safe_load(example.read_text()))
        assert failing_rules(manifest) == []
        assert failing_rules(manifest, old=manifest) == []

    @pytest.mark.parametrize(
        "changes,breaks",
        [
            pytest.param({"replicas": 5, "gpusPerReplica": 1, "data__numWorkers": 1, "data__numSplits": 24,
                          "data__globalBatchSize": 480}, ["numSplits %"], id="24-splits-on-5-replicas"),
            pytest.param({"replicas": 4, "gpusPerReplica": 1, "data__numWorkers": 1, "data__numSplits": 24,
                          "data__globalBatchSize": 480}, [], id="24-splits-on-4-replicas"),
            pytest.param({"replicas": 6}, [], id="full-example-scaled-to-6"),
            pytest.param({"replicas": 7}, ["numSplits %", "globalBatchSize % (self.replicas"], id="full-example-scaled-to-7"),
            pytest.param({"data__numWorkers": 3}, [], id="3-workers-fit-48-splits-on-8-ranks"),
            pytest.param({"data__numWorkers": 4}, ["numSplits %"], id="4-workers-do-not"),
            pytest.param({"data__globalBatchSize": 968}, ["globalBatchSize % self.data.numSplits",], id="batch-not-multiple-of-splits"),
            pytest.param({"replicas": 3, "gpusPerReplica": 1, "data__numWorkers": 1, "data__numSplits": 6,
                          "data__globalBatchSize": 12}, [], id="small-valid"),
            pytest.param({"replicas": 1, "gpusPerReplica": 8, "data__numWorkers": 1, "data__numSplits": 8,
                          "data__globalBatchSize": 8}, [], id="one-pod-eight-gpus"),
            pytest.param({"data__transform": "m:f", "data__transformArgs": "{}"}, [], id="transform"),
            pytest.param({"data__transformArgs": "{}"}, ["has(self.transform)"], id="args-without-transform"),
            pytest.param({"data__transform": "m:f", "data__packSequences": PACK}, ["!has(self.transform)"],
                         id="transform-and-packing"),
            pytest.param({"data__packSequences": {**PACK, "padId": 2}}, ["self.padId != self.eosId"],
                         id="pad-equals-eos"),
            pytest.param({"data__packSequences": {**PACK, "blocksPerEpoch": "many"}}, ['self == "auto"'],
                         id="blocks-neither-number-nor-auto"),
            pytest.param({"data__packSequences": {**PACK, "blocksPerEpoch": "auto"}}, [], id="blocks-auto"),
            pytest.param({"data__ranksPerBatch": 2}, [], id="tp2-on-8-ranks"),
            pytest.param({"data__ranksPerBatch": 3}, ["% self.data.ranksPerBatch == 0"], id="tp3-on-8-ranks"),
            pytest.param({"replicas": 3, "gpusPerReplica": 2, "data__numWorkers": 1, "data__numSplits": 6,
                          "data__globalBatchSize": 12, "data__ranksPerBatch": 2}, [], id="dp3-tp2-small"),
            pytest.param({"replicas": 4, "gpusPerReplica": 2, "data__numWorkers": 1, "data__numSplits": 6,
                          "data__globalBatchSize": 6, "data__ranksPerBatch": 2},
                         ["self.data.numSplits %", "self.data.globalBatchSize % (self.replicas"], id="dp4-does-not-fit-6"),
            pytest.param({"data__ranksPerBatch": 4, "data__pipelineStages": 2}, [], id="pp2-tp2"),
            pytest.param({"data__ranksPerBatch": 4, "data__pipelineStages": 3}, ["self.ranksPerBatch % self.pipelineStages"],
                         id="pp3-does-not-divide-4"),
        ],
    )
    def test_each_rule_fails_exactly_when_it_should(self, changes, breaks):
        failed = failing_rules(job(**changes))
        assert len(failed) == len(breaks), failed
        for fragment in breaks:
            assert any(fragment in rule for rule in failed), (fragment, failed)

    def test_the_rules_agree_with_the_topology_module_everywhere(self):
        # The CRD's arithmetic and trainer_client.topology are two spellings of
        # the same four rules (docs/architecture.md): on every topology in this grid
        # they must accept and reject the same jobs, rule for rule.
        splits_rule = ("(self.replicas * self.gpusPerReplica) % self.data.ranksPerBatch != 0 || self.data.numSplits % "
                       "(self.replicas * self.gpusPerReplica / self.data.ranksPerBatch * self.data.numWorkers) == 0")
        batch_rule = ("(self.replicas * self.gpusPerReplica) % self.data.ranksPerBatch != 0 || "
                      "self.data.globalBatchSize % (self.replicas * self.gpusPerReplica / self.data.ranksPerBatch) == 0")
        names = {
            "worldSize % ranksPerBatch == 0": "(self.replicas * self.gpusPerReplica) % self.data.ranksPerBatch == 0",
            "numSplits % (worldSize * numWorkers) == 0": splits_rule,
            "numSplits % (dataParallelSize * numWorkers) == 0": splits_rule,
            "globalBatchSize % numSplits == 0": "self.data.globalBatchSize % self.data.numSplits == 0",
            "globalBatchSize % worldSize == 0": batch_rule,
            "globalBatchSize % dataParallelSize == 0": batch_rule,
        }
        on_spec = {rule["rule"] for path, rule in cel_rules() if path == ("spec",) and not is_transition(rule)}
        assert set(names.values()) == on_spec
        checked = 0
        for replicas, gpus, workers, splits, batch, k in itertools.product(
            range(1, 9), (1, 2, 3), (1, 2), (12, 24, 48), (48, 96, 100, 960), (1, 2, 3)
        ):
            spec = {"replicas": replicas, "gpusPerReplica": gpus,
                    "data": {"numSplits": splits, "numWorkers": workers, "globalBatchSize": batch,
                             "ranksPerBatch": k}}
            cel_failed = {
                rule for rule in on_spec if not cel.evaluate(rule, {"self": spec})
            }
            expected = {
                names[v.rule]
                for v in topology.violations(
                    replicas=replicas, gpus_per_replica=gpus, num_splits=splits,
                    num_workers=workers, global_batch_size=batch, ranks_per_batch=k,
                )
            }
            assert cel_failed == expected, spec
            checked += 1
        assert checked == 8 * 3 * 2 * 3 * 4 * 3

    def test_message_expressions_name_the_numbers(self):
        bad = job(replicas=5, gpusPerReplica=1, data__numWorkers=1, data__numSplits=24, data__globalBatchSize=480)
        rule = next(r for p, r in cel_rules() if p == ("spec",) and "|| self.data.numSplits" in r["rule"])
        message = cel.evaluate(rule["messageExpression"], {"self": bad["spec"]})
        assert message.startswith("data.numSplits=24 is not divisible by replicas*gpusPerReplica*numWorkers=5*1*1=5")
        assert "status.allowedReplicas" in message
        grouped = job(replicas=4, gpusPerReplica=2, data__numWorkers=1, data__numSplits=6,
                      data__globalBatchSize=6, data__ranksPerBatch=2)
        message = cel.evaluate(rule["messageExpression"], {"self": grouped["spec"]})
        assert message.startswith("data.numSplits=6 is not divisible by replicas*gpusPerReplica/ranksPerBatch*numWorkers=4*2/2*1=4")
        for path, rule in cel_rules():
            if "messageExpression" in rule:
                assert isinstance(cel.evaluate(rule["messageExpression"], {"self": at(bad, path)}), str)


class TestImmutability:
    @pytest.mark.parametrize(
        "field,new_value",
        [
            pytest.param("numSplits", 96, id="numSplits"),
            pytest.param("shuffleSeed", 7, id="shuffleSeed"),
            pytest.param("table", "other_frames", id="table"),
            pytest.param("uri", "s3://elsewhere/lancedb", id="uri"),
            pytest.param("filter", "label >= 1", id="filter-changed"),
            pytest.param("filter", _DELETE, id="filter-removed"),
            pytest.param("shuffle", False, id="shuffle"),
            pytest.param("shuffleClumpSize", 8, id="shuffleClumpSize"),
            pytest.param("globalBatchSize", 1920, id="globalBatchSize"),
            pytest.param("columns", ["id", "label"], id="columns-changed"),
            pytest.param("columns", _DELETE, id="columns-removed"),
            pytest.param("version", 8, id="version-changed"),
            pytest.param("version", "snapshot", id="version-number-to-tag"),
            pytest.param("version", _DELETE, id="version-removed"),
        ],
    )
    def test_changing_a_field_that_fixes_the_data_order_is_refused(self, field, new_value):
        old = job(data__version=7)
        new = job(**{"data__version": 7, f"data__{field}": new_value})
        failed = [
            rule for path, rule in cel_rules()
            if is_transition(rule) and has(new, path) and not evaluate(path, rule, new, old)
        ]
        assert len(failed) == 1, failed
        assert f"data.{field} is immutable" in failed[0]["message"]
        assert f"create a new StreamingJob to change {field}" in failed[0]["message"]

    def test_adding_a_filter_is_refused(self):
        old = job(data__filter=_DELETE)
        new = job()
        assert failing_rules(new, old) == [
            "has(self.filter) == has(oldSelf.filter) && (!has(self.filter) || self.filter == oldSelf.filter)"
        ]

    def test_a_job_without_a_filter_may_stay_without_one(self):
        old = job(data__filter=_DELETE)
        assert failing_rules(old, old) == []

    @pytest.mark.parametrize("field,value", [("columns", ["id"]), ("version", 3), ("version", "snap"),
                                             ("transform", "m:f"), ("packSequences", PACK)])
    def test_adding_an_order_field_is_refused(self, field, value):
        old = job(**{f"data__{field}": _DELETE})
        new = job(**{f"data__{field}": value})
        failed = failing_rules(new, old)
        assert len(failed) == 1 and f"has(self.{field}) == has(oldSelf.{field})" in failed[0]

    def test_the_order_fields_of_the_config_model_are_exactly_the_immutable_ones(self):
        # specs.ORDER_FIELDS drives the webhook's UPDATE check and the checkpoint
        # provenance check; the CRD must refuse changing the same fields.
        assert set(specs.ORDER_FIELDS) == immutable_fields()

    @pytest.mark.parametrize(
        "changes",
        [
            pytest.param({"replicas": 6}, id="scale"),
            pytest.param({"suspend": True}, id="suspend"),
            pytest.param({"data__epochs": 100}, id="epochs"),
            pytest.param({"data__readBatchSize": 128}, id="readBatchSize"),
            pytest.param({"sidecar__prefetchBatches": 8}, id="prefetch"),
            pytest.param({"data__numWorkers": 2}, id="numWorkers"),
            pytest.param({"checkpoint__timeoutSeconds": 60}, id="checkpoint-timeout"),
            pytest.param({"checkpoint__resumeFrom": {"uid": "0b1c"}}, id="resumeFrom"),
        ],
    )
    def test_fields_that_keep_the_data_order_may_change(self, changes):
        assert failing_rules(job(**changes), old=job()) == []

    def test_exactly_the_documented_fields_are_immutable(self):
        assert immutable_fields() == {
            "numSplits", "shuffleSeed", "table", "uri", "filter",
            "shuffle", "shuffleClumpSize", "globalBatchSize", "columns", "version",
            "transform", "transformArgs", "onTransformError", "packSequences",
        }


def immutable_fields() -> set[str]:
    immutable = set()
    for path, rule in cel_rules():
        if is_transition(rule) and rule.get("fieldPath") != STORE_RULE_PATH:
            field = path[-1] if rule["rule"] == "self == oldSelf" else rule["fieldPath"].lstrip(".")
            immutable.add(field)
    return immutable


def store_rule() -> dict[str, Any]:
    (rule,) = [r for p, r in cel_rules() if p == ("spec",) and r.get("fieldPath") == STORE_RULE_PATH]
    return rule


class TestNoScaleOrSuspendWithoutACheckpointStore:
    @pytest.mark.parametrize(
        "old_changes,new_changes,refused",
        [
            pytest.param({"checkpoint__uri": _DELETE}, {"checkpoint__uri": _DELETE, "replicas": 6}, True, id="scale"),
            pytest.param({"checkpoint__uri": _DELETE}, {"checkpoint__uri": _DELETE, "replicas": 2}, True, id="scale-down"),
            pytest.param({"checkpoint__uri": _DELETE}, {"checkpoint__uri": _DELETE, "suspend": True}, True, id="suspend"),
            pytest.param({"checkpoint__uri": _DELETE}, {"replicas": 6}, True, id="scale-while-adding-the-uri"),
            pytest.param({}, {"checkpoint__uri": _DELETE, "replicas": 6}, True, id="scale-while-removing-the-uri"),
            pytest.param({"checkpoint__uri": _DELETE, "suspend": True}, {"checkpoint__uri": _DELETE}, False, id="resume"),
            pytest.param({"checkpoint__uri": _DELETE}, {"checkpoint__uri": _DELETE, "data__epochs": 3}, False, id="other-change"),
            pytest.param({"checkpoint__uri": _DELETE}, {}, False, id="adding-the-uri-alone"),
            pytest.param({}, {"replicas": 6}, False, id="scale-with-a-store"),
            pytest.param({}, {"suspend": True}, False, id="suspend-with-a-store"),
        ],
    )
    def test_a_stop_needs_a_store(self, old_changes, new_changes, refused):
        failed = failing_rules(job(**new_changes), old=job(**old_changes))
        assert failed == ([store_rule()["rule"]] if refused else [])

    def test_the_message_says_to_set_the_checkpoint_uri(self):
        message = store_rule()["message"]
        assert "set spec.checkpoint.uri" in message and "create a new StreamingJob" in message

    def test_a_new_job_may_start_suspended_without_a_store(self):
        assert failing_rules(job(checkpoint__uri=_DELETE, suspend=True)) == []


class TestTableVersion:
    @pytest.mark.parametrize("value,ok", [(1, True), (42, True), ("nightly-2026-01", True), (0, False), ("", False)])
    def test_a_version_is_a_positive_number_or_a_tag(self, value, ok):
        assert (failing_rules(job(data__version=value)) == []) is ok

    @pytest.mark.parametrize("value", [3, "snap"])
    def test_the_schema_takes_a_number_or_a_string(self, value):
        manifest = copy.deepcopy(FULL)
        manifest["spec"]["data"]["version"] = value
        assert schema_errors(manifest) == []
        assert specs.parse_job(manifest).data.version == value

    def test_the_schema_refuses_other_types(self):
        manifest = copy.deepcopy(FULL)
        manifest["spec"]["data"]["version"] = 1.5
        assert schema_errors(manifest)


class TestResumeFrom:
    def test_uid_is_required_and_name_optional(self):
        node = at_schema(("spec", "checkpoint", "resumeFrom"))
        assert node["required"] == ["uid"]
        assert {f.name for f in dataclasses.fields(specs.ResumeFrom)} == set(node["properties"])
        manifest = copy.deepcopy(FULL)
        manifest["spec"]["checkpoint"]["resumeFrom"] = {"name": "resnet"}
        assert any("'uid' is a required property" in e for e in schema_errors(manifest))
        with pytest.raises(specs.SpecError, match="spec.checkpoint.resumeFrom.uid"):
            specs.parse_job(manifest)

    @pytest.mark.parametrize("uid", ["../other", "a/b"])
    def test_a_uid_cannot_leave_the_checkpoint_directory(self, uid):
        manifest = copy.deepcopy(FULL)
        manifest["spec"]["checkpoint"]["resumeFrom"] = {"uid": uid}
        assert any("does not match" in e for e in schema_errors(manifest))
        with pytest.raises(specs.SpecError):
            specs.parse_job(manifest)

    def test_a_valid_one_parses(self):
        manifest = copy.deepcopy(FULL)
        manifest["spec"]["checkpoint"]["resumeFrom"] = {"uid": "6f1e2d3c-0000-4000-8000-000000000001"}
        assert schema_errors(manifest) == []
        source = specs.parse_job(manifest).checkpoint.resume_from
        assert source == specs.ResumeFrom(uid="6f1e2d3c-0000-4000-8000-000000000001")


# --- the schema against examples -----------------------------------------------------


class TestSchema:
    @pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
    def test_the_examples_are_accepted(self, example):
        assert schema_errors(yaml.safe_load(example.read_text())) == []

    @pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
    def test_the_examples_are_valid_for_the_config_model_too(self, example):
        specs.parse_job(yaml.safe_load(example.read_text()))

    def test_the_complete_example_sets_every_spec_field(self):
        for path, node in walk(SPEC_SCHEMA, ("spec",)):
            if "*" in path or "[]" in path or path[:2] == ("spec", "sidecar") and len(path) > 3:
                continue  # map values, list items, resource names
            if path[:3] in NOT_IN_THE_EXAMPLE:
                continue
            assert has(FULL, path), f"examples/streamingjob.yaml does not set {'.'.join(path)}"

    @pytest.mark.parametrize(
        "changes,words",
        [
            pytest.param({"data__numSplit": 48}, "'numSplit' was unexpected", id="unknown-field-in-data"),
            pytest.param({"replica": 2}, "'replica' was unexpected", id="unknown-field-in-spec"),
            pytest.param({"data__numSplits": 0}, "less than the minimum of 1", id="zero-splits"),
            pytest.param({"replicas": 0}, "less than the minimum of 1", id="zero-replicas"),
            pytest.param({"data__globalBatchSize": -8}, "less than the minimum of 1", id="negative-batch"),
            pytest.param({"data__shuffleSeed": -1}, "less than the minimum of 0", id="negative-seed"),
            pytest.param({"data__numSplits": "48"}, "is not of type 'integer'", id="string-int"),
            pytest.param({"data__columns": ["id", "id"]}, "non-unique", id="duplicate-column"),
            pytest.param({"data__columns": []}, "should be non-empty", id="no-columns"),
            pytest.param({"data__uri": ""}, "should be non-empty", id="empty-uri"),
            pytest.param({"data__table": _DELETE}, "'table' is a required property", id="no-table"),
            pytest.param({"sidecar__shmSize": "lots"}, "does not match", id="bad-quantity"),
            pytest.param({"data__storageOptions": {"aws_region": 1}}, "is not of type 'string'", id="non-string-option"),
            pytest.param({"data__storageOptionsSecret": "S3_Creds"}, "does not match", id="bad-secret-name"),
        ],
    )
    def test_bad_jobs_are_rejected(self, changes, words):
        manifest = copy.deepcopy(FULL)
        for dotted, value in changes.items():
            node = manifest["spec"]
            *parents, last = dotted.split("__")
            for key in parents:
                node = node[key]
            if value is _DELETE:
                del node[last]
            else:
                node[last] = value
        errors = schema_errors(manifest)
        assert any(words in e for e in errors), errors

    def test_a_job_without_data_is_rejected(self):
        assert any("'data' is a required property" in e for e in schema_errors(
            {"apiVersion": specs.API_VERSION, "kind": specs.KIND, "metadata": {"name": "x"}, "spec": {}}
        ))

    def test_status_accepts_what_the_operator_writes(self):
        manifest = copy.deepcopy(FULL)
        manifest["status"] = {
            "phase": "Running", "replicas": 4, "worldSize": 8, "worldEpoch": 2,
            "allowedReplicas": [1, 2, 3, 4, 6, 12],
            "lastCheckpoint": {"step": 1200, "epoch": 0, "worldSize": 8, "time": "2026-01-02T03:04:05Z"},
            "progress": {"globalStep": 1234, "epoch": 0, "step": 1234, "stepsPerEpoch": 5000},
            "drain": {"reason": "Rescale", "step": "CheckpointRequested", "token": "rescale-w2",
                      "requestedAt": "2026-01-02T03:04:05Z", "targetReplicas": 6},
            "restarts": 0, "selector": "splitfeed.io/job=resnet", "observedGeneration": 3,
            "conditions": [{"type": "Ready", "status": "True", "reason": "WorldRunning",
                            "message": "8 ranks running", "lastTransitionTime": "2026-01-02T03:04:05Z",
                            "observedGeneration": 3}],
            "kopf": {"progress": {"anything": {"goes": True}}},
        }
        assert schema_errors(manifest) == []
        manifest["status"]["phase"] = "Exploded"
        assert any("is not one of" in e for e in schema_errors(manifest))


# --- the CRD and the config model never drift -----------------------------------------


SECTIONS = {
    (): specs.JobSpec,
    ("data",): specs.DataSpec,
    ("checkpoint",): specs.CheckpointSpec,
    ("sidecar",): specs.SidecarSpec,
    ("trainer",): specs.TrainerSpec,
}
NOT_SPEC_FIELDS = {"name", "namespace"}  # metadata, not spec


def model_fields() -> Iterator[tuple[Path, dataclasses.Field]]:
    for section, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            if section == () and (field.name in NOT_SPEC_FIELDS or (camel(field.name),) in SECTIONS):
                continue
            yield (*section, camel(field.name)), field


def wire(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value


def base_manifest() -> dict[str, Any]:
    return copy.deepcopy(MINIMAL)


def with_value(path: Path, value: Any) -> dict[str, Any]:
    manifest = base_manifest()
    node = manifest["spec"]
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return manifest


class TestAgreementWithTheConfigModel:
    def test_defaulting_the_minimal_example_changes_nothing_the_model_sees(self):
        defaulted = apply_defaults(SCHEMA, MINIMAL)
        assert defaulted != MINIMAL  # the CRD did fill in defaults...
        assert specs.parse_job(defaulted) == specs.parse_job(MINIMAL)  # ...the model's own

    def test_every_model_field_is_in_the_crd_and_every_crd_field_in_the_model(self):
        crd = set()
        for name, node in SPEC_SCHEMA["properties"].items():
            if (name,) in SECTIONS:
                crd |= {(name, child) for child in node["properties"]}
            else:
                crd.add((name,))
        assert {path for path, _ in model_fields()} == crd

    @pytest.mark.parametrize("path,field", list(model_fields()), ids=lambda v: ".".join(v) if isinstance(v, tuple) else "")
    def test_defaults_and_required_flags_agree(self, path, field):
        node = at_schema(("spec", *path))
        parent = at_schema(("spec", *path[:-1]))
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        assert (path[-1] in parent.get("required", [])) == required
        if required:
            assert "default" not in node
            return
        model_default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        if path in OPERATOR_DEFAULTED:
            assert "default" not in node, f"{path}: the operator (Helm values) supplies this default"
        elif model_default is None:
            assert "default" not in node
        else:
            assert node.get("default") == wire(model_default)

    @pytest.mark.parametrize(
        "path",
        [path for path, _ in model_fields() if at_schema(("spec", *path)).get("type") == "integer"],
        ids=lambda p: ".".join(p),
    )
    def test_integer_lower_bounds_agree(self, path):
        minimum = at_schema(("spec", *path))["minimum"]
        specs.parse_job(with_value(path, minimum), check_replicas=False)
        with pytest.raises(specs.SpecError) as info:
            specs.parse_job(with_value(path, minimum - 1), check_replicas=False)
        assert info.value.field == "spec." + ".".join(path)

    @pytest.mark.parametrize(
        "path",
        [path for path, _ in model_fields() if at_schema(("spec", *path)).get("type") == "string"],
        ids=lambda p: ".".join(p),
    )
    def test_strings_must_be_non_empty_in_both(self, path):
        assert at_schema(("spec", *path))["minLength"] == 1
        with pytest.raises(specs.SpecError):
            specs.parse_job(with_value(path, ""), check_replicas=False)


def test_the_readme_reference_lists_exactly_the_crds_spec_fields():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## StreamingJob reference", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(spec\.[A-Za-z.]+)` \|", section, flags=re.M))
    fields = set()
    for name, node in SPEC_SCHEMA["properties"].items():
        if (name,) in SECTIONS:
            fields |= {f"spec.{name}.{child}" for child in node["properties"]}
        else:
            fields.add(f"spec.{name}")
    assert documented == fields
    for field in specs.ORDER_FIELDS:
        assert f"`{field}`" in section.split("**Fixed order.**", 1)[1].split("- **", 1)[0], field
