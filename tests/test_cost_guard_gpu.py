"""The NVML reader on real hardware: skipped (with the reason) where there is no GPU or driver."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from stoker.costguard.config import CostGuardConfig
from stoker.costguard.decide import Verdict
from stoker.costguard.nvml import MIB, NvmlReader

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pynvml():
    module = pytest.importorskip("pynvml", reason="nvidia-ml-py not installed")
    try:
        module.nvmlInit()
        count = module.nvmlDeviceGetCount()
        module.nvmlShutdown()
    except module.NVMLError as e:
        pytest.skip(f"no NVML on this machine: {e}")
    if count == 0:
        pytest.skip("NVML lists no GPU")
    return module


def test_reads_real_gpus(pynvml):
    with NvmlReader(pynvml) as reader:
        snapshot = reader.snapshot()
    assert snapshot.error is None, snapshot.error
    assert snapshot.gpus
    for gpu in snapshot.gpus:
        assert gpu.name and gpu.uuid and gpu.uuid.startswith(("GPU-", "MIG-")), gpu
        assert gpu.memory_total_bytes and 0 <= gpu.memory_used_bytes <= gpu.memory_total_bytes
        assert gpu.processes is not None, gpu.error
        if gpu.mig_index is None:  # utilization is unsupported on MIG devices
            assert gpu.error is None, gpu.error
            assert 0 <= gpu.utilization_percent <= 100
    smi = shutil.which("nvidia-smi")
    if smi:  # the same totals as the driver's own tool (MiB)
        out = subprocess.run([smi, "--query-gpu=uuid,memory.total", "--format=csv,noheader,"
                              "nounits"], capture_output=True, text=True, check=True).stdout
        totals = {u.strip(): int(m) for u, m in (line.split(",") for line in out.splitlines())}
        for gpu in snapshot.gpus:
            if gpu.mig_index is None and gpu.uuid in totals:
                assert abs(gpu.memory_total_bytes / MIB - totals[gpu.uuid]) <= 1


def test_a_process_holding_gpu_memory_is_seen_and_not_idle(pynvml, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here: cannot put load on the GPU")
    from stoker.costguard.sweep import run_sweep

    held = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda:0")  # 2 GiB
    torch.cuda.synchronize()
    config = CostGuardConfig(work_dir=tmp_path, policy={
        "window_s": 1, "sample_interval_s": 0.5, "min_samples": 3})
    with NvmlReader(pynvml) as reader:
        ours = [g.key for g in reader.snapshot().gpus
                if any(p.pid == os.getpid() for p in g.processes or ())]
        if not ours:
            pytest.skip("NVML does not list this process (PID namespace other than the host's)")
        report = run_sweep(config, reader, lambda: ([], []), {})
    (row,) = [g for g in report.gpus if g.id == ours[0]]
    assert row.decision.signals["max_memory_mib"] >= 2048
    if row.decision.verdict == Verdict.UNKNOWN:  # only foreign, invisible processes may do that
        assert all("cannot be resolved" in r for r in row.decision.reasons), row.decision
    else:
        assert row.decision.verdict == Verdict.BUSY, row.decision
    del held
