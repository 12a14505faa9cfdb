"""Issue 44, point 1: a checkpoint is loaded data-only, so a pickle payload planted in a shared
checkpoint folder (with a matching sha256 record) is refused by name and never run."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pytest
import torch
from test_checkpoint_recovery import committed, folder, run, starts

from stoker.runtime.checkpoint import MARKER, Checkpointer
from stoker.runtime.safe_load import UnsafeCheckpointError


class Payload:
    """Pickles as a call to os.system that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(step_dir: Path, name: str, marker: Path, legacy: bool = False) -> None:
    """Replace ``name`` by a payload and record its digest in the marker, as an attacker with
    write access to the shared folder would (``legacy``: in torch's pre-zip format). The digest
    is sha256, which a reader still accepts (checkpoints written before xxh3-128): the attacker
    picks it, and the loader refuses the payload all the same."""
    buffer = io.BytesIO()
    torch.save({"model": Payload(marker)}, buffer, _use_new_zipfile_serialization=not legacy)
    (step_dir / name).write_bytes(buffer.getvalue())
    record = json.loads((step_dir / MARKER).read_text())
    record["hash"] = "sha256"
    record["files"] = {n: hashlib.sha256((step_dir / n).read_bytes()).hexdigest()
                       for n in record["files"]}
    (step_dir / MARKER).write_text(json.dumps(record))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip-format", "legacy-format"])
def test_a_planted_pickle_is_refused_by_name_and_never_run(tmp_path, legacy):
    """Plain: load_latest refuses the newest step (naming the file and posix.system) instead of
    falling back to an older one, and the payload's marker file is never created; in torch's
    legacy format too (trial: moved aside as corrupt, and the job fell back to step 23)."""
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(str(root), 0, 1)
    for step in (1, 2):
        ckpt.save(step, {"step": step, "model": {"w": torch.ones(2)}}, {"rng": {}})
        ckpt.wait()
    marker = tmp_path / "pwned"
    plant(root / "step-000000002", "shared.pt", marker, legacy=legacy)
    with pytest.raises(UnsafeCheckpointError) as refused:
        Checkpointer(str(root), 0, 1).load_latest()
    assert "step-000000002/shared.pt" in str(refused.value)
    assert "posix.system" in str(refused.value)
    assert not marker.exists()
    assert Checkpointer(str(root), 0, 1).committed_steps() == [1, 2]  # nothing moved aside


@pytest.mark.integration
def test_the_job_stops_with_exit_2_on_a_planted_pickle_and_does_not_restart(make_spec, tmp_path):
    """Real torchrun (2 gloo ranks): a payload planted in rank 1's file of the newest step stops
    every rank with exit 2 naming the file; no step is skipped, nothing restarts from step 0."""
    spec = make_spec("planted", epochs=2, checkpoint_every_steps=5, keep_latest_k=3)
    code, output = run(spec, stop_after=7)
    assert code == 75, output[-3000:]
    steps = committed(spec)
    marker = tmp_path / "pwned"
    plant(folder(spec, steps[-1]), "rank-00001.pt", marker)
    before = starts(spec)

    code, output = run(spec, timeout_s=180)
    assert code == 2, output[-3000:]
    assert f"{folder(spec, steps[-1])}/rank-00001.pt: refused" in output
    assert "posix.system" in output
    assert not marker.exists()
    assert starts(spec) == before  # no attempt started, from step 0 or any other
    assert committed(spec) == steps
