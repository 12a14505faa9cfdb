"""What the orchestrator imports before training: no torch on a machine without a GPU.

``stoker run`` checked the job, the world size and the model before its flow started; those
checks imported torch and MLflow (about 5 s before the Prefect server was even reached, on
every run and before every one-line error about a bad value) for a constant, a GPU count on a
machine without GPUs, a type annotation and a torchvision check of a model that needs none.
Registration needs torch only where the ranks run in an image (rank 0 logs the model
elsewhere): it is imported in the background while training starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from stoker.config import PipelineConfig
from stoker.launch.supervisor import nproc
from stoker.runtime.launch import gpu_device_present, worker_start

PROBE = """
import json, sys
from pathlib import Path
from stoker.cli import _config
from stoker.jobs.job import check_job_early, new_job_notice
from stoker.launch.factory import check_before_pull
config = _config(None, [f"work_dir={sys.argv[1]}"])
new_job_notice(config)
check_job_early(config)
check_before_pull(config)
from stoker.cli import _user_errors
_user_errors()
print(json.dumps("mlflow" in sys.modules))
import flows.pipeline, flows.train, tasks.data, tasks.train, tasks.registry
from stoker.data.validate import validate_image_folder
from stoker.data.prepare import prepare_dataset
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchvision"))))
"""


def test_the_checks_before_the_flow_and_the_flow_modules_import_no_torch(tmp_path):
    if gpu_device_present():
        import pytest

        pytest.skip("this machine has a GPU device file: the world size is torch's GPU count")
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "work")],
                         capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    lines = out.strip().splitlines()
    assert json.loads(lines[-2]) is False  # MLflow neither: the checks fail fast on bad input
    assert json.loads(lines[-1]) == []


def test_gpu_device_files_decide_without_a_driver(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    assert not gpu_device_present(dev) and worker_start({}, dev) == "fork"
    assert nproc(PipelineConfig(), dev) == 2  # no device file: no GPU, torch not asked
    for name in ("nvidia0", "kfd", "dxg"):  # NVIDIA, AMD, WSL2
        (dev / name).touch()
        assert gpu_device_present(dev) and worker_start({}, dev) == "exec", name
        (dev / name).unlink()
    (dev / "nvidiactl").touch()  # the control node alone is no device
    assert not gpu_device_present(dev)


def test_with_a_device_file_the_world_size_is_torchs_gpu_count(tmp_path):
    import torch

    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").touch()
    assert nproc(PipelineConfig(), dev) == (torch.cuda.device_count() or 2)
    assert nproc(PipelineConfig(train={"nproc_per_node": 3, "global_batch_size": 48}), dev) == 3


def test_registration_imports_load_in_the_background_at_the_lowest_priority():
    """The imports run while the ranks train: at nice 19 (that thread only) they take what CPU
    the ranks leave, not the ranks' own; the rest of the process keeps its priority."""
    probe = ("import importlib, os, sys, threading\n"
             "from stoker.tracking import registry\n"
             "seen = []\n"
             "real = importlib.import_module\n"
             "def spy(name, *a, **k):\n"
             "    seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))\n"
             "    return real(name, *a, **k)\n"
             "importlib.import_module = spy\n"
             "t = registry.warm_up_registration(); t.join(120)\n"
             "print(all(m in sys.modules for m in registry.REGISTRATION_IMPORTS), t.name,\n"
             "      sorted(set(seen)), os.getpriority(os.PRIO_PROCESS, 0))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent).stdout.split()
    assert out == ["True", "stoker-warm-up-registration", "[19]", str(os.getpriority(
        os.PRIO_PROCESS, 0))]
