"""The StreamingJob config model: defaults, and errors that name the field."""

import copy

import pytest

from splitfeed.trainer_client.contract import fields, specs, topology

GOOD = {
    "apiVersion": "splitfeed.io/v1alpha1",
    "kind": "StreamingJob",
    "metadata": {"name": "resnet"},
    "spec": {
        "replicas": 4,
        "data": {"uri": "/data/db", "table": "frames", "numSplits": 48, "globalBatchSize": 960},
    },
}


def with_(path, value):
    manifest = copy.deepcopy(GOOD)
    node = manifest
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return manifest


def test_a_minimal_job_gets_the_documented_defaults():
    job = specs.parse_job(GOOD)
    assert job.name == "resnet" and job.namespace == "default"
    assert (job.replicas, job.gpus_per_replica, job.world_size) == (4, 1, 4)
    assert job.data.shuffle is True and job.data.shuffle_seed == 0
    assert job.data.epochs == 1 and job.data.num_workers == 1 and job.data.read_batch_size == 64
    assert job.data.columns is None and job.data.filter is None
    assert job.sidecar.prefetch_batches == 4 and job.sidecar.shm_size == "2Gi"
    assert job.checkpoint.uri is None and job.checkpoint.timeout_seconds == 300


@pytest.mark.parametrize(
    "path,value,field,words",
    [
        pytest.param("spec.data.numSplit", 48, "spec.data.numSplit", "did you mean 'numSplits'", id="typo"),
        pytest.param("spec.replica", 2, "spec.replica", "did you mean 'replicas'", id="typo-top"),
        pytest.param("spec.data.numSplits", "48", "spec.data.numSplits", "must be an integer", id="string-int"),
        pytest.param("spec.data.numSplits", 0, "spec.data.numSplits", "at least 1", id="zero"),
        pytest.param("spec.data.shuffle", "yes", "spec.data.shuffle", "true or false", id="bool"),
        pytest.param("spec.data.columns", ["id", "id"], "spec.data.columns", "twice", id="dup-col"),
        pytest.param("spec.sidecar.shmSize", "lots", "spec.sidecar.shmSize", "quantity", id="quantity"),
        pytest.param("spec.data.uri", None, "spec.data.uri", "is required", id="missing"),
        pytest.param("kind", "Job", "kind", "StreamingJob", id="kind"),
        pytest.param("spec.data", "frames", "spec.data", "mapping", id="section-type"),
        pytest.param("spec.checkpoint.uri", "gs://bucket/ckpt", "spec.checkpoint.uri", "s3://", id="gcs-checkpoints"),
        pytest.param("spec.checkpoint.uri", "az://c/ckpt", "spec.checkpoint.uri", "local path", id="azure-checkpoints"),
    ],
)
def test_bad_fields_are_named_with_a_fix(path, value, field, words):
    with pytest.raises(specs.SpecError) as info:
        specs.parse_job(with_(path, value))
    assert info.value.field == field
    assert words in str(info.value)


@pytest.mark.parametrize("uri", ["s3://bucket/ckpt", "/mnt/ckpt", "file:///mnt/ckpt", "relative/ckpt"])
def test_checkpoints_go_to_a_local_path_or_s3(uri):
    assert specs.parse_job(with_("spec.checkpoint.uri", uri)).checkpoint.uri == uri


def test_an_invalid_replica_count_is_a_topology_error_listing_valid_counts():
    with pytest.raises(topology.TopologyError) as info:
        specs.parse_job(with_("spec.replicas", 5))
    assert "[1, 2, 3, 4, 6, 8, 12, 16, 24, 48]" in str(info.value)
    job = specs.parse_job(with_("spec.replicas", 5), check_replicas=False)
    assert job.replicas == 5


def test_data_config_round_trips_and_its_checksum_changes_with_any_field():
    job = specs.parse_job(with_("spec.data.filter", "label >= 0"))
    config = job.data_config()
    again = specs.parse_data_config(config)
    assert again.data == job.data
    other = specs.parse_job(with_("spec.data.shuffleSeed", 7)).data_config()
    assert specs.data_config_checksum(config) != specs.data_config_checksum(other)
    assert specs.data_config_checksum(config) == specs.data_config_checksum(again.data_config())


@pytest.mark.parametrize("text,expected", [("2Gi", 2 * 2**30), ("512Mi", 512 * 2**20), ("1000", 1000), ("1G", 10**9)])
def test_quantities_parse_to_bytes(text, expected):
    assert specs.parse_quantity_bytes(text) == expected


@pytest.mark.parametrize("value", [1, 12, "nightly", "v-2026.01"])
def test_a_table_version_is_a_number_or_a_tag(value):
    job = specs.parse_job(with_("spec.data.version", value))
    assert job.data.version == value
    assert specs.parse_data_config(job.data_config()).data.version == value


@pytest.mark.parametrize("value,words", [(0, "at least 1"), ("", "non-empty"), (1.5, "integer"), (True, "integer")])
def test_a_bad_table_version_names_the_field(value, words):
    with pytest.raises(specs.SpecError) as info:
        specs.parse_job(with_("spec.data.version", value))
    assert info.value.field == "spec.data.version" and words in str(info.value)


def test_resume_from_round_trips_through_the_data_config():
    job = specs.parse_job(with_("spec.checkpoint", {"uri": "/ckpt", "resumeFrom": {"uid": "u-1", "name": "old"}}))
    assert job.checkpoint.resume_from == specs.ResumeFrom(uid="u-1", name="old")
    config = job.data_config()
    assert config["checkpoint"]["resumeFrom"] == {"uid": "u-1", "name": "old"}
    assert specs.parse_data_config(config).checkpoint == job.checkpoint
    plain = specs.parse_job(with_("spec.checkpoint", {"uri": "/ckpt"})).data_config()
    assert "resumeFrom" not in plain["checkpoint"]  # unchanged checksum for jobs without it


@pytest.mark.parametrize("value,field", [
    ({"name": "old"}, "spec.checkpoint.resumeFrom.uid"),
    ({"uid": "u", "nmae": "old"}, "spec.checkpoint.resumeFrom.nmae"),
    ({"uid": "../x"}, "spec.checkpoint.resumeFrom.uid"),
    ({"uid": "u", "name": "a/b"}, "spec.checkpoint.resumeFrom.name"),
])
def test_a_bad_resume_from_names_the_field(value, field):
    with pytest.raises(specs.SpecError) as info:
        specs.parse_job(with_("spec.checkpoint.resumeFrom", value))
    assert info.value.field == field


def test_order_fields_are_the_wire_values_of_the_order_defining_fields():
    job = specs.parse_job(with_("spec.data.columns", ["id", "label"]))
    order = specs.order_fields(job.data)
    assert list(order) == list(specs.ORDER_FIELDS)
    assert order["columns"] == ["id", "label"] and order["globalBatchSize"] == 960
    assert order["version"] is None and order["shuffle"] is True


def test_the_maxima_are_refused_when_parsing_too_so_local_and_plan_say_the_same():
    import pytest as _pytest

    from splitfeed.trainer_client.contract import specs as _specs

    manifest = {"apiVersion": _specs.API_VERSION, "kind": _specs.KIND, "metadata": {"name": "j"},
                "spec": {"data": {"uri": "/tmp/db", "table": "t", "numSplits": 2_000_000,
                                  "globalBatchSize": 2_000_000}}}
    with _pytest.raises(_specs.SpecError, match=r"spec.data.numSplits: must be at most 1000000, got 2000000"):
        _specs.parse_job(manifest, check_replicas=False)


def test_every_spec_field_is_declared_once_with_its_rule():
    """A field added to a section's dataclass without a Rule would never be parsed."""
    import dataclasses

    for model in (specs.DataSpec, specs.CheckpointSpec, specs.SidecarSpec, specs.TrainerSpec, specs.ResumeFrom,
                  specs.PackSpec):
        assert {f.name for f in dataclasses.fields(model)} == {f.name for f in fields.wire_fields(model).values()}
    assert {f.name for f in dataclasses.fields(specs.JobSpec)} - {
        f.name for f in fields.wire_fields(specs.JobSpec).values()} == {"name", "namespace"}
    assert fields.wire_fields(specs.DataSpec)["numSplits"].rule == fields.Rule("int", 1, 1_000_000)
    assert specs.MAXIMA["spec.data.numSplits"] == 1_000_000


# --- preprocessing fields ----------------------------------------------------------

PACK = {"column": "tokens", "blockSize": 512, "eosId": 2, "padId": 0, "blocksPerEpoch": 96}


def with_data(**fields):
    manifest = copy.deepcopy(GOOD)
    manifest["spec"]["data"].update(fields)
    return manifest


def test_preprocessing_fields_parse_and_survive_the_config_map():
    job = specs.parse_job(with_data(transform="vision.transforms:decode", transformArgs='{"size": 224}',
                                    onTransformError="fill"))
    assert job.data.transform == "vision.transforms:decode"
    assert job.data.transform_kwargs == {"size": 224} and job.data.on_transform_error == "fill"
    assert specs.parse_data_config(job.data_config()).data == job.data
    packed = specs.parse_job(with_data(packSequences={**PACK, "blocksPerEpoch": "auto"}))
    assert packed.data.pack_sequences == specs.PackSpec("tokens", 512, 2, 0, "auto")
    assert specs.parse_data_config(packed.data_config()).data == packed.data
    assert specs.parse_job(GOOD).data.on_transform_error == "raise"
    for mode in ("skip", "warn"):
        assert specs.parse_job(with_data(transform="m:f", onTransformError=mode)).data.on_transform_error == mode


@pytest.mark.parametrize(
    "fields,field,words",
    [
        ({"transform": "vision.transforms"}, "spec.data.transform", "package.module:function"),
        ({"transform": "a-b:c"}, "spec.data.transform", "package.module:function"),
        ({"transform": "m:f", "transformArgs": "[1]"}, "spec.data.transformArgs", "JSON object"),
        ({"transform": "m:f", "transformArgs": "{size"}, "spec.data.transformArgs", "JSON object"),
        ({"transformArgs": '{"a": 1}'}, "spec.data.transformArgs", "needs spec.data.transform"),
        ({"transform": "m:f", "onTransformError": "ignore"}, "spec.data.onTransformError",
         "raise, fill, skip, warn"),
        ({"transform": "m:f", "packSequences": PACK}, "spec.data.packSequences", "cannot be combined"),
        ({"packSequences": {**PACK, "blocksPerEpoch": 100}}, "spec.data.packSequences.blocksPerEpoch",
         "multiple of spec.data.numSplits=48"),
        ({"packSequences": {**PACK, "blocksPerEpoch": "lots"}}, "spec.data.packSequences.blocksPerEpoch",
         "or 'auto'"),
        ({"packSequences": {**PACK, "padId": 2}}, "spec.data.packSequences.padId", "differ from eosId"),
        ({"packSequences": {k: v for k, v in PACK.items() if k != "eosId"}},
         "spec.data.packSequences.eosId", "is required"),
        ({"packSequences": PACK, "columns": ["text"]}, "spec.data.columns", "['tokens']"),
    ],
)
def test_bad_preprocessing_fields_name_the_field(fields, field, words):
    with pytest.raises(specs.SpecError) as info:
        specs.parse_job(with_data(**fields))
    assert info.value.field == field
    assert words in str(info.value)


@pytest.mark.parametrize(("fields", "warned"), [
    ({"transformParallelism": 4}, ["spec.data.transformParallelism does nothing without spec.data.transform "
                                   "or spec.data.packSequences; remove it"]),
    ({"transformQueueDepth": 8}, ["spec.data.transformQueueDepth does nothing without"]),
    ({"onTransformError": "skip"}, ["spec.data.onTransformError=skip does nothing without spec.data.transform"]),
    ({"transformParallelism": 4, "transformQueueDepth": 8, "onTransformError": "fill"},
     ["transformParallelism", "transformQueueDepth", "onTransformError=fill"]),
    # Where they act, nothing is said.
    ({"transform": "m:f", "transformParallelism": 4, "transformQueueDepth": 8, "onTransformError": "skip"}, []),
    ({"packSequences": PACK, "transformParallelism": 4, "transformQueueDepth": 8}, []),
    ({}, []),
])
def test_fields_that_change_nothing_in_a_job_are_warned_of_by_name(fields, warned):
    said = specs.idle_fields(specs.parse_job(with_data(**fields)).data)
    assert len(said) == len(warned), said
    for line, words in zip(said, warned):
        assert words in line


@pytest.mark.parametrize(("field", "value", "message"), [
    ("transformParallelism", 0, "must be at least 1, got 0"),
    ("transformParallelism", 257, "must be at most 256, got 257"),
    ("transformParallelism", "4", "must be an integer, got '4'"),
    ("transformQueueDepth", 0, "must be at least 1, got 0"),
    ("transformQueueDepth", 65, "must be at most 64, got 65"),
    ("transformQueueDepth", True, "must be an integer, got True"),
])
def test_bad_transform_pool_settings_are_refused_naming_the_field(field, value, message):
    with pytest.raises(specs.SpecError) as info:
        specs.parse_job(with_(f"spec.data.{field}", value))
    assert info.value.field == f"spec.data.{field}"
    assert str(info.value) == f"spec.data.{field}: {message}"


def test_transform_pool_settings_reach_the_loaders_config_and_default_to_lancedbs_bound():
    job = specs.parse_job(GOOD)
    assert job.data.transform_parallelism is None and job.data.transform_queue_depth == 4
    assert "transformQueueDepth" not in job.data_config()["data"]  # configs of older jobs unchanged
    manifest = with_("spec.data.transformParallelism", 3)
    manifest["spec"]["data"]["transformQueueDepth"] = 9
    back = specs.parse_data_config(specs.parse_job(manifest).data_config())
    assert (back.data.transform_parallelism, back.data.transform_queue_depth) == (3, 9)
