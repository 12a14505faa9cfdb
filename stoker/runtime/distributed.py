"""Distributed setup from the torchrun environment, with a single-process fallback."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job.

    Attributes:
        rank: global rank, 0..world_size-1 (``RANK``).
        local_rank: rank on this node (``LOCAL_RANK``); selects the GPU.
        world_size: number of processes (``WORLD_SIZE``).
        device: ``cuda:<local_rank>`` when GPUs are visible, else ``cpu``.
        backend: ``nccl`` on GPU, ``gloo`` on CPU; None without a process group.
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def init_distributed(timeout_s: float | None = None) -> DistEnv:
    """Join the process group described by torchrun's variables, or run as one process.

    Args:
        timeout_s: how long a collective may wait for a peer, s (``train.hang``'s
            ``collective_timeout_s``); None: torch's default (30 minutes for gloo).

    Reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (and ``MASTER_ADDR``/``MASTER_PORT`` through
    the ``env://`` init method). CUDA + NCCL when GPUs are visible, CPU + gloo otherwise.
    """
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if "RANK" not in os.environ:  # plain `python -m stoker.runtime`: one process, no group
        return DistEnv(0, 0, 1, device, None)
    dist.init_process_group(
        backend=backend, device_id=device if backend == "nccl" else None,
        timeout=None if timeout_s is None else datetime.timedelta(seconds=timeout_s),
    )
    return DistEnv(rank, local_rank, world_size, device, backend)


def teardown() -> None:
    """Destroy the process group if one exists (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum ``values`` (any shape, float) over all ranks in place; a no-op on one process."""
    if env.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def barrier(env: DistEnv) -> None:
    """Wait for every rank; every rank must call it (never inside a rank-0-only branch)."""
    if env.distributed:
        if env.backend == "nccl":
            dist.barrier(device_ids=[env.local_rank])
        else:
            dist.barrier()


def broadcast_from_main(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Overwrite ``values`` (on ``env.device``) with rank 0's, in place; a no-op on one process."""
    if env.distributed:
        dist.broadcast(values, src=0)
    return values


def all_reduce_min(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Element-wise minimum over all ranks, in place; a no-op on one process."""
    if env.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
    return values
