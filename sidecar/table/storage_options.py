"""Storage options as a Secret volume lays them out: one option per file.

A module of its own so that `splitfeed local` (which needs them for the
checkpoint store) does not import the sidecar's reading stack (lancedb, torch):
seconds of start-up for a launcher that reads no data.
"""

from __future__ import annotations

from pathlib import Path


def read_storage_options(directory: Path | None) -> dict[str, str]:
    """One option per file, as a Secret volume lays them out."""
    if directory is None or not directory.is_dir():
        return {}
    return {p.name: p.read_text().strip() for p in sorted(directory.iterdir())
            if p.is_file() and not p.name.startswith(".")}
