"""Checkpoint stall: Stoker's asynchronous save versus a synchronous torch.save of the same state.

The state is a stack of square Linear layers with AdamW state after one step (model + two moment
buffers: about 3x the parameters' bytes; >= 100 MB at full size), on the GPU when there is one
(``--device``), as in training. The candidate is
``Checkpointer(async_save=True).save``; its figure is the time the training loop is blocked
(``last_blocking_s``: a host copy and a thread start). The baseline is ``torch.save`` of the same
state to a file in the same folder, which blocks for the whole serialization and write. Each
async save is waited for (outside the timed part) before the next measurement, so the disk is
idle at the start of every timed call. Target: blocked / synchronous <= 0.2 with the state on
the CPU, <= 0.05 with it on a GPU.

    python benchmarks/bench_checkpoint.py [--quick] [--repeats N] [--size-mb 150] [--device cpu]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    Sized,
    Target,
    Workdir,
    alternate,
    check,
    compared,
    emit,
    log,
    options,
    summary,
)
from stoker.runtime.checkpoint import Checkpointer  # noqa: E402

CPU_TARGET = Target("<=", 0.2)  # issue 17: only overlap gets there on a CPU
GPU_TARGET = Target("<=", 0.05)  # pinned, reused host buffers, a side stream


def make_state(size_mb: float, device: str = "cpu") -> tuple[dict, int]:
    """Model + AdamW state of about ``size_mb`` MB (fp32) on ``device``; returns (state, bytes
    of tensors)."""
    width = 1024
    layer_bytes = 3 * (width * width + width) * 4  # weights + bias, and AdamW's two moments
    layers = max(1, round(size_mb * 1e6 / layer_bytes))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width, device=device)).square().mean().backward()
    optimizer.step()  # creates the moment buffers
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}
    size = sum(t.numel() * t.element_size() for t in _tensors(state))
    return state, size


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors(value)


def main() -> None:
    args = options(__doc__, 7, Sized("--size-mb", float, 150.0, 4.0, "checkpoint size in MB"),
                   extra=lambda p: p.add_argument(
                       "--device", default="cuda" if torch.cuda.is_available() else "cpu",
                       help="where the state lives, as in training (default: cuda if "
                            "available)"))
    state, size_bytes = make_state(args.size_mb, args.device)
    log(f"state: {size_bytes / 1e6:.1f} MB of tensors on {args.device}")

    with Workdir(args.workdir, "bench-checkpoint") as work:
        ckpt = Checkpointer(str(work / "async"), rank=0, world_size=1, keep_latest_k=1,
                            async_save=True)
        sync_dir = work / "sync"
        sync_dir.mkdir(exist_ok=True)
        full_async_s: list[float] = []
        durable_s: list[float] = []

        def baseline(i: int) -> float:
            path = sync_dir / f"state-{i}.pt"
            started = time.perf_counter()
            torch.save(state, path)
            elapsed = time.perf_counter() - started
            with open(path, "rb+") as f:  # for the notes only: what durability adds
                os.fsync(f.fileno())
            if i >= 0:
                durable_s.append(time.perf_counter() - started)
            path.unlink()
            return elapsed

        def candidate(i: int) -> float:
            started = time.perf_counter()
            ckpt.save(i + 2, state, {"rng": torch.get_rng_state()})
            blocking_s = ckpt.last_blocking_s
            ckpt.wait()  # not part of the stall: the loop would go on training meanwhile
            if i >= 0:
                full_async_s.append(time.perf_counter() - started)
            return blocking_s

        # the warm-up pair pays the page cache, the allocator and the first thread
        pairs = alternate(baseline, candidate, args.repeats, args.warmups)

    target = CPU_TARGET if args.device == "cpu" else GPU_TARGET
    result = compared(pairs, lambda b, c: c / b, target, "torch.save (synchronous)",
                      "Stoker async blocking", "s")
    b, c = result["baseline"], result["candidate"]
    mb = size_bytes / 1e6
    async_total = summary(full_async_s, "s", "async save, total")
    durable = summary(durable_s, "s", "torch.save + fsync")
    notes = [f"state: {mb:.1f} MB of tensors on {args.device} (Linear stack + AdamW moments)",
             f"the loop is blocked for the host copy of the state: {mb / c['median']:.0f} MB/s "
             f"here, against {mb / b['median']:.0f} MB/s for torch.save into the page cache "
             "(the baseline does not fsync, as plain torch.save does not)",
             f"torch.save followed by fsync (durable) takes {durable['median']:.3f} s; Stoker's "
             f"whole async save (write, fsync, sha256, commit marker, in the background) "
             f"{async_total['median']:.3f} s"]
    if args.device == "cpu":
        notes.append("with the state in host memory the blocking step is a memory-to-memory "
                     "copy of every byte the deferred write would move; here it ran at "
                     f"{b['median'] / c['median']:.2f}x the rate of torch.save into the page "
                     "cache, while a ratio of 0.2 needs 5x. With GPU state the copy is a "
                     "device-to-host transfer instead")
    emit("checkpoint", metric="async blocking time / synchronous torch.save time",
         quick=args.quick, notes=notes, **result,
         checks=[] if args.quick else [check("state size", [mb], "MB", Target(">=", 100),
                                             statistic="max")],
         details={"size_bytes": size_bytes, "device": args.device,
                  "async_total_s": async_total, "durable_torch_save_s": durable})


if __name__ == "__main__":
    main()
