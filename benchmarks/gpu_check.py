"""The Python steps of ``benchmarks/gpu_check.sh``: CUDA/NCCL sanity, NVML readings, one
preempt-and-resume, and the summary. Each step prints its result as one JSON line, last.

    python benchmarks/gpu_check.py sanity [--cpu]      # CUDA, bf16 matmul, NCCL all_reduce
    python benchmarks/gpu_check.py nvml [--cpu]        # as the cost guard and MLflow read it
    python benchmarks/gpu_check.py preempt [--cpu]     # SIGTERM mid-run, resume, on CUDA
    python benchmarks/gpu_check.py summarize STEPS_DIR RESULTS.json

``--cpu`` runs a step without CUDA (gloo, no load, the CPU) so that the script can be checked
on a machine without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TORCHRUN_TIMEOUT_S = 120


def emit(step: str, status: str, **fields: Any) -> None:
    """Print one step's result as the last JSON line."""
    print(json.dumps({"step": step, "status": status, **fields}, default=str), flush=True)


def sanity(cpu: bool) -> None:
    """CUDA present, a bf16 matrix product's TFLOP/s, and an all_reduce under torchrun (NCCL on
    as many GPUs as there are, up to 2: NCCL cannot put two ranks on one GPU)."""
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available()}
    if not cpu:
        if not torch.cuda.is_available():
            return emit("sanity", "failed", reason="torch.cuda.is_available() is False", **info)
        props = torch.cuda.get_device_properties(0)
        info |= {"device": props.name, "capability": f"{props.major}.{props.minor}",
                 "memory_gib": round(props.total_memory / 2**30, 1),
                 "devices": torch.cuda.device_count(), "nccl": torch.cuda.nccl.version(),
                 "bf16_matmul_tflops": round(matmul_tflops(torch), 1)}
    world = 1 if cpu else min(2, torch.cuda.device_count())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
           f"--nproc-per-node={world}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
           __file__, "allreduce", *(["--cpu"] if cpu else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                          timeout=TORCHRUN_TIMEOUT_S)
    info["all_reduce"] = last_json(proc.stdout) or {"exit": proc.returncode,
                                                    "tail": proc.stderr[-1500:]}
    ok = proc.returncode == 0 and info["all_reduce"].get("correct") is True
    emit("sanity", "ok" if ok else "failed", **info)


def matmul_tflops(torch, n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12


def allreduce(cpu: bool) -> None:
    """One rank of the all_reduce check (run under torchrun)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cpu:
        device, backend = torch.device("cpu"), "gloo"
    else:
        device, backend = torch.device("cuda", int(os.environ["LOCAL_RANK"])), "nccl"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    try:
        x = torch.full((1 << 20,), float(rank + 1), device=device)
        started = time.perf_counter()
        dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        expected = world * (world + 1) / 2
        if rank == 0:
            print(json.dumps({"backend": backend, "world_size": world,
                              "correct": bool(torch.all(x == expected)),
                              "first_all_reduce_s": round(elapsed, 4)}), flush=True)
    finally:
        dist.destroy_process_group()


def nvml(cpu: bool) -> None:
    """NVML before and under load: the cost guard's reader, and MLflow's GPU system metrics."""
    from stoker.costguard.nvml import NvmlReader, load_nvml

    binding = load_nvml()
    load = None if cpu else GpuLoad()
    with NvmlReader(binding) as reader:
        idle = reader.snapshot()
        if load:
            load.start()
            time.sleep(2.0)  # NVML's utilization is averaged over its last sample period
        busy = reader.snapshot()
        mlflow = mlflow_gpu_metrics(binding)
    if load:
        load.stop()
    usable = idle.error is None and bool(idle.gpus) and all(g.error is None for g in busy.gpus)
    emit("nvml", "ok" if usable else "unavailable",
         reason=None if usable else (idle.error or "no GPU readings"),
         guard_idle=[reading(g) for g in idle.gpus],
         guard_under_load=[reading(g) for g in busy.gpus], mlflow_system_metrics=mlflow,
         load_matmuls=load.count if load else 0)


def reading(g) -> dict[str, Any]:
    return {"key": g.key, "name": g.name, "utilization_percent": g.utilization_percent,
            "memory_used_mib": g.memory_used_mib, "processes": None if g.processes is None
            else [{"pid": p.pid, "used_memory_bytes": p.used_memory_bytes}
                  for p in g.processes], "error": g.error}


def mlflow_gpu_metrics(binding) -> dict[str, Any]:
    """What MLflow's system metrics would log: its GPUMonitor when MLflow is installed, else
    the same NVML calls (memory, utilization, power against the enforced limit)."""
    try:
        from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor
    except ImportError:
        GPUMonitor = None  # a class, or its absence
    if isinstance(binding, str):
        return {"source": "none", "error": binding}
    try:
        if GPUMonitor is not None:
            monitor = GPUMonitor()
            for _ in range(3):
                monitor.collect_metrics()
                time.sleep(0.2)
            return {"source": "mlflow GPUMonitor", "metrics": monitor.aggregate_metrics()}
        binding.nvmlInit()
        out = {}
        for i in range(binding.nvmlDeviceGetCount()):
            handle = binding.nvmlDeviceGetHandleByIndex(i)
            memory = binding.nvmlDeviceGetMemoryInfo(handle)
            power_mw = binding.nvmlDeviceGetPowerUsage(handle)
            limit_mw = binding.nvmlDeviceGetEnforcedPowerLimit(handle)
            out |= {f"gpu_{i}_memory_usage_percentage": round(memory.used / memory.total * 100, 1),
                    f"gpu_{i}_memory_usage_megabytes": memory.used / 1e6,
                    f"gpu_{i}_utilization_percentage":
                        binding.nvmlDeviceGetUtilizationRates(handle).gpu,
                    f"gpu_{i}_power_usage_watts": power_mw / 1000,
                    f"gpu_{i}_power_usage_percentage": power_mw / limit_mw * 100}
        binding.nvmlShutdown()
        return {"source": "NVML calls of MLflow's GPUMonitor (MLflow not installed)",
                "metrics": out}
    except Exception as e:  # any NVML or MLflow failure is a reading here, not a crash
        return {"source": "failed", "error": f"{type(e).__name__}: {e}"}


class GpuLoad(threading.Thread):
    """bf16 matrix products on GPU 0 until stopped (so utilization and power read non-zero)."""

    def __init__(self):
        super().__init__(daemon=True, name="gpu-load")
        self.halt, self.count = threading.Event(), 0

    def run(self) -> None:
        import torch

        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        while not self.halt.is_set():
            a @ a
            torch.cuda.synchronize()
            self.count += 1

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=10)


def preempt(cpu: bool, workdir: Path | None) -> None:
    """One job on CUDA (synthetic 32x32 images, small CNN, bf16, 2 epochs of 40 steps), SIGTERM
    at step 20, resumed by the retry loop; with ``cpu``, a smaller job on the CPU."""
    import importlib.util

    import torch

    from benchmarks.bench_recovery import trial
    from benchmarks.synthetic import write_config

    if not cpu and not torch.cuda.is_available():
        return emit("preempt", "failed", reason="torch.cuda.is_available() is False")
    with tempfile.TemporaryDirectory(prefix="stoker-gpu-preempt-") as tmp:
        work = (workdir or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        steps, at_step = (16, 8) if cpu else (40, 20)  # per epoch; the CPU job is smaller
        data = write_config(work / "data", train_samples=64 * steps, val_samples=256,
                            image_size=32, num_classes=10)
        tracking = importlib.util.find_spec("mlflow") is not None
        result = trial(work, str(data), 0, epochs=2, at_step=at_step, nproc=1, tracking=tracking,
                       dataset="benchmarks.synthetic:imagenet_like", global_batch_size=64,
                       **({} if cpu else {"precision": "bf16", "channels_last": True}))
    ok = result["steps_lost"] <= 0
    emit("preempt", "ok" if ok else "failed", device="cpu" if cpu else "cuda",
         tracking="mlflow sqlite" if tracking else "off (MLflow not installed)", **result)


def summarize(steps_dir: Path, output: Path) -> int:
    """Gather every ``<step>.out`` / ``<step>.rc`` / ``<step>.s`` in ``steps_dir`` into one
    results file and print a table; returns the number of steps that did not end ok."""
    steps: dict[str, Any] = {}
    for rc_file in sorted(steps_dir.glob("*.rc"), key=lambda p: p.stat().st_mtime):
        name = rc_file.stem
        out = (steps_dir / f"{name}.out").read_text(errors="replace") \
            if (steps_dir / f"{name}.out").exists() else ""
        rc = int(rc_file.read_text().strip() or -1)
        result = last_json(out)
        status = (result or {}).get("status", "ok" if rc == 0 else "failed")
        if rc != 0 and status in ("ok", "skipped"):
            status = "failed"
        steps[name] = {"status": "timed out" if rc == 124 else status, "exit": rc,
                       "seconds": float((steps_dir / f"{name}.s").read_text() or 0)
                       if (steps_dir / f"{name}.s").exists() else None,
                       "result": result, "tail": out.splitlines()[-40:]}
    output.write_text(json.dumps({"written": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                           time.gmtime()),
                                  "steps": steps}, indent=2, default=str) + "\n")
    print(f"\n{'step':<12} {'status':<12} {'exit':>4} {'s':>6}  figure")
    for name, s in steps.items():
        print(f"{name:<12} {s['status']:<12} {s['exit']:>4} {s['seconds'] or 0:>6.0f}  "
              f"{headline(name, s['result'])}")
    print(f"results: {output}")
    return sum(s["status"] not in ("ok", "skipped") for s in steps.values())


def headline(name: str, result: dict | None) -> str:
    """The one figure of a step worth a glance."""
    if not result:
        return "-"
    if result.get("benchmark"):
        pairs = result.get("pairs") or {}
        return (f"per-pair ratio {pairs.get('median')} [{pairs.get('min')}–{pairs.get('max')}], "
                f"verdict {result.get('verdict')}" if pairs else str(result.get("reason")))
    if name == "sanity":
        reduce = result.get("all_reduce") or {}
        device = result.get("device") or "no CUDA"
        matmul = result.get("bf16_matmul_tflops")
        return (f"{device}{f', {matmul} TFLOP/s bf16' if matmul else ''}, all_reduce "
                f"{reduce.get('backend')} x{reduce.get('world_size')}: "
                f"{'correct' if reduce.get('correct') else 'FAILED'}")
    if name == "preempt":
        return (f"recovery {result.get('recovery_s', 0):.2f} s, steps lost "
                f"{result.get('steps_lost')}")
    return str(result.get("reason") or "")


def last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.strip().startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("sanity", "allreduce", "nvml", "preempt", "summarize"))
    p.add_argument("paths", nargs="*", type=Path, help="summarize: STEPS_DIR RESULTS.json")
    p.add_argument("--cpu", action="store_true", help="without CUDA (checking the script)")
    p.add_argument("--workdir", type=Path, default=None, help="preempt: keep the job here")
    args = p.parse_args()
    if args.step == "summarize":
        if len(args.paths) != 2:
            p.error("summarize needs STEPS_DIR and RESULTS.json")
        sys.exit(1 if summarize(*args.paths) else 0)
    steps = {"sanity": lambda: sanity(args.cpu), "allreduce": lambda: allreduce(args.cpu),
             "nvml": lambda: nvml(args.cpu), "preempt": lambda: preempt(args.cpu, args.workdir)}
    steps[args.step]()


if __name__ == "__main__":
    main()
