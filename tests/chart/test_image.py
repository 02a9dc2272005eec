"""The container image recipe: Dockerfile and .dockerignore.

No container engine runs here, so the build is checked in parts: the recipe's
fixed points (base, torch pin, entry point, a numeric non-root user that
matches the chart), and a wheel built from exactly the files the Dockerfile
COPYs out of the .dockerignore-filtered context, which is what its
`pip install ".[sidecar,operator]"` would install.
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import zipfile

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def of(keyword: str) -> list[str]:
    return [rest for kw, rest in instructions() if kw == keyword]


def ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    patterns = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        glob = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(glob):
            if glob.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif glob.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif glob[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif glob[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(glob[i]), i + 1
        patterns.append((negated, re.compile(regex + r"$")))
    return patterns


def in_context(relative: str) -> bool:
    """Docker's rule: the last pattern matching the path or a parent wins."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    included = True
    for negated, pattern in ignore_patterns():
        if any(pattern.match(p) for p in prefixes):
            included = negated
    return included


def copies() -> list[tuple[str, str]]:
    pairs = []
    for rest in of("COPY"):
        *sources, dest = shlex.split(rest)
        assert not any(s.startswith("--") for s in sources), "no COPY flags expected"
        pairs.extend((src, dest) for src in sources)
    return pairs


class TestRecipe:
    def test_base_image_and_entry_point(self):
        assert of("FROM") == ["python:3.11-slim"]
        assert [json.loads(e) for e in of("ENTRYPOINT")] == [["splitfeed"]]

    def test_torch_is_pinned_to_the_cpu_build(self):
        runs = " ".join(of("RUN"))
        assert re.search(r'"?torch==2\.13\.0"?', runs)
        assert not re.search(r"torch(?!==2\.13\.0)[<>=~ ]", runs)
        assert any("/whl/cpu" in arg for arg in of("ARG"))

    def test_the_project_is_installed_with_the_sidecar_and_operator_extras(self):
        """`pip install .` alone is the trainer client (pyproject.toml): the image runs both others."""
        installs = [m.group(1) for run in of("RUN") for m in re.finditer(r"\bpip install \"?\.\[([^\]]*)\]", run)]
        assert installs and {"sidecar", "operator"} <= set(installs[0].split(",")), of("RUN")
        # and it checks that their commands load (an extra missing: exit 2, naming it)
        assert any("splitfeed sidecar --help" in run and "splitfeed operator --help" in run for run in of("RUN"))

    def test_it_runs_as_the_numeric_non_root_user_the_chart_expects(self):
        user = of("USER")[-1]
        values = yaml.safe_load((ROOT / "charts" / "splitfeed" / "values.yaml").read_text())
        security = values["podSecurityContext"]
        assert user == f"{security['runAsUser']}:{security['runAsGroup']}"
        assert int(user.split(":")[0]) != 0


class TestBuildContext:
    def test_every_copied_path_exists_and_is_in_the_context(self):
        for src, _ in copies():
            path = ROOT / src
            assert path.exists(), src
            assert in_context(src.rstrip("/")), f"{src} is excluded by .dockerignore"

    @pytest.mark.parametrize(
        "path,inside",
        [
            pytest.param(".venv/bin/python", False, id="venv"),
            pytest.param(".git/HEAD", False, id="git"),
            pytest.param("tests/unit/test_specs.py", False, id="tests"),
            pytest.param("trainer_client/__pycache__/x.pyc", False, id="pycache"),
            pytest.param("trainer_client/contract/specs.py", True, id="sources"),
            pytest.param("pyproject.toml", True, id="pyproject"),
        ],
    )
    def test_the_context_holds_sources_only(self, path, inside):
        assert in_context(path) is inside

    def test_every_package_in_pyproject_is_copied(self):
        import tomllib

        project = tomllib.loads((ROOT / "pyproject.toml").read_text())
        package_dirs = set(project["tool"]["setuptools"]["package-dir"].values())
        copied = {src.rstrip("/") for src, _ in copies()}
        assert package_dirs <= copied
        assert "pyproject.toml" in copied

    @pytest.mark.slow
    def test_pip_install_dot_in_the_context_builds_every_module_and_command(self, tmp_path):
        context = tmp_path / "context"
        for src, dest in copies():
            source, target = ROOT / src, context / dest
            if source.is_dir():  # COPY dir/ dest/ copies the directory's contents
                shutil.copytree(source, target, dirs_exist_ok=True, ignore=lambda d, names: [
                    n for n in names if not in_context(str((pathlib.Path(d) / n).relative_to(ROOT)))])
            else:
                if dest.endswith("/"):
                    target = target / source.name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
             "--wheel-dir", str(tmp_path / "wheels"), str(context)],
            check=True, capture_output=True, timeout=240,
        )
        (wheel,) = (tmp_path / "wheels").glob("splitfeed-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            entry_points = next(archive.read(n).decode() for n in names if n.endswith("entry_points.txt"))
        for package, folder in (("trainer_client", "trainer_client"), ("sidecar", "sidecar"), ("operator", "operator")):
            for module in (ROOT / folder).glob("*.py"):
                assert f"splitfeed/{package}/{module.name}" in names, module
        assert "splitfeed = splitfeed.trainer_client.cli:main" in entry_points
        for command in ("operator", "sidecar", "local", "plan"):
            assert re.search(rf"^{command} = splitfeed\.", entry_points, re.M), command
