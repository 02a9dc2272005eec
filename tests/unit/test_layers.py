"""The layering of docs/architecture.md, kept by import-linter, the stdlib's `operator`, and
the tests' own rule (docs/testing.md): no test module imports another."""

import ast
import os
import subprocess
import sys
import types
from pathlib import Path

import splitfeed.trainer_client as trainer_client

ROOT = Path(__file__).resolve().parents[2]


VIEW = ROOT / "pkg"
"""`splitfeed.*` as plain folders (committed symlinks): import-linter cannot follow
editable-install finders."""


def test_the_committed_view_maps_each_folder():
    for name in ("trainer_client", "sidecar", "operator", "local"):
        assert (VIEW / "splitfeed" / name).resolve() == ROOT / name


def test_import_contracts_are_kept():
    env = {**os.environ, "PYTHONPATH": str(VIEW)}
    done = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_the_standard_librarys_operator_wins_from_the_repo_root():
    done = subprocess.run([sys.executable, "-c", "import operator, collections; print(operator.__file__)"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not done.stdout.strip().startswith(str(ROOT / "operator"))


def test_the_trainer_client_exports_what_it_documents():
    for name in trainer_client.__all__:
        exported = getattr(trainer_client, name)
        home = exported.__name__ if isinstance(exported, types.ModuleType) else exported.__module__
        assert home.startswith("splitfeed.trainer_client."), (name, home)
    assert "StreamClient" in trainer_client.__all__


def test_the_import_check_names_test_modules_only():
    assert imported_test_modules("from tests.support.waiting import wait_for\nimport tests.reading.tables\n") == []
    assert imported_test_modules("from tests.operator.test_kube_api import wait_for\n"
                                 "import tests.chart.test_chart as c\nfrom tests.chart import test_rbac\n") == [
        "tests.operator.test_kube_api", "tests.chart.test_chart", "tests.chart.test_rbac"]


def imported_test_modules(source: str) -> list[str]:
    """The `tests.*.test_*` modules that `source` imports, in order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [n for n in names if n.startswith("tests.") and n.rsplit(".", 1)[-1].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    """What two test modules share lives in tests/support (or a tier's helper module)."""
    offenders = {str(path.relative_to(ROOT)): imported_test_modules(path.read_text())
                 for path in sorted((ROOT / "tests").rglob("*.py"))}
    assert {path: names for path, names in offenders.items() if names} == {}


MAX_FUNCTION_LINES, MAX_CLASS_LINES = 60, 200
"""Rooms a newcomer can hold (issue 23): counted from `def`/`class` to the last line, decorators not."""


def oversized(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        limit = (MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 else MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else None)
        if limit is not None and (lines := node.end_lineno - node.lineno + 1) > limit:  # type: ignore[operator]
            found.append(f"{where}: {node.name} is {lines} lines (at most {limit})")  # type: ignore[attr-defined]
    return found


def test_no_function_over_60_lines_and_no_class_over_200_in_the_product():
    found = [line for package in ("operator", "sidecar", "trainer_client", "local")
             for path in sorted((ROOT / package).rglob("*.py"))
             for line in oversized(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


def test_the_size_check_counts_what_it_says():
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    assert oversized(f"def f():\n{body}\n", "m.py") == ["m.py: f is 61 lines (at most 60)"]
    assert oversized(f"def f():\n{body[:body.rindex(chr(10))]}\n", "m.py") == []
