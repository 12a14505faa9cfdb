"""GPU-only code paths: NCCL, bf16/fp16 autocast with a gradient scaler, channels-last,
deterministic CUDA resume, device memory and MFU in the profile. Skipped without CUDA."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import Preemptor
from test_runtime import assert_bitwise_equal, final_weights

from stoker.config import RetryConfig
from stoker.launch.local import LocalLauncher
from stoker.launch.retry import Outcome, run_with_retries
from stoker.runtime.spec import RunSpec

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(spec, preempt_at=None):
    launcher = LocalLauncher(min(2, gpus()), shutdown_grace_s=30, python=sys.executable)
    lines: list[str] = []

    def attempt(number: int) -> int:
        if preempt_at and number == 1:
            Preemptor(launcher, spec.parent, at_step=preempt_at).start()
        return launcher.run(spec, on_line=lines.append)

    return run_with_retries(attempt, RetryConfig(backoff_s=0), sleep=lambda s: None), lines


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_nccl_mixed_precision_channels_last(make_spec, precision):
    spec = make_spec(f"gpu-{precision}", epochs=3, precision=precision, channels_last=True,
                     deterministic=False, global_batch_size=64)
    attempts, lines = launch(spec)
    assert attempts[-1].outcome is Outcome.COMPLETED, "\n".join(lines[-50:])
    import json

    result = json.loads((spec.parent / "result.json").read_text())
    assert result["metrics"]["val_accuracy"] > 0.8
    assert result["gpu_model"] != "cpu"
    assert result["profile"]["peak_device_memory_bytes"] > 0
    assert result["profile"]["achieved_tflops_per_device"] > 0
    shared = torch.load(next((spec.parent / "checkpoints").glob("step-*/shared.pt")),
                        weights_only=False)
    assert bool(shared["scaler"]) == (precision == "fp16")  # the scaler state is checkpointed


def test_deterministic_cuda_resume_is_bitwise_exact(make_spec):
    reference = make_spec("gpu-ref", epochs=3)
    attempts, lines = launch(reference)
    assert attempts[-1].outcome is Outcome.COMPLETED, "\n".join(lines[-50:])
    resumed = make_spec("gpu-resumed", epochs=3)
    attempts, lines = launch(resumed, preempt_at=20)
    assert [a.outcome for a in attempts] == [Outcome.PREEMPTED, Outcome.COMPLETED], lines[-50:]
    assert RunSpec.load(resumed).train.deterministic
    assert_bitwise_equal(final_weights(resumed), final_weights(reference))
