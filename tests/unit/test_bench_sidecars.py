"""The benches that start a lone sidecar still get batches from it (make bench is not in CI: a
sidecar that refuses the bench's setup, as one without the job's keypair did, shows here)."""

from __future__ import annotations

import pytest

from tests.bench import adapters, run


@pytest.mark.parametrize("way", ["bare", "lightning"])
def test_each_way_of_the_adapters_bench_reads_the_whole_table_from_its_sidecar(tmp_path, monkeypatch, way):
    monkeypatch.setattr(run, "E2E_ROWS", 8 * run.E2E_BATCH)
    uri = str(tmp_path / "db")
    run.write_table(uri)
    seen: list[int] = []

    def counted(client):  # type: ignore[no-untyped-def]
        for rows in (run.bare_loop if way == "bare" else adapters.WAYS[way])(client):
            seen.append(rows)
            yield rows

    assert run.sidecar_rows_per_s(uri, tmp_path, counted) > 0
    assert seen == [run.E2E_BATCH] * 8  # every global step of the one epoch, whole
