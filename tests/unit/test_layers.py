"""The layering of docs/architecture.md, kept by import-linter, and the stdlib's `operator`."""

import os
import subprocess
import sys
from pathlib import Path

import splitfeed.trainer_client as trainer_client

ROOT = Path(__file__).resolve().parents[2]


VIEW = ROOT / "pkg"
"""`splitfeed.*` as plain folders (committed symlinks): import-linter cannot follow
editable-install finders."""


def test_the_committed_view_maps_each_folder():
    for name in ("trainer_client", "sidecar", "operator"):
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
        assert getattr(trainer_client, name).__module__.startswith("splitfeed.trainer_client")
    assert "StreamClient" in trainer_client.__all__
