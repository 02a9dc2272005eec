"""Regenerate the Helm chart's copy of the StreamingJob CRD.

`crds/streamingjob.yaml` is the source of truth; the chart installs the same
object from `charts/splitfeed/templates/crd.yaml`, which this script writes:
the source's document, wrapped in `{{- if .Values.crds.enabled }}` and
annotated `helm.sh/resource-policy: keep` so that `helm uninstall` never
deletes the CRD (and with it every StreamingJob in the cluster).

Run by `make sync-crd` (`python crds/sync.py`); `--check` writes nothing and
exits 1 when the copy is stale. Needs only PyYAML.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "crds" / "streamingjob.yaml"
TARGET = ROOT / "charts" / "splitfeed" / "templates" / "crd.yaml"

HEADER = (
    "{{- if .Values.crds.enabled }}\n"
    "# Generated from crds/streamingjob.yaml by crds/sync.py (make sync-crd).\n"
    "# Do not edit: change the source and run the script.\n"
)
FOOTER = "{{- end }}\n"
KEEP = "  annotations:\n    helm.sh/resource-policy: keep\n"


class SyncError(Exception):
    """The source cannot be turned into a chart template as it stands."""


def render(source_text: str) -> str:
    """The chart template for a CRD source document."""
    if "{{" in source_text or "}}" in source_text:
        raise SyncError(f"{SOURCE.name} must not contain '{{{{' or '}}}}': Helm would read them")
    parsed = yaml.safe_load(source_text)
    if not isinstance(parsed, dict) or parsed.get("kind") != "CustomResourceDefinition":
        raise SyncError(f"{SOURCE.name} must hold exactly one CustomResourceDefinition")
    if "annotations" in (parsed.get("metadata") or {}):
        raise SyncError(f"{SOURCE.name}: put no annotations in metadata; the chart adds its own")
    lines = source_text.splitlines(keepends=True)
    # Drop the source's leading comment block; the header says where it lives.
    start = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    body: list[str] = []
    for line in lines[start:]:
        body.append(line if line.endswith("\n") else line + "\n")
        if line.rstrip("\n") == "metadata:":
            body.append(KEEP)
    if KEEP not in body:
        raise SyncError(f"{SOURCE.name} has no top-level 'metadata:' line")
    return HEADER + "".join(body) + FOOTER


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the chart copy is stale")
    args = parser.parse_args(argv)
    try:
        wanted = render(SOURCE.read_text())
    except SyncError as exc:
        print(f"crds/sync.py: error: {exc}", file=sys.stderr)
        return 2
    current = TARGET.read_text() if TARGET.exists() else None
    if args.check:
        if current != wanted:
            print(f"{TARGET.relative_to(ROOT)} is stale: run `make sync-crd`", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        TARGET.write_text(wanted)
        print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
