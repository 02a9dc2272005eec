"""The README's framework examples are the code the integration tests run, line for line."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
HERE = Path(__file__).parent


def readme_block(marker: str) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"expected one README example with {marker}"
    return found[0].splitlines()


@pytest.mark.parametrize("module, trainer", [
    ("integrations.lightning", "lightning_trainer.py"), ("integrations.hf", "hf_trainer.py"),
    ("init_device_mesh", "mesh_trainer.py"), ("from accelerate import Accelerator", "accelerate_trainer.py"),
])
def test_the_readme_example_is_what_the_tested_trainer_runs(module, trainer):
    lines = readme_block(module)
    first = next(i for i, line in enumerate(lines) if line.startswith("client = "))
    body, imports = lines[first:], "\n".join(lines[:first]).strip()
    assert len(body) <= 15, f"the README's {module} example is {len(body)} lines"
    source = (HERE / trainer).read_text()
    marked = re.search(r"# README, .*? as written there:\n(.*?)    # \(README ends\.\)", source, re.S)
    assert marked, f"{trainer} marks no README block"
    assert textwrap.dedent(marked.group(1)).splitlines() == body
    for statement in re.split(r"\n(?=\S)", imports):  # each import the example needs, the trainer has
        names = re.findall(r"\b(\w+)\b(?=,|\)|$)", statement.split("import", 1)[1])
        assert all(re.search(rf"\b{n}\b", source) for n in names), (statement, names)
