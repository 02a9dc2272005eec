"""The trainer container of the end-to-end tests: a real synchronous data-parallel trainer.

    python trainer.py LOG_DIR [--sleep-s S] [--sleep-file F] [--checkpoint-every K] [--timeout-s T]
                      [--log-column C]... [--in-place] [--stop-after N [--stop-rank R [--peers-wait]]]
                      [--stop-file F] [--no-close]

The pods' `trainer` container runs this (the test kubelet runs it as a local
process). It is what a user writes: torch.distributed with gloo on CPU
(`init_process_group` from MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE, the
rendezvous going to `<job>-w<epoch>-0.<job>` through the job's headless
Service), a small model in DistributedDataParallel, a backward pass with its
gradient all-reduce every step, and the README's loop exactly:

    if client.resume_step: load the model saved for that step (rank 0 saved it)
    for batch in client:
        forward, backward (all-reduce), optimizer step
        if client.checkpoint_requested or want_to_save:    # want_to_save: every K steps
            step = client.checkpoint()                     # this rank's data position
            rank 0 saves the model for `step`              # DDP keeps the replicas identical
            client.commit(step)                            # the step may now be resumed
            if client.drained: break
    client.close()

With `--in-place`, a collective that raises (a peer's pod failed) is caught and the process
rejoins the next world (`client.rejoin(failed=True)`, README "Rescaling in place"), which
starts at the newest complete checkpoint: the model saved for it is loaded as at any start.

Most training scripts also stop at a `max_steps` (issue 21): `--stop-after N` returns after
global step N - 1 (only rank R with `--stop-rank R`: the others go on into an all-reduce that
rank R never joins, where gloo raises at once; `--peers-wait` makes them wait instead, as
NCCL's all-reduce does; `--stop-file F`: N is read from the file F each step once it exists,
an early stop decided while the job runs, as tests/soak does), and `--no-close` leaves
`client.close()` out, as many scripts do.

There is no barrier or collective of its own around checkpoints: every rank must
see `checkpoint_requested` on the same step because the sidecars agreed on it
(docs/agreement.md). If they do not, the logs below show it and
tests/support/exactness.py fails. One addition a careful user makes too: a
`client.checkpoint()` that fails (the store is unwritable) is logged; it is
retried while the world's request stands, and skipped when it was only this
trainer's periodic wish.

Models go to LOG_DIR/models/step-<step>.pt (shared by every world of the job).
A world that resumes at step S loads LOG_DIR/models/step-S.pt; if that file is
missing the trainer logs `model-missing` and exits 3: data and model disagree.

Each rank appends JSON lines to LOG_DIR/w<worldEpoch>-r<rank>.jsonl, every line
with "t" (time.time()), each flushed before the next batch is asked for:

    {"event": "start", "pid", "world", "worldSize", "rank", "resumeStep", "model": <digest> | null,
     "startup": {"imports": s, "client": s, "rendezvous": s}}
    {"event": "batch", "step": <global step>, "ids": [...], "requested": bool, "loss": float,
     "columns": {C: [...]} (only with --log-column C: a transform's output column, row by row)}
    {"event": "checkpoint", "step": <steps completed>, "drained": bool, "model": <digest>}
    {"event": "checkpoint-failed", "step": <steps completed>, "error": "..."}
    {"event": "model-missing", "step": <resume step>, "path": "..."}
    {"event": "waiting", "step": <global step>}  (--peers-wait: the collective that never completes)
    {"event": "exit", "reason": "drained" | "end" | "stopped"}

`requested` is `client.checkpoint_requested` right after the step, `model` a
digest of the parameters (equal on every rank: DDP). `--sleep-s` paces the
steps so that a test can scale mid-epoch (`--sleep-file`: the pace read every step).
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402 - STARTED is taken before the imports, which take seconds
import datetime  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401 - DDP's constructor imports it lazily (README, "In the same process")
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from splitfeed.trainer_client import CheckpointError, StreamClient, init_process_group

CLASSES = 10  # the test table's labels are id % 10


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def model_path(models: Path, step: int) -> Path:
    return models / f"step-{step:06d}.pt"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--sleep-s", type=float, default=0.0, help="pause after each step")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every K steps")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="StreamClient and collective timeout")
    parser.add_argument("--log-column", action="append", default=[], help="also log this column's values")
    parser.add_argument("--in-place", action="store_true",
                        help="follow an in-place rescale in this process (client.rejoin), as the README shows")
    parser.add_argument("--stop-after", type=int, default=None, help="return after global step N - 1")
    parser.add_argument("--stop-rank", type=int, default=None, help="only this rank returns (--stop-after)")
    parser.add_argument("--peers-wait", action="store_true",
                        help="with --stop-rank: the other ranks wait for ever after step N - 1 (NCCL)")
    parser.add_argument("--stop-file", type=Path, default=None,
                        help="return after global step N - 1 once this file holds N (read every step)")
    parser.add_argument("--sleep-file", type=Path, default=None,
                        help="the pause after each step, read from this file every step once it exists")
    parser.add_argument("--no-close", action="store_true", help="return without client.close()")
    args = parser.parse_args()
    models = args.log_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    imported = time.time()
    client = StreamClient(timeout_s=args.timeout_s)
    connected = time.time()
    if args.in_place:  # every world's group on a store of its own (README, "Rescaling in place")
        init_process_group(client.world, "gloo", timeout_s=args.timeout_s)
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    startup = {"imports": imported - STARTED, "client": connected - imported, "rendezvous": time.time() - connected}
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES))
    while True:
        try:
            code, failure = train_world(client, module, args, models, startup), None
        except RuntimeError as exc:  # gloo: a peer's connection closed (its pod is gone)
            if not args.in_place:
                raise
            code, failure = 0, exc
        if code != 0 or not args.in_place:
            break
        began = time.time()
        world = client.rejoin(timeout_s=args.timeout_s, failed=failure is not None)  # the README's in-place loop
        if world is None:
            if failure is not None:
                raise failure  # not a lost peer: this trainer's own failure
            break
        dist.destroy_process_group()
        joined = time.time()
        init_process_group(world, "gloo", timeout_s=args.timeout_s)  # a store of its own
        startup = {"rejoin": joined - began, "rendezvous": time.time() - joined}
    if not args.no_close:
        client.close()
    dist.destroy_process_group()
    return code


def train_world(client: StreamClient, module: torch.nn.Module, args: argparse.Namespace, models: Path,
                startup: dict[str, float]) -> int:
    """Train one world; its log is LOG_DIR/w<worldEpoch>-r<rank>.jsonl."""
    world, rank = int(os.environ["SPLITFEED_WORLD_EPOCH"]), int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    log = open(args.log_dir / f"w{world}-r{rank}.jsonl", "a")

    def record(**fields: Any) -> None:
        log.write(json.dumps({**fields, "t": time.time()}) + "\n")
        log.flush()

    path = model_path(models, client.resume_step) if client.resume_step else None
    in_memory = digest(module) if args.in_place and path is not None else None
    if path is not None and path.exists():
        module.load_state_dict(torch.load(path))
    loaded = digest(module) if path is not None and path.exists() else None
    record(event="start", pid=os.getpid(), world=world, worldSize=world_size, rank=rank,
           resumeStep=client.resume_step, model=loaded, startup={k: round(v, 2) for k, v in startup.items()},
           **({"kept": in_memory} if in_memory is not None else {}))
    if path is not None and loaded is None:
        record(event="model-missing", step=client.resume_step, path=str(path))
        log.close()
        return 3
    model = DistributedDataParallel(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    reason = "end"
    for batch in client:
        step = batch.global_step
        ids = batch["id"].tolist()
        logged = {"columns": {c: batch[c].tolist() for c in args.log_column}} if args.log_column else {}
        loss = torch.nn.functional.cross_entropy(model(batch["vec"].float()), batch["label"].long())
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients: every rank waits for every other
        optimizer.step()
        loss_value = loss.item()
        del batch, loss  # the graph holds the batch's tensors: free its ring slot
        requested = client.checkpoint_requested
        record(event="batch", step=step, ids=ids, requested=requested, loss=round(loss_value, 6), **logged)
        time.sleep(pause(args))
        want_to_save = args.checkpoint_every > 0 and (step + 1) % args.checkpoint_every == 0
        if requested or want_to_save:
            done = checkpoint(client, record, step + 1, args.timeout_s)
            if done is None:
                continue
            if rank == 0:
                tmp = models / f".step-{done:06d}.pt.{os.getpid()}"
                torch.save(module.state_dict(), tmp)
                os.replace(tmp, model_path(models, done))
            client.commit(done)
            record(event="checkpoint", step=done, drained=client.drained, model=digest(module))
            if client.drained:
                reason = "drained"
                break
        stop_after = stop_step(args)
        if stop_after is not None and step + 1 >= stop_after:
            if args.stop_rank in (None, rank):
                reason = "stopped"  # a max_steps loop
                break
            if args.peers_wait:
                record(event="waiting", step=step)
                while True:  # the next all-reduce, which the returned rank never joins
                    time.sleep(1)
    record(event="exit", reason=reason)
    log.close()
    return 0


def pause(args: argparse.Namespace) -> float:
    """--sleep-s, or what the --sleep-file says now (a soak speeds up its job's last steps)."""
    try:
        return float(args.sleep_file.read_text()) if args.sleep_file is not None else args.sleep_s
    except (OSError, ValueError):
        return float(args.sleep_s)


def stop_step(args: argparse.Namespace) -> int | None:
    """--stop-after, or the step the --stop-file holds now (None while it is absent or half written)."""
    if args.stop_file is None:
        return args.stop_after
    try:
        return int(args.stop_file.read_text())
    except (OSError, ValueError):
        return args.stop_after


def checkpoint(client: StreamClient, record: Any, step: int, timeout_s: float) -> int | None:
    """`client.checkpoint()`; a failure is logged, and retried while the world's request stands."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.checkpoint()
        except CheckpointError as exc:
            record(event="checkpoint-failed", step=step, error=str(exc))
            if not client.checkpoint_requested:
                return None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
