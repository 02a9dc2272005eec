"""The sidecar layer's subcommands: `plan` and `sidecar` (`splitfeed local` is local/commands.py's).

Each function configures its argparse sub-parser (see trainer_client/cli.py);
heavy imports happen only when the command runs, so `splitfeed --help` stays fast.
Each first checks that the `sidecar` extra's modules it needs are installed
(`cli.require_extra`): `pip install splitfeed` alone is the trainer client.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from splitfeed.trainer_client import cli
from splitfeed.trainer_client.contract import wellknown, errors, geometry, specs

if TYPE_CHECKING:
    from .table import plans

AddParser = Callable[..., argparse.ArgumentParser]

EXTRA = "sidecar"
"""The extra (pyproject.toml) that brings these commands' dependencies."""
SERVING = ("lancedb", "prometheus_client")
"""What a sidecar imports beyond the trainer client's pyzmq, numpy and pyarrow."""

MANIFEST_HELP = "StreamingJob manifest (YAML/JSON)"
STORAGE_OPTIONS_HELP = "one storage option per file"


def load_manifest(path: str) -> dict[str, Any]:
    """A StreamingJob from a YAML or JSON file ("-" reads standard input)."""
    import yaml

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise errors.UserError(f"cannot read {path}: {exc}") from exc
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise errors.UserError(f"{path} is not valid YAML: {exc}") from exc
    jobs = [d for d in documents if isinstance(d, dict) and d.get("kind") == specs.KIND]
    if len(jobs) != 1:
        raise errors.UserError(f"{path} must hold exactly one StreamingJob, found {len(jobs)}")
    return jobs[0]


def parse_job_file(path: str, replicas: int | None = None) -> specs.JobSpec:
    import dataclasses

    try:
        job = specs.parse_job(load_manifest(path), check_replicas=False)
        if replicas is not None:
            job = dataclasses.replace(job, replicas=replicas)
        job.check_topology()
    except ValueError as exc:  # SpecError, TopologyError
        raise errors.UserError(str(exc)) from exc
    for warning in specs.idle_fields(job.data):
        print(f"warning: {path}: {warning}", file=sys.stderr)
    return job


# -- plan ----------------------------------------------------------------------


def plan(add_parser: AddParser, name: str) -> None:
    cli.require_extra(EXTRA, "yaml")
    p = add_parser(name, help="show valid replica counts, splits per rank and steps per epoch")
    p.add_argument("-f", "--file", required=True, help=MANIFEST_HELP)
    p.add_argument("--replicas", type=int, help="plan for this many replicas instead")
    p.add_argument("--read-table", action="store_true",
                   help="also open the table to count rows and steps per epoch (needs storage access)")
    p.add_argument("--storage-options-dir", type=Path,
                   help="with --read-table: one storage option per file (the credentials the job names)")
    p.add_argument("--offline", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    """Everything the manifest alone decides; the table only when asked (--read-table)."""
    if args.read_table:
        cli.require_extra(EXTRA, *SERVING)
    job = parse_job_file(args.file, args.replicas)
    for line in _layout_lines(job) + _preprocessing_lines(job.data):
        print(line)
    if not args.read_table:
        print(f"table {job.data.table} at {job.data.uri}: not read (add --read-table for rows and steps per epoch)")
        return 0
    _print_table_plan(job, args.storage_options_dir)
    return 0


def _layout_lines(job: specs.JobSpec) -> list[str]:
    """The world, its valid sizes, and each rank's splits and batch: topology math alone."""
    w, data = job.world_size, job.data
    dp, shape = data.groups.size(w), geometry.Geometry.of(job.data)
    ranks = "rank" if dp == w else "data-parallel rank"
    lines = [
        f"job {job.name}: {job.replicas} replicas x {job.gpus_per_replica} GPUs = world size {w}",
        f"valid replica counts: {job.allowed_replicas()}",
    ]
    if dp != w:
        lines.append(f"ranksPerBatch {data.ranks_per_batch} (pipelineStages {data.pipeline_stages}): "
                     f"{dp} data-parallel ranks, each batch taken by {data.ranks_per_batch} ranks")
    lines += [
        f"numSplits {data.num_splits}, numWorkers {data.num_workers}: "
        f"{data.num_splits // dp} splits per {ranks}, "
        f"{data.num_splits // (dp * data.num_workers)} per worker",
        f"batch: {data.global_batch_size} rows per global step, "
        f"{shape.rank_batch_size(dp)} per {ranks}, {shape.rows_per_split_per_step} per split",
    ]
    for rank in range(w):
        d = data.groups.rank(rank, w)
        splits = shape.rank_splits(d, dp)
        lines.append(f"  rank {rank}: splits {splits.start}..{splits.stop - 1}"
                     + (f" (data-parallel rank {d})" if dp != w else ""))
    return lines


def _preprocessing_lines(data: specs.DataSpec) -> list[str]:
    """The transform, its threads and the sequence packing, as the manifest sets them (none: no lines)."""
    lines = []
    if data.transform:
        lines.append(f"transform {data.transform} with {data.transform_kwargs or 'no arguments'}, "
                     f"onTransformError {data.on_transform_error}")
    if data.transform or data.pack_sequences is not None:
        threads = (f"{data.transform_parallelism}" if data.transform_parallelism is not None
                   else f"the sidecar's CPUs / {data.num_workers} (default)")
        lines.append(f"transform threads per loader process: {threads}; queue depth "
                     f"{data.transform_queue_depth} read batches per split")
    pack = data.pack_sequences
    if pack is not None:
        lines.append(f"packing {pack.column!r} into blocks of {pack.block_size} tokens (eos {pack.eos_id}, "
                     f"pad {pack.pad_id}), {pack.blocks_per_epoch} blocks per epoch; a global step is "
                     f"{data.global_batch_size} blocks")
    return lines


def _print_table_plan(job: specs.JobSpec, storage_options_dir: Path | None) -> None:
    """What only the table says (rows, steps, read cost, packed blocks), printed as each is learnt."""
    from . import main
    from .data import reading, streaming

    data = job.data
    options = plan_storage_options(data.uri, main.read_storage_options(storage_options_dir))
    if data.transform:
        from .data import preprocessing

        preprocessing.load_transform(data)  # a UserError (exit 2, one line) if it does not import
        print(f"transform {data.transform}: imports here")
    table = reading.open_table(data, options)
    layout = reading.job_layout(table, data)
    print(f"table {data.table}: {layout.rows} rows{' after filter' if data.filter else ''}, "
          f"{layout.split_size} per split, {layout.steps_per_epoch} steps per epoch, "
          f"{layout.steps_per_epoch * data.epochs} steps in {data.epochs} epoch(s)")
    if reading.reads_plans(data):
        from .table import plans

        columns, row_bytes = reading.sample_row_bytes(table, data)
        cost = plans.cost(layout.rows, data.num_splits, data.groups.size(job.world_size), data.shuffle_clump_size,
                          columns, row_bytes)
        for line in _read_cost_lines(cost, data.shuffle_clump_size):
            print(line)
    pack = data.pack_sequences
    if pack is not None:
        print(f"packing: {streaming.blocks_per_epoch(table, data)} blocks per epoch"
              f"{' (auto: estimated by lancedb from epoch 0, fixed for the job)' if pack.blocks_per_epoch == 'auto' else ''}")


def _read_cost_lines(cost: plans.Cost, shuffle_clump_size: int) -> list[str]:
    """A plan's size and an epoch's reads (plans.cost), as `plan` says them."""
    return [
        f"plan: {_size(cost.plan_bytes)} per epoch (8 B a row), built once by replica 0's sidecar; "
        f"each rank holds {_size(cost.rank_ids_bytes)} of row ids (twice that as an epoch ends)",
        f"reads: ~{cost.requests:,} requests and ~{_size(cost.read_bytes)} per epoch "
        + (f"(shuffleClumpSize {shuffle_clump_size}: one request per clump per column)"
           if shuffle_clump_size > 1 else
           "(rows shuffled one by one: one request per row per column; shuffleClumpSize "
           "N reads N neighbouring rows at once)"),
    ]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def plan_storage_options(uri: str, named: dict[str, str]) -> dict[str, str]:
    """Only the credentials the job names: with none, S3 requests go unsigned.

    Without this the object store's default credential chain goes looking on
    its own (environment, profile files, the cloud's metadata service), which a
    planning command on a laptop has no business doing.
    """
    if uri.startswith("s3://") and not any("key" in k.lower() or "token" in k.lower() for k in named):
        return {**named, "aws_skip_signature": "true"}
    return named


# -- sidecar -------------------------------------------------------------------


def sidecar(add_parser: AddParser, name: str) -> None:
    cli.require_extra(EXTRA, *SERVING)
    p = add_parser(name, help="run the loader sidecar of one pod (ranks from the environment)")
    p.add_argument("--config", required=True, type=Path, help="job data config (JSON)")
    p.add_argument("--socket-dir", type=Path, help="default: $SPLITFEED_SOCKET_DIR")
    p.add_argument("--podinfo-dir", type=Path, help="downward-API volume with annotations")
    p.add_argument("--storage-options-dir", type=Path, help=STORAGE_OPTIONS_HELP)
    p.add_argument("--termination-log", type=Path, help="where to write the exit report")
    p.add_argument("--resume", choices=wellknown.RESUMES,
                   help=f"default: ${wellknown.RESUME_ENV} or {wellknown.RESUME_LATEST}")
    p.set_defaults(func=_sidecar)


def _sidecar(args: argparse.Namespace) -> int:
    from . import main

    settings = main.settings_from_env(
        config=args.config, socket_dir=args.socket_dir, podinfo_dir=args.podinfo_dir,
        storage_options_dir=args.storage_options_dir, termination_log=args.termination_log,
        resume=args.resume)
    return main.run(settings)


# -- local ---------------------------------------------------------------------
