"""The pod contract: trainer_client/contract/wellknown.py and docs/pod-contract.md say the same,
and the operator and `splitfeed local` build one environment from it; and every
file, module and function docs/*.md and README.md cite exists."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from splitfeed.operator.objects import planning
from splitfeed.local import processes
from splitfeed.trainer_client.script import client, counters
from splitfeed.trainer_client.contract import wellknown, specs
from splitfeed.trainer_client.contract.errors import ProtocolError
from tests.support.builders import manifest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "pod-contract.md").read_text()


def section(title: str) -> str:
    """The text of the `## title` section of the page."""
    start = DOC.index(f"## {title}")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end if end > 0 else None]


def first_column(text: str) -> list[str]:
    return [line.split("|")[1] for line in text.splitlines() if line.startswith("| ")]


def values(suffix: str, prefix: str = "") -> set[str]:
    return {v for k, v in vars(wellknown).items()
            if k.endswith(suffix) and isinstance(v, str) and v.startswith(prefix)}


def test_the_documented_splitfeed_variables_are_the_contracts():
    rows = first_column(section("Environment"))
    documented = {name for row in rows for name in re.findall(r"`(SPLITFEED_[A-Z_]+)`", row)}
    assert documented == values("_ENV", "SPLITFEED_")


def test_the_documented_rank_variables_are_what_the_builder_sets():
    rows = first_column(section("Environment"))
    documented = {name for row in rows for name in re.findall(r"`([A-Z_]+)`", row)
                  if not name.startswith(("SPLITFEED_", "PET_"))}
    built = wellknown.rank_env(world_size=4, gpus_per_replica=2, replica=1, local_rank=0, master_addr="a",
                              master_port=1, socket_dir="/s", world_epoch=0)
    assert documented == {k for k in built if not k.startswith("SPLITFEED_")}


def test_the_documented_labels_and_annotations_are_the_contracts():
    documented = set(re.findall(r"`(splitfeed\.io/[a-z-]+)`", section("Names, labels and annotations")))
    assert documented == values("", "splitfeed.io/") - {wellknown.API_VERSION}
    assert documented == {wellknown.LABEL_JOB, wellknown.LABEL_REPLICA, wellknown.LABEL_EPOCH,
                          wellknown.ANNOTATION_DRAIN, wellknown.ANNOTATION_DRAIN_REPLICAS,
                          wellknown.ANNOTATION_CHECKSUM}


def test_the_documented_volumes_paths_and_ports_are_the_contracts():
    volumes = section("Volumes")
    assert {n for row in first_column(volumes) for n in re.findall(r"`(splitfeed-[a-z]+)`", row)} == {
        *wellknown.RESERVED_VOLUMES, wellknown.VOLUME_TRANSFORMS}
    for path in (wellknown.SOCKET_DIR, wellknown.CONFIG_DIR, wellknown.PODINFO_DIR, wellknown.STORAGE_DIR,
                 wellknown.TRANSFORMS_DIR):
        assert f"`{path}`" in volumes, path
    assert wellknown.TERMINATION_LOG in section("Containers and commands")
    assert f"--config {wellknown.CONFIG_DIR}/{wellknown.CONFIG_FILE}" in section("Containers and commands")
    names = section("Names, labels and annotations")
    assert f"`rendezvous` {wellknown.MASTER_PORT}" in names and f"`coordinator` {wellknown.COORDINATOR_PORT}" in names
    assert f"`{wellknown.SIDECAR_NAME}`" in section("Containers and commands")


def test_the_documented_report_is_the_contracts():
    line = re.search(r"`(\{\"globalStep\".*?\})`", section("What the sidecar reports"), re.S)
    assert line is not None
    text = line.group(1)
    inner = re.search(r'"lastCheckpoint": (\{.*?\})', text)
    assert inner is not None
    assert re.findall(r'"(\w+)":', inner.group(1)) == list(wellknown.LAST_CHECKPOINT_FIELDS)
    outer = re.findall(r'"(\w+)":', text.replace(inner.group(1), ""))
    assert outer == list(wellknown.REPORT_FIELDS)
    table = {row.strip(" `") for row in first_column(section("What the sidecar reports"))[2:]}
    assert table <= set(wellknown.REPORT_FIELDS)


def test_the_documented_stats_record_is_what_the_client_writes(tmp_path):
    row = next(line for line in section("Environment").splitlines() if f"`{wellknown.STATS_FILE_ENV}`" in line)
    assert re.findall(r'"(\w+)"', row) == list(wellknown.STATS_FIELDS)
    stats = counters.Stats(str(tmp_path / "stats.json"))
    stats.write(final=True)
    assert list(json.loads((tmp_path / "stats.json").read_text())) == list(wellknown.STATS_FIELDS)


def test_the_crd_coordinates_are_the_crds():
    crd = yaml.safe_load((ROOT / "crds" / "streamingjob.yaml").read_text())["spec"]
    assert (crd["group"], [v["name"] for v in crd["versions"]]) == (wellknown.GROUP, [wellknown.VERSION])
    assert (crd["names"]["kind"], crd["names"]["plural"]) == (wellknown.KIND, wellknown.PLURAL)
    assert wellknown.API_VERSION == f"{crd['group']}/{crd['versions'][0]['name']}"
    assert planning.Owner("j", "u").reference()["apiVersion"] == wellknown.API_VERSION


@pytest.mark.parametrize("gpus, replicas", [(1, 4), (2, 2), (4, 2)])
def test_local_processes_get_the_pods_rank_variables(gpus, replicas, monkeypatch):
    monkeypatch.setattr(processes.os, "environ", {"KEEP": "1"})
    job = specs.parse_job(manifest(replicas=replicas, gpusPerReplica=gpus))
    for replica in range(replicas):
        pod = planning.pod_env(job, 3, replica)
        here = processes.rank_env(job, replica, 0, Path("/tmp/s"), 1234, 3)
        machine_specific = {wellknown.MASTER_ADDR, wellknown.MASTER_PORT_ENV, wellknown.SOCKET_DIR_ENV}
        assert {k: v for k, v in here.items() if k in pod and k not in machine_specific} == {
            k: v for k, v in pod.items() if k not in machine_specific}
        assert here["KEEP"] == "1" and here[wellknown.JOB_UID_ENV] == wellknown.LOCAL_JOB_UID
        assert here[wellknown.MASTER_ADDR] == "127.0.0.1" and here[wellknown.MASTER_PORT_ENV] == "1234"
        assert pod[wellknown.MASTER_PORT_ENV] == str(wellknown.MASTER_PORT)
        last = processes.rank_env(job, replica, gpus - 1, Path("/tmp/s"), 1234, 3)
        assert last[wellknown.RANK] == str(replica * gpus + gpus - 1)


def test_the_sidecar_gets_a_resume_step_instead_of_a_resume_mode():
    base = {"coordinator": "tcp://c:1", "job_uid": "u"}
    assert wellknown.sidecar_env(**base, resume_step=None, resume="none") == {
        "SPLITFEED_RESUME": "none", "SPLITFEED_COORDINATOR": "tcp://c:1", "SPLITFEED_JOB_UID": "u"}
    assert wellknown.sidecar_env(**base, resume_step=7, table_version=3, config_checksum="abc") == {
        "SPLITFEED_RESUME_STEP": "7", "SPLITFEED_COORDINATOR": "tcp://c:1", "SPLITFEED_JOB_UID": "u",
        "SPLITFEED_TABLE_VERSION": "3", "SPLITFEED_CONFIG_CHECKSUM": "abc"}


# --- every file, module and function the docs cite exists -------------------------------

PAGES = sorted(ROOT.glob("docs/*.md")) + [ROOT / "README.md"]
PACKAGES = ("trainer_client", "sidecar", "operator", "local")

CITED_PATH = re.compile(r"(?<![\w./-])\.?(?:sidecar|trainer_client|operator|local|tests|docs|examples|charts|crds|pkg|\.ci)"
                        r"/[\w./-]*")
"""A path into one of the repository's folders: `sidecar/foo.py`, tests/support, charts/splitfeed/..."""

CITED_NAME = re.compile(r"(?<![\w./-])([a-z_]\w*)\.([A-Za-z_]\w*)")
"""`module.name` inside backticks, as in `ring.futex_wait` or `client.checkpoint()`."""

CITED_IN_FILE = re.compile(r"\b([\w/]+\.py): `?([A-Za-z_]\w*)")
"""`path.py: name`, as in `sidecar/data/streaming.py: reference_dataset`."""

ALIASES = {"client": [("trainer_client/script/client.py", "StreamClient"), ("trainer_client/script/adapting.py", "Adapting")]}
"""Names the docs use for an object rather than a module: the README's `client = StreamClient(...)`
(the class and the base class it takes its framework-facing members from)."""


def cited_paths(text: str) -> set[str]:
    return {m.group(0).rstrip("./") for m in CITED_PATH.finditer(text)}


def defined_names(tree: ast.AST) -> set[str]:
    """Names a module or class body binds: functions, classes, assignments, imports (and a
    class's `self.x` attributes)."""
    names: set[str] = set()
    body = tree.body if isinstance(tree, (ast.Module, ast.ClassDef)) else []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(tree, ast.ClassDef):
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                  and isinstance(n.value, ast.Name) and n.value.id == "self" and isinstance(n.ctx, ast.Store)}
    return names


def names_in(path: Path, cls: str | None = None) -> set[str]:
    tree: ast.AST = ast.parse(path.read_text())
    if cls is not None:
        tree = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return defined_names(tree)


def chart_values(dotted: str) -> bool:
    """Whether `dotted` (metrics.serviceMonitor.enabled) is a key path of the chart's values."""
    node = yaml.safe_load((ROOT / "charts" / "splitfeed" / "values.yaml").read_text())
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def unresolved_names(text: str) -> list[str]:
    """`module.name` citations (in backticks) of a module of the packages whose module
    has no such name, and `path.py: name` citations whose file does not define it."""
    modules: dict[str, list[Path]] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            modules.setdefault(path.stem, []).append(path)
    missing = []
    for quoted in re.findall(r"`([^`\n]+)`", text):
        for m in CITED_NAME.finditer(quoted):
            module, name = m.groups()
            if name in ("py", "md", "yaml", "json", "sh"):
                continue  # a file name such as `reading.py`: CITED_PATH's and the folder's business
            if module in ALIASES:
                found = any(name in names_in(ROOT / where, cls) for where, cls in ALIASES[module])
            elif module in modules:
                found = any(name in names_in(path) for path in modules[module])
                found = found or chart_values(quoted[m.start():].split()[0].strip("(),"))
            else:
                continue
            if not found:
                missing.append(m.group(0))
    for path, name in CITED_IN_FILE.findall(text):
        file = ROOT / path if (ROOT / path).exists() else ROOT / "tests" / path
        if file.exists() and name not in names_in(file):
            missing.append(f"{path}: {name}")
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_a_page_cites_exists(page):
    assert sorted(p for p in cited_paths(page.read_text()) if not (ROOT / p).exists()) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_module_function_a_page_cites_exists(page):
    assert unresolved_names(page.read_text()) == []


def test_the_doc_checks_catch_what_drifts():
    text = ("`operator/worlds.py` beside sidecar/serving/service.py; `ring.futex_wait`, `ring.no_such_thing`, "
            "`client.checkpoint()`, `client.no_such_method()`, `metrics.serviceMonitor.enabled`, "
            "`metrics.noSuchValue`; `sidecar/data/reading.py: open_table`, `sidecar/data/reading.py: gone`")
    assert cited_paths(text) == {"operator/worlds.py", "sidecar/serving/service.py", "sidecar/data/reading.py"}
    assert [p for p in cited_paths(text) if not (ROOT / p).exists()] == ["operator/worlds.py"]
    assert unresolved_names(text) == ["ring.no_such_thing", "client.no_such_method", "metrics.noSuchValue",
                                      "sidecar/data/reading.py: gone"]


# --- the report as the operator reads it (wellknown.SidecarReport) ---------------------------------

FULL_REPORT: wellknown.Report = {
    "globalStep": 121, "epoch": 1, "step": 21, "stepsPerEpoch": 100,
    "lastCheckpoint": {"step": 100, "epoch": 1, "worldSize": 4, "time": "2026-01-01T12:00:00+00:00"},
    "drained": True, "agreedStep": 121, "drainReason": "rescale", "resumeStep": 80, "tableVersion": 7,
    "error": None, "permanent": False, "filledRows": 2, "skippedRows": 3,
}


def test_the_parser_reads_every_field_the_sidecar_writes():
    assert wellknown.SidecarReport.WIRE_FIELDS == wellknown.REPORT_FIELDS
    assert tuple(f.name for f in dataclasses.fields(wellknown.ReportedCheckpoint)) == (
        "step", "epoch", "world_size", "time")


def test_a_report_the_sidecar_wrote_parses_into_a_typed_report(tmp_path):
    from splitfeed.sidecar import main

    main.write_report(tmp_path / "termination-log", FULL_REPORT)
    text = (tmp_path / "termination-log").read_text()
    report = wellknown.SidecarReport.parse(text, finished_at="2026-01-01T12:00:05Z")
    assert report == wellknown.SidecarReport(
        global_step=121, epoch=1, step=21, steps_per_epoch=100,
        last_checkpoint=wellknown.ReportedCheckpoint(step=100, epoch=1, world_size=4, time="2026-01-01T12:00:00+00:00"),
        drained=True, agreed_step=121, drain_reason="rescale", resume_step=80, table_version=7, error=None,
        permanent=False, filled_rows=2, skipped_rows=3, finished_at="2026-01-01T12:00:05Z")
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.drained = False


def test_the_reduced_report_of_a_sidecar_that_could_not_start_parses_with_defaults():
    reduced = {"globalStep": 0, "lastCheckpoint": None, "drained": False, "agreedStep": None,
               "error": "the sidecar cannot start: OSError: boom", "permanent": False}
    report = wellknown.SidecarReport.parse(json.dumps(reduced))
    assert report is not None and report.error == "the sidecar cannot start: OSError: boom"
    assert (report.global_step, report.last_checkpoint, report.drained, report.agreed_step) == (0, None, False, None)
    assert (report.steps_per_epoch, report.table_version, report.drain_reason, report.finished_at) == (
        None, None, None, None)
    assert (report.permanent, report.filled_rows, report.skipped_rows) == (False, 0, 0)
    assert wellknown.SidecarReport.parse("{}") == wellknown.SidecarReport()


def test_the_last_line_of_the_message_is_the_report_and_unknown_fields_are_ignored():
    text = "a log line\n" + json.dumps({"drained": True, "agreedStep": 12, "fromANewerSidecar": [1]}) + "\n"
    report = wellknown.SidecarReport.parse(text)
    assert report is not None and report.drained and report.agreed_step == 12


@pytest.mark.parametrize("text, why", [
    ("", "empty"),
    ("not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"globalStep": "12"}', "report.globalStep"),
    ('{"globalStep": true}', "report.globalStep"),
    ('{"agreedStep": 1.5}', "report.agreedStep"),
    ('{"drained": 1}', "report.drained"),
    ('{"error": 3}', "report.error"),
    ('{"lastCheckpoint": [100]}', "report.lastCheckpoint"),
    ('{"lastCheckpoint": {"epoch": 0}}', "report.lastCheckpoint has no step"),
    ('{"lastCheckpoint": {"step": false}}', "report.lastCheckpoint.step"),
    ('{"lastCheckpoint": {"step": 3, "worldSize": "4"}}', "report.lastCheckpoint.worldSize"),
    ("[" * 100_000, "not JSON"),
])
def test_a_message_that_is_not_a_valid_report_is_none_and_says_why(text, why):
    assert wellknown.SidecarReport.parse(text) is None
    with pytest.raises(ProtocolError, match=re.escape(why)):
        wellknown.SidecarReport.from_text(text)
