"""A trainer process for data-plane tests: logs the ids of every batch it gets.

    python trainer_script.py LOG [--pause-after N] [--checkpoint-at S] [--save-at S] [--fail-at S]
                                 [--compute-s T] [--stall-out PATH] [--stop-after N [--stop-rank R]]
                                 [--no-close]

It prints "resume N" (client.resume_step) first. `--save-at S` checkpoints and
commits after S global steps and goes on, as a periodic save would.

Each line of LOG is {"step": global_step, "ids": [...]}, flushed before the
next batch is asked for, so a test that kills this process knows exactly
which batches it received.
"""

import argparse
import json
import os
import sys
import time

from splitfeed.trainer_client.script.client import StreamClient


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("log")
    parser.add_argument("--pause-after", type=int, help="stop asking for batches after N of them")
    parser.add_argument("--checkpoint-at", type=int, help="checkpoint when S global steps are done, then exit")
    parser.add_argument("--fail-at", type=int, help="raise at global step S")
    parser.add_argument("--save-at", type=int, help="checkpoint + commit when S global steps are done")
    parser.add_argument("--die-after-checkpoint", type=int,
                        help="checkpoint when S global steps are done, then die before saving a model")
    parser.add_argument("--compute-s", type=float, default=0.0, help="sleep this long per batch (a model step)")
    parser.add_argument("--stall-out", help="write client.stats.stall (JSON) here at the end")
    parser.add_argument("--stop-after", type=int, help="return after N batches, as a max_steps loop does")
    parser.add_argument("--stop-rank", type=int, help="only this rank stops (--stop-after); the others pause")
    parser.add_argument("--no-close", action="store_true", help="return without client.close()")
    args = parser.parse_args()
    client = StreamClient(timeout_s=60)
    print(f"resume {client.resume_step}", flush=True)
    with open(args.log, "a") as log:
        received = 0
        for batch in client:
            if batch.global_step == args.fail_at:
                raise RuntimeError(f"trainer failed on purpose at step {batch.global_step}")
            log.write(json.dumps({"step": batch.global_step, "ids": batch["id"].tolist()}) + "\n")
            log.flush()
            received += 1
            if args.compute_s:
                time.sleep(args.compute_s)
            if args.save_at is not None and batch.global_step + 1 == args.save_at:
                client.commit(client.checkpoint())
            if args.die_after_checkpoint is not None and batch.global_step + 1 == args.die_after_checkpoint:
                client.checkpoint()
                os._exit(1)  # killed between checkpoint() and the model save
            if args.checkpoint_at is not None and batch.global_step + 1 == args.checkpoint_at:
                client.checkpoint()
                break
            if client.checkpoint_requested:
                client.checkpoint()
                if client.drained:
                    break
            if received == args.stop_after:
                if args.stop_rank is None or args.stop_rank == client.rank:
                    break
                args.pause_after = received  # a DDP peer: waits in a collective for ever
            if received == args.pause_after:
                print("paused", flush=True)
                while True:
                    time.sleep(1)
    if args.stall_out:
        stall = client.stats.stall
        with open(args.stall_out, "w") as out:
            json.dump({"share": stall.stall_share, "p50_s": stall.p50_s, "p95_s": stall.p95_s,
                       "p99_s": stall.p99_s, "batches": stall.batches}, out)
    if not args.no_close:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
