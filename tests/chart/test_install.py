"""`pip install splitfeed` is the trainer client: pyzmq, numpy and pyarrow, nothing else.

A fresh venv (`python -m venv`) gets splitfeed's wheel, built from the sources, with
--no-deps, and the three dependencies linked in from this venv (the files their
installed records list, so no index is needed: the suite runs without a network).
In it the trainer's imports and the `splitfeed` command run as a user's would; the
sidecar's and the operator's commands say which extra to install.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DEPENDENCIES = ("pyzmq", "numpy", "pyarrow")
NOT_FOR_THE_CLIENT = ("yaml", "prometheus_client", "lancedb", "kopf", "kubernetes", "torch", "tqdm")


def run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """splitfeed's wheel, built from a copy of the sources (the checkout gets no build/)."""
    root = tmp_path_factory.mktemp("client-wheel")
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for folder in ("trainer_client", "sidecar", "operator", "local"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    done = run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                "--wheel-dir", str(root / "wheels"), str(source)])
    assert done.returncode == 0, done.stderr
    (built,) = (root / "wheels").glob("splitfeed-*.whl")
    return built


@pytest.fixture(scope="module")
def client_venv(wheel: Path) -> Path:
    """A venv holding splitfeed and its three dependencies only; its bin/ folder."""
    venv = wheel.parent.parent / "venv"
    done = run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert done.returncode == 0, done.stderr
    python = venv / "bin" / "python"
    done = run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                "--no-index", str(wheel)])
    assert done.returncode == 0, done.stderr
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                .stdout.strip())
    for name in CLIENT_DEPENDENCIES:
        distribution = metadata.distribution(name)
        tops = {Path(str(file)).parts[0] for file in distribution.files or []} - {".."}
        for top in tops:
            os.symlink(Path(str(distribution.locate_file(top))), site / top)
    return venv / "bin"


def test_pip_install_splitfeed_requires_pyzmq_numpy_and_pyarrow_alone(wheel):
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(archive.read(name))
    required = meta.get_all("Requires-Dist") or []
    plain = sorted(r.split(">")[0].split("=")[0].split("<")[0].strip() for r in required if "extra ==" not in r)
    assert plain == sorted(CLIENT_DEPENDENCIES), required
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"sidecar", "operator", "torch", "lightning", "hf", "all", "test"} <= extras, extras
    torch = [r for r in required if r.startswith("torch")]
    assert all("==" not in r.split(";")[0] for r in torch if 'extra == "test"' not in r), torch  # a range, not a pin


def test_the_trainer_client_imports_with_its_three_dependencies_only(client_venv):
    script = f"""
import importlib, importlib.util, pkgutil, sys
absent = [m for m in {NOT_FOR_THE_CLIENT!r} if importlib.util.find_spec(m) is not None]
assert not absent, f"not a client-only venv: {{absent}} installed"
import splitfeed.trainer_client
from splitfeed.trainer_client import StreamClient
from splitfeed.trainer_client.contract import versions
for module in pkgutil.walk_packages(splitfeed.trainer_client.__path__, "splitfeed.trainer_client."):
    if not module.name.startswith("splitfeed.trainer_client.integrations."):  # each needs its framework
        importlib.import_module(module.name)
print(versions.package_version(), StreamClient.__name__)
"""
    done = run([str(client_venv / "python"), "-c", script], cwd=client_venv)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [metadata.version("splitfeed"), "StreamClient"]


def test_the_splitfeed_command_says_its_version_and_which_extra_a_command_needs(client_venv):
    splitfeed = str(client_venv / "splitfeed")
    version = run([splitfeed, "--version"])
    assert (version.returncode, version.stdout.strip()) == (
        0, f"splitfeed {metadata.version('splitfeed')} (wire protocol 1)"), version.stderr
    for command, extra, module in (("sidecar", "sidecar", "lancedb"), ("local", "sidecar", "lancedb"),
                                   ("plan", "sidecar", "yaml"), ("operator", "operator", "kopf")):
        done = run([splitfeed, command, "--help"])
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"splitfeed {command}: error: needs "), done.stderr
        assert module in done.stderr and f"pip install 'splitfeed[{extra}]'" in done.stderr, done.stderr
    listing = run([splitfeed, "--help"])
    assert listing.returncode == 0 and "(unavailable: needs lancedb" in listing.stdout, listing.stdout
    agent = run([splitfeed, "run", "--help"])  # the trainer side's command needs no extra
    assert agent.returncode == 0, agent.stderr
