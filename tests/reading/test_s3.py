"""Reading from object storage: the same table on S3 (moto) and on local disk.

`moto_server` (from moto[server]) runs as a subprocess on a free loopback port
(the `s3_endpoint` fixture in conftest.py). Credentials
reach lancedb only as storage options passed to `iter_rank_batches` (the way
the sidecar gets them from the Secret), never through the environment; the
endpoint and region come from the spec's non-secret `storageOptions`.
"""

from __future__ import annotations

import pytest

from splitfeed.sidecar.forks import workers
from tests.reading.tables import (
    CREDENTIALS,
    as_rows,
    data_spec,
    endpoint_options,
    reference_rows,
    whole_batches,
    write_table,
)



@pytest.fixture(scope="module")
def s3_uri(s3_bucket: str, s3_endpoint: str, db_uri: str) -> str:
    """The `frames` table written to s3://BUCKET/db (db_uri holds the local twin)."""
    uri = f"s3://{s3_bucket}/db"
    write_table(uri, {**CREDENTIALS, **endpoint_options(s3_endpoint)})
    return uri


def test_a_table_on_s3_yields_the_same_batches_as_on_local_disk_and_the_reference(
    s3_uri: str, s3_endpoint: str, db_uri: str
) -> None:
    # Rank 1 of 2, in-process: worker processes get the same storage options as
    # arguments, and each spawn costs seconds, so they are tested on local disk.
    on_s3 = data_spec(s3_uri, storage_options=endpoint_options(s3_endpoint), epochs=1)
    remote = list(workers.iter_rank_batches(on_s3, CREDENTIALS, rank=1, world_size=2,
                                            start_global_step=0))
    local = list(workers.iter_rank_batches(data_spec(db_uri, epochs=1), {}, rank=1,
                                           world_size=2, start_global_step=0))
    reference = reference_rows(on_s3, epoch=0, rank=1, world_size=2, storage_options=CREDENTIALS)
    assert len(remote) == len(local) > 0
    assert [step for step, _ in remote] == [step for step, _ in local]
    assert [as_rows(b) for _, b in remote] == [as_rows(b) for _, b in local]
    assert [as_rows(b) for _, b in remote] == whole_batches(reference, on_s3.global_batch_size // 2)

