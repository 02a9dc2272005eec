"""A process that holds none of a job's secrets and forges every message its coordinator takes.

NOT product code: tests/streaming/test_local_forged.py runs it beside a `splitfeed local` job.
It finds the world's coordinator where a member sidecar writes its address for its trainers
(trainer_client.stranded's coordinator.json; in a cluster any pod resolves the job's headless
Service), and, until it is stopped, sends each coordinator message type three ways:

- `none`: a plain DEALER, no CURVE;
- `own`: a CURVE client that knows the job's public key (no secret: it may leak) and uses a
  keypair of its own;
- `other`: another job's whole keypair.

Every well-formed message it can make is one that would change the job were it accepted: a
drain to one replica, a lost member, a stand-in record and commit marker, a member joining,
answers to a freeze, a committed drain step, progress and reach that move the watermark.

Usage: forger.py WORK_GLOB OUT_JSON. It writes OUT_JSON (sent, answered, addresses) after
every frame; `answered` must stay 0.
"""

from __future__ import annotations

import glob
import json
import signal
import sys
import time
from pathlib import Path

import zmq

from splitfeed.trainer_client.contract import wellknown, messages, stalls

WAIT_MS = 20
"""How long each forged request waits for an answer (a coordinator answers in well under that)."""


def forged(world_epoch: int) -> list[messages.Message]:
    """Every message type the coordinator takes (CoordinatorThread._handle), made to do harm."""
    return [
        messages.DrainRequest(token=f"forged-w{world_epoch}", reason="rescale", replicas=1),
        messages.DrainRequest(token=f"forged-lost-w{world_epoch}", reason="replace", replicas=1, lost=[1]),
        messages.Join(replica=1, instance="forged", published=10_000, drain_step=3, drain_reason="rescale",
                      next_replicas=1),
        messages.Frozen(round=1, replica=1, published=10_000),
        messages.Reach(replica=1, reports=[1, 10_000, 0]),
        messages.CommittedWorld(replica=1, step=3),
        messages.Progress(replica=1, global_step=10_000, steps_per_epoch=1, rows=1, rows_per_s=1, wait_s=0,
                          wall_s=1, buckets=[0] * stalls.NUM_BUCKETS, filled_rows=0, skipped_rows=0),
        messages.StatusRequest(),
        messages.StandIn(rank=1, world_size=2, world_epoch=world_epoch, step=3),
        messages.StandIn(rank=1, world_size=2, world_epoch=world_epoch, step=3, commit=True),
    ]


def coordinators(work_glob: str) -> dict[str, int]:
    """Every coordinator address a member wrote, with its world epoch."""
    found: dict[str, int] = {}
    for path in glob.glob(f"{work_glob}/*/{'coordinator.json'}"):
        try:
            record = json.loads(Path(path).read_text())
            found[str(record["address"])] = int(record["worldEpoch"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced
    return found


def public_key(work_glob: str) -> bytes | None:
    """The job's public key, which a forger may learn (it is not what proves the job)."""
    for path in glob.glob(f"{work_glob}/keys/{wellknown.KEY_PUBLIC}"):
        return Path(path).read_bytes().strip()
    return None


def ask(ctx: zmq.Context, address: str, frame: bytes, mode: str, server_key: bytes | None) -> bool:  # type: ignore[type-arg]
    """Send one forged frame; whether anything came back."""
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if mode == "own" and server_key is not None:
            sock.curve_serverkey = server_key
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        elif mode == "other":
            public, secret = zmq.curve_keypair()
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = public, public, secret
        sock.connect(address)
        sock.send(frame, zmq.NOBLOCK)
        return bool(sock.poll(WAIT_MS))
    finally:
        sock.close(linger=0)


def main(work_glob: str, out: Path) -> int:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    ctx = zmq.Context()
    sent = answered = 0
    seen: set[str] = set()
    kinds = [(index, mode) for index in range(len(forged(0))) for mode in ("none", "own", "other")]
    while not stop:
        # The addresses are looked up again before every forged frame, not once a pass: a world
        # that lives a few seconds (the last one of a short run) is found within one frame's wait.
        for index, mode in kinds:
            key = public_key(work_glob)
            for address, epoch in coordinators(work_glob).items():
                seen.add(address)
                sent += 1
                answered += ask(ctx, address, forged(epoch)[index].encode(), mode, key)
            tmp = out.with_suffix(".tmp")  # after every frame: the test reads it once the job ends
            tmp.write_text(json.dumps({"sent": sent, "answered": answered, "addresses": sorted(seen)}))
            tmp.replace(out)
            if stop:
                break
        time.sleep(0.05)
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
