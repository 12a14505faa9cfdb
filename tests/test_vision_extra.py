"""resnet* models need torchvision (the ``vision`` extra): without it, one line before any work."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return False
    return True


def test_resnet_without_torchvision_stops_the_run_before_the_pull(tmp_path):
    """torchvision is not installed on this machine: the run ends with exit 2 and one line
    naming the model and the extra; nothing is pulled, no job folder, no process started."""
    if _torchvision_imports():
        pytest.skip("torchvision imports here: the error path cannot be reached")
    work = tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "stoker.cli", "run", f"work_dir={work}",
                           "train.model=resnet18"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.model 'resnet18' needs torchvision" in lines[0]
    assert "stoker[vision]" in lines[0]
    assert not (work / "datasets").exists() and not (work / "jobs").exists()


def test_a_torchvision_built_for_another_torch_is_named(tmp_path, monkeypatch):
    """The CUDA torchvision wheel beside a CPU torch fails at import with a RuntimeError (a
    stand-in package raises the same): named as missing torchvision, not a traceback."""
    from stoker.runtime.models import ModelError, build_model, vision_problem

    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    problem = vision_problem("resnet50")
    assert problem and "operator torchvision::nms does not exist" in problem
    assert "'resnet50'" in problem and "vision extra" in problem and "\n" not in problem
    with pytest.raises(ModelError, match="train.model 'resnet50' needs torchvision"):
        build_model("resnet50", 10, 3)
    assert vision_problem("small_cnn") is None and vision_problem("mod:fn") is None
