"""Where a rank's time goes: opt-in torch.profiler traces, FLOPs per step, achieved TFLOP/s, MFU.

Mixed into :class:`stoker.runtime.trainer.Trainer`, whose attributes (``cfg``, ``env``, ``spec``,
``module``, ``tracker``, ``timings``, ``step``) it reads. Peak figures are the vendors' dense
datasheet values.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import torch

from stoker.runtime import private

# Dense peak TFLOP/s per GPU from the vendors' datasheets (no sparsity), by precision.
PEAK_TFLOPS = {"H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
               "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
               "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
               "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}}


def peak_tflops(gpu_model: str, precision: str) -> float | None:
    """Datasheet dense peak for ``gpu_model`` (an NVML/CUDA name) at ``precision``, or None."""
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment in gpu_model:
            return peaks[precision]
    return None


def forward_flops(module: torch.nn.Module, x: torch.Tensor) -> float:
    """FLOPs of ``module(x)`` in its convolution and linear layers (2 per multiply-add).

    Forward hooks read each layer's input and output shapes, with the formulas torch's
    ``FlopCounterMode`` uses; that mode would cost ~1 CPU-s per process the first time (it
    imports torch._dynamo), which no rank should spend before a step. Matrix products written
    as functions rather than layers (a custom attention) are not counted: a lower bound then.
    """
    from torch.utils.flop_counter import conv_flop_count

    total = 0

    def count(layer: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        nonlocal total
        if isinstance(layer, torch.nn.Linear):
            total += 2 * output.numel() * layer.in_features
        else:  # ConvNd / ConvTransposeNd
            transposed = isinstance(layer, torch.nn.modules.conv._ConvTransposeNd)
            total += conv_flop_count(list(inputs[0].shape), list(layer.weight.shape),
                                     list(output.shape), transposed)

    kinds = (torch.nn.Linear, torch.nn.modules.conv._ConvNd)
    hooks = [m.register_forward_hook(count) for m in module.modules() if isinstance(m, kinds)]
    try:
        module(x)
    finally:
        for hook in hooks:
            hook.remove()
    return float(total)


class ProfilingMixin:
    """Profiler, FLOP count and the attempt's time/memory/throughput summary."""

    _step_flops: float | None = None
    _cpu_started = 0.0  # time.process_time() when the attempt's loop started
    _tracking_cpu_started = 0.0  # the tracking threads' CPU seconds then

    def _profiler(self):
        """An opt-in torch.profiler for ``profile_steps`` steps after 5 warm-up steps."""
        if not self.cfg.profile_steps:
            return None
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if self.env.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        profiler = profile(activities=activities, record_shapes=True,
                           schedule=schedule(wait=0, warmup=5, active=self.cfg.profile_steps,
                                             repeat=1),
                           on_trace_ready=self._save_trace)
        profiler.start()
        return profiler

    def _profiler_step(self, profiler):
        profiler.step()
        if profiler.step_num >= 5 + self.cfg.profile_steps:
            profiler.stop()
            return None
        return profiler

    def _save_trace(self, profiler) -> None:
        """Write this rank's Chrome/Perfetto trace to ``<job_dir>/profile/``; rank 0 logs the
        folder to MLflow once written."""
        folder = private.make_dir(Path(self.spec.job_dir) / "profile")
        path = folder / f"trace-rank{self.env.rank}-step{self.step}.json"
        profiler.export_chrome_trace(str(path))
        private.narrow_file(path)
        if self.tracker is not None:
            self.tracker.log_artifact(str(path), "profile")

    def _measure_flops(self, micro) -> None:
        """Estimate FLOPs per optimizer step on this rank for achieved TFLOP/s and MFU.

        Counts one forward pass (:func:`forward_flops`) and takes 3x (backward costs about twice
        the forward), times micro-batches per step. The pass runs in eval mode without
        gradients, so it touches no BatchNorm statistic, RNG state or DDP hook (exactness holds).
        """
        x, _y = micro[0]
        self.module.eval()
        try:
            with torch.no_grad(), self._autocast():
                flops = forward_flops(self.module, self._to_device(x))
        finally:
            self.module.train()
        self._step_flops = 3.0 * flops * self.cfg.grad_accum_steps

    def profile(self, wall_s: float, steps_run: int) -> dict[str, float]:
        """Where this attempt's time went (seconds, rank 0's view), peak memory and throughput.

        ``sync_s`` is the wait for the agreement collective (one for about 0.1 s of steps,
        read a step after it started; it absorbs waiting for slower ranks), ``agreements`` how
        many there were; gradient all-reduce overlaps backward in DDP and is counted inside
        ``forward_backward_s``.
        """
        out: dict[str, float] = {f"{k}_s": round(v, 4) for k, v in self.timings.items()}
        out["wall_s"] = round(wall_s, 4)
        # CPU seconds of this process (all its threads: tracking, data, checkpoint) over the
        # same span: what rank 0's extra duties cost shows here, not in wall time alone.
        out["process_cpu_s"] = round(time.process_time() - self._cpu_started, 4)
        if self.tracker is not None:  # of which the MLflow threads' (tracking worker, system
            # metrics monitor), over the same span
            out["tracking_cpu_s"] = round(self.tracker.cpu_s() - self._tracking_cpu_started, 4)
        out["steps"] = steps_run
        out["agreements"] = getattr(self, "agreements", 0)
        out["samples_per_s"] = round(steps_run * self.cfg.global_batch_size / max(wall_s, 1e-9),
                                     2)
        busy_s = self.timings["forward_backward"] + self.timings["optimizer"]
        if self._step_flops and busy_s > 0:
            tflops = self._step_flops * steps_run / busy_s / 1e12
            out["achieved_tflops_per_device"] = round(tflops, 4)
            peak = peak_tflops(self.gpu_model(), self.cfg.precision)
            if peak:
                out["mfu"] = round(tflops / peak, 4)
        if self.env.device.type == "cuda":
            out["peak_device_memory_bytes"] = torch.cuda.max_memory_allocated(self.env.device)
        else:
            out["peak_host_memory_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss \
                * 1024
        return out
