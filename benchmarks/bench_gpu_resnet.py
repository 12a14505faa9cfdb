"""GPU: ResNet-50 training images/s (bf16, channels-last, synthetic data) and scaling efficiency.

Skipped, with the reason, when CUDA is not available or torchvision is not installed.

* Candidate: Stoker's runtime under torchrun, one process per GPU: ``train.model=resnet50``,
  ``precision=bf16``, ``channels_last=true``, ``deterministic=false`` (cuDNN autotuning, TF32),
  ``async_checkpoint=true`` (a committed checkpoint every 50 steps, written in the background),
  DataLoader workers, on ``benchmarks.synthetic:imagenet_like`` (random 3x224x224 images held in
  host memory: the runtime's own data path, without files). Images/s from the progress events,
  after the first epoch, evaluation excluded. Run on 1 GPU and, when there are more, on all.
* Baseline: ``benchmarks/baseline_gpu_loop.py`` on 1 GPU: the same model, optimizer,
  precision and memory format with one batch resident on the GPU (no data loading, no
  checkpoints, no per-step synchronisation): what a bare loop reaches on this device.

Ratio = Stoker 1-GPU images/s / bare loop images/s (the issue sets no target for it).
Scaling efficiency = N-GPU images/s / (N x 1-GPU images/s), reported when N > 1.

    python benchmarks/bench_gpu_resnet.py [--quick] [--repeats N] [--batch-size 256]

``--allow-cpu`` runs the same measurement on the CPU (development only; use ``--model
small_cnn --image-size 32``): the figures mean nothing there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    PYTHON,
    Sized,
    Workdir,
    alternate,
    compared,
    emit,
    log,
    options,
    run_timed,
    summary,
)
from benchmarks.jobs import run_runtime, steady_window, write_spec  # noqa: E402
from benchmarks.synthetic import write_config  # noqa: E402

TIMEOUT_S = 1800
NUM_CLASSES = 1000


def skip_reason(args) -> str | None:
    if not torch.cuda.is_available() and not args.allow_cpu:
        return "CUDA is not available (torch.cuda.is_available() is False)"
    if args.model.startswith("resnet") and importlib.util.find_spec("torchvision") is None:
        return f"train.model {args.model} needs torchvision, which is not installed"
    return None


def main() -> None:
    args = options(__doc__, 3,
                   Sized("--batch-size", int, 256, 32, "images per GPU per step"),
                   Sized("--steps-per-epoch", int, 60, 10,
                         "steps per epoch; 2 epochs run, the second is timed"),
                   extra=lambda p: (
                       p.add_argument("--model", default="resnet50"),
                       p.add_argument("--image-size", type=int, default=224),
                       p.add_argument("--allow-cpu", action="store_true",
                                      help="development: run on the CPU")))
    reason = skip_reason(args)
    if reason:
        emit("gpu_resnet", metric="Stoker images/s / bare loop images/s (1 GPU)",
             quick=args.quick, status="skipped", reason=reason)
        return
    batch, steps_per_epoch = args.batch_size, args.steps_per_epoch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 1
    workers = 0 if not torch.cuda.is_available() else max(2, min(6, os.cpu_count() // gpus - 1))
    with Workdir(args.workdir, "bench-gpu") as work:
        data = {n: write_config(work / f"data-{n}", train_samples=batch * n * steps_per_epoch,
                                val_samples=batch * n, image_size=args.image_size,
                                num_classes=NUM_CLASSES) for n in {1, gpus}}

        def stoker(i: int, nproc: int) -> float:
            job = work / f"stoker-{nproc}gpu-{i}"
            spec = write_spec(job, str(data[nproc]), model=args.model,
                              dataset="benchmarks.synthetic:imagenet_like", precision="bf16",
                              channels_last=True, deterministic=False, async_checkpoint=True,
                              global_batch_size=batch * nproc, epochs=2, num_workers=workers,
                              nproc_per_node=nproc)
            run_runtime(spec, nproc, work / f"{job.name}.log", TIMEOUT_S)
            return steady_window(job, steps_per_epoch).samples_per_s(batch * nproc)

        def bare(i: int) -> float:
            out = work / f"bare-{i}.json"
            run_timed([PYTHON, str(ROOT / "benchmarks/baseline_gpu_loop.py"),
                       f"--model={args.model}", f"--batch-size={batch}",
                       f"--image-size={args.image_size}", f"--num-classes={NUM_CLASSES}",
                       f"--steps={steps_per_epoch}", f"--out={out}"],
                      work / f"bare-{i}.log", TIMEOUT_S)
            return json.loads(out.read_text())["images_per_s"]

        log(f"{gpus} GPU(s), {batch} images per GPU per step, {steps_per_epoch} steps timed")
        pairs = alternate(bare, lambda i: stoker(i, 1), args.repeats, args.warmups)
        multi = [stoker(i, gpus) for i in range(args.repeats)] if gpus > 1 else []

    result = compared(pairs, lambda b, c: c / b, "none set (reported)",
                      "bare loop, 1 GPU, batch resident", "Stoker, 1 GPU", "images/s")
    c = result["candidate"]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    notes = [f"{device} x {gpus}; {args.model}, bf16 autocast, channels-last, batch {batch} "
             f"per GPU, {args.image_size}x{args.image_size} synthetic images; DataLoader "
             f"workers per rank: {workers}",
             "Stoker pays what the bare loop does not: collating each batch on the host and "
             "copying it to the GPU, one small all-reduce with a host sync per step, progress "
             "events, and a checkpoint every 50 steps (host copy blocking, write in the "
             "background)"]
    details = {"gpus": gpus, "device": device, "batch_per_gpu": batch,
               "steps_timed": steps_per_epoch}
    if multi:
        m = summary(multi, "images/s", f"Stoker, {gpus} GPUs")
        efficiency = m["median"] / (gpus * c["median"])
        details |= {"multi_gpu": m, "scaling_efficiency": round(efficiency, 4)}
        notes.append(f"{gpus} GPUs: {m['median']:.0f} images/s, scaling efficiency "
                     f"{efficiency:.3f} (N-GPU images/s / (N x 1-GPU images/s))")
    else:
        notes.append("one GPU present: no scaling efficiency to measure")
    emit("gpu_resnet", metric="Stoker images/s / bare loop images/s (1 GPU)", **result,
         quick=args.quick, notes=notes, details=details)


if __name__ == "__main__":
    main()
