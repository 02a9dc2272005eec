"""A torchtitan-style trainer on a (dp, tp) device mesh with a torch.distributed.checkpoint of the
model and the data, as the README's "Model parallelism" section writes it.

    python mesh_trainer.py LOG_DIR WORK_DIR    (the models are saved under WORK_DIR/models)

The job sets spec.data.ranksPerBatch to the tensor-parallel degree (2). The model is an MLP split
over the tp pair by torch's tensor parallelism (DTensor, column- then row-wise), so its checkpoint
is a sharded DCP checkpoint that reloads on any dp size; gradients are averaged over the dp group.
Each rank logs the ids it trained and its mesh coordinates.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from splitfeed.trainer_client import StreamClient

TP = 2
HIDDEN = 8


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(4, HIDDEN), torch.nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def build(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Megatron's column/row split of the MLP over the tp ranks, as torchtitan applies it."""
    model = parallelize_module(MLP(), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def features(batch: Any) -> torch.Tensor:
    ids = batch["id"].to(torch.float32)
    return torch.stack([ids, ids % 7, ids % 3, torch.ones_like(ids)], dim=1) / 100.0


def model_sum(model: torch.nn.Module) -> float:
    """The whole model's parameters summed (a collective over the tp pair)."""
    return float(sum(p.full_tensor().sum() if isinstance(p, DTensor) else p.sum() for p in model.parameters()))


def train_step(model: torch.nn.Module, batch: Any, mesh: Any, optimizer: torch.optim.Optimizer) -> None:
    before = model_sum(model)
    loss = (model(features(batch)).squeeze(1) - 1.0).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():  # data-parallel gradient average, shard by shard
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        assert grad is not None
        dist.all_reduce(grad, group=mesh["dp"].get_group())
        grad /= mesh["dp"].size()
    optimizer.step()
    RECORD(globalStep=batch.global_step, ids=batch["id"].tolist(), loss=float(loss), before=before,
           meshDp=mesh["dp"].get_local_rank(), tp=mesh["tp"].get_local_rank(), dpSize=mesh["dp"].size())


def RECORD(**fields: Any) -> None:  # replaced in main() by the rank's log writer
    raise AssertionError("no log")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("work_dir", type=Path)
    args = parser.parse_args()
    world, rank = os.environ["SPLITFEED_WORLD_EPOCH"], os.environ["RANK"]
    log = open(args.log_dir / f"w{world}-r{rank}.jsonl", "a")

    def record(**fields: Any) -> None:
        log.write(json.dumps({**fields, "t": time.time()}) + "\n")
        log.flush()

    global RECORD
    RECORD = record
    os.chdir(args.work_dir)

    # README, "Model parallelism", as written there:
    client = StreamClient()  # the job's spec.data.ranksPerBatch is the tp degree, 2
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (client.dp_size, 2), mesh_dim_names=("dp", "tp"))
    model, optimizer = build(mesh)  # the model's layers split over the tp pair
    if client.resume_step:  # model and data of the same step, on any dp size; loads in place
        state = {"model": model.state_dict(), "data": client.data_state()}
        dcp.load(state, checkpoint_id=f"models/{client.resume_step}")
    for batch in client:
        train_step(model, batch, mesh, optimizer)  # tp peers got the same rows
        if client.checkpoint_requested:
            step = client.checkpoint()
            dcp.save({"model": model.state_dict(), "data": client.data_state()}, checkpoint_id=f"models/{step}")
            client.commit(step)
            if client.drained:
                break
    # (README ends.)
    record(event="exit", dpRank=client.dp_rank, dpSize=client.dp_size, meshDp=mesh["dp"].get_local_rank(),
           resumeStep=client.resume_step, after=model_sum(model))
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
