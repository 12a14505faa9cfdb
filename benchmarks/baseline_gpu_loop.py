"""Baseline for bench_gpu_resnet: a bare training loop on one device with the batch resident.

The same model (Stoker's ``build_model``), optimizer (AdamW, same lr and weight decay),
precision (bf16 autocast) and memory format (channels-last) as the Stoker run, cuDNN autotuning
and TF32 on; one random batch created on the device once, so no data loading at all: the upper
bound a training loop can reach on this device. Times ``--steps`` steps after ``--warmup``
with the device synchronized at both ends, and writes ``{"images_per_s", "steps", "seconds"}``
to ``--out``.

    python benchmarks/baseline_gpu_loop.py --model resnet50 --batch-size 256 --out r.json
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
import torch.nn.functional as F  # noqa: E402

from stoker.runtime.models import build_model  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = build_model(args.model, args.num_classes, 3).to(device)
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, args.num_classes, (args.batch_size,), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    sync(device)
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    seconds = time.perf_counter() - started
    args.out.write_text(json.dumps({"images_per_s": args.steps * args.batch_size / seconds,
                                    "steps": args.steps, "seconds": seconds,
                                    "device": str(device)}))


if __name__ == "__main__":
    main()
