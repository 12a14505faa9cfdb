"""Baseline for bench_trainer_throughput: a minimal hand-written DDP loop under torchrun.

The pattern of PyTorch's torchrun DDP tutorial: join the process group from torchrun's
environment, wrap the model in DDP, shard the data with a DistributedSampler, loop over epochs
and batches (zero_grad, forward, loss, backward, step). Same model (SmallCNN), same tensors (the
ImageFolder split by seed 0), same global batch, AdamW with the same one-cycle schedule as
Stoker's defaults; no evaluation, no checkpoint, no logging.

Rank 0 times the steps after ``--first-step`` with ``time.perf_counter`` and writes
``{"steps", "seconds", "samples_per_s"}`` to ``--out``.

    torchrun --nproc-per-node 2 benchmarks/baseline_ddp_loop.py DATA_DIR --epochs 30 --out r.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from stoker.runtime.data import image_folder  # noqa: E402
from stoker.runtime.models import SmallCNN  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data_dir")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--first-step", type=int, required=True,
                   help="time the steps after this one (start-up excluded)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    splits = image_folder(args.data_dir, seed=0, val_fraction=0.2)
    torch.manual_seed(0)
    model = DDP(SmallCNN(splits.num_classes, splits.input_shape[0]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr,
                                  weight_decay=args.weight_decay)
    sampler = DistributedSampler(splits.train, seed=0)
    loader = DataLoader(splits.train, batch_size=args.global_batch_size // world_size,
                        sampler=sampler, drop_last=True)
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=total_steps)
    step, started = 0, None
    try:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                scheduler.step()
                step += 1
                if step == args.first_step:
                    started = time.perf_counter()
        if started is None:
            raise SystemExit(f"--first-step {args.first_step} not reached ({step} steps)")
        seconds = time.perf_counter() - started
        if rank == 0:
            steps = step - args.first_step
            args.out.write_text(json.dumps({
                "steps": steps, "seconds": seconds,
                "samples_per_s": steps * args.global_batch_size / seconds}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
