"""The layering of docs/architecture.md, kept by import-linter, the stdlib's `operator`, and
the tests' own rule (docs/testing.md): no test module imports another."""

import ast
import os
import re
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


PACKAGES = ("trainer_client", "sidecar", "operator", "local")


def product_modules() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


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
    found = [line for path in product_modules() for line in oversized(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


def test_the_size_check_counts_what_it_says():
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    assert oversized(f"def f():\n{body}\n", "m.py") == ["m.py: f is 61 lines (at most 60)"]
    assert oversized(f"def f():\n{body[:body.rindex(chr(10))]}\n", "m.py") == []


MAX_MODULE_LINES, MAX_MODULE_DEFINITIONS, MAX_FOLDER_MODULES = 600, 35, 12
"""A module a reader can hold whole, and a floor they can scan (issue 36): lines of the file,
functions and classes in the module's body, modules side by side in one folder."""


def overfull(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    definitions = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body)
    lines = len(source.splitlines())
    return ([f"{where} is {lines} lines (at most {MAX_MODULE_LINES})"] if lines > MAX_MODULE_LINES else []) + (
        [f"{where} defines {definitions} functions and classes (at most {MAX_MODULE_DEFINITIONS})"]
        if definitions > MAX_MODULE_DEFINITIONS else [])


def test_no_module_over_600_lines_or_35_definitions_in_the_product():
    found = [line for path in product_modules() for line in overfull(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


def test_the_module_check_counts_what_it_says():
    defs = "".join(f"def f{i}():\n    pass\n" for i in range(35))
    assert overfull(defs, "m.py") == []
    assert overfull(defs + "class C:\n    pass\n", "m.py") == ["m.py defines 36 functions and classes (at most 35)"]
    assert overfull("x = 1\n" * 601, "m.py") == ["m.py is 601 lines (at most 600)"]


def test_no_folder_holds_more_than_12_modules_side_by_side():
    folders = {path.parent for path in product_modules()}
    crowded = {str(f.relative_to(ROOT)): n for f in folders
               if (n := sum(1 for m in f.glob("*.py") if m.name != "__init__.py")) > MAX_FOLDER_MODULES}
    assert crowded == {}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle_counting_type_checking_imports():
    """grimp (import-linter's graph) records imports under `if TYPE_CHECKING:` as imports too: a
    cycle that only typing closes is still two modules that cannot be read one before the other."""
    assert import_cycles(module_graph("splitfeed", VIEW)) == []


def module_graph(package: str, path: Path) -> dict[str, set[str]]:
    """Each module of `package` (found under `path`) and the package's modules it imports, as grimp reads them."""
    import grimp

    sys.path.insert(0, str(path))
    try:
        graph = grimp.build_graph(package, include_external_packages=False)
    finally:
        sys.path.remove(str(path))
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def test_the_cycle_check_finds_a_cycle_that_only_typing_closes(tmp_path):
    (tmp_path / "typed").mkdir()
    (tmp_path / "typed" / "__init__.py").write_text("")
    (tmp_path / "typed" / "a.py").write_text("from . import b\n")
    (tmp_path / "typed" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (tmp_path / "typed" / "c.py").write_text("from . import a\n")
    assert import_cycles(module_graph("typed", tmp_path)) == [["typed.a", "typed.b"]]
    (tmp_path / "typed" / "b.py").write_text("")
    assert import_cycles(module_graph("typed", tmp_path)) == []


def drawn_floors() -> dict[str, set[str]]:
    """docs/architecture.md's floors table: folder -> the modules its row names."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Layers"):]
    section = section[:section.index("\n## ", 1)]
    floors = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and (folder := re.fullmatch(r"`([\w/]+)/`", cells[0])) and cells[1]:
            floors[folder.group(1)] = set(re.findall(r"`(\w+)`", cells[1]))
    return floors


def test_the_architecture_draws_every_floor_with_its_modules():
    folders = {str(path.parent.relative_to(ROOT)) for path in product_modules()}
    actual = {folder: {m.stem for m in (ROOT / folder).glob("*.py") if m.name != "__init__.py"}
              for folder in folders}
    assert drawn_floors() == actual
