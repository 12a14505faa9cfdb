"""Recovery from damaged checkpoint folders and from a lost job lease, under real torchrun
(2 gloo ranks on CPU): ranks agree on one step, retention keeps what resumes, no silent restart
from zero, and a runtime whose orchestrator is gone stops with a checkpoint."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import events
from mlflow import MlflowClient

from stoker.launch.local import LocalLauncher
from stoker.runtime import digest
from stoker.runtime.checkpoint import MARKER, Checkpointer
from stoker.runtime.spec import RunSpec

pytestmark = pytest.mark.integration


def preempt_after(launcher: LocalLauncher, job_dir: Path, steps: int) -> None:
    """SIGTERM the launcher's tree once the attempt it runs has reported ``steps`` steps."""
    before = sum(e["event"] == "start" for e in events(job_dir))

    def this_attempt_steps() -> int:
        found, seen = 0, 0
        for event in events(job_dir):
            seen += event["event"] == "start"
            found += seen > before and event["event"] == "step"
        return found

    def watch() -> None:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and this_attempt_steps() < steps:
            time.sleep(0.005)
        process = launcher.process
        for proc in [psutil.Process(process.pid), *psutil.Process(process.pid).children()]:
            proc.send_signal(signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()


def run(spec: Path, stop_after: int | None = None, timeout_s: float = 240) -> tuple[int, str]:
    """One attempt with 2 ranks; SIGTERM to the tree after ``stop_after`` steps of it."""
    launcher = LocalLauncher(2, shutdown_grace_s=20, python=sys.executable)
    if stop_after is not None:
        preempt_after(launcher, spec.parent, stop_after)
    lines: list[str] = []
    code = launcher.run(spec, on_line=lines.append, timeout_s=timeout_s)
    return code, "\n".join(lines)


def respec(spec: Path, **train) -> None:
    """Change train fields of an existing spec (as a rerun with other settings would)."""
    values = yaml.safe_load(spec.read_text())
    values["train"].update(train)
    RunSpec.model_validate(values).dump(spec)


def folder(spec: Path, step: int) -> Path:
    return spec.parent / "checkpoints" / f"step-{step:09d}"


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def committed(spec: Path) -> list[int]:
    return Checkpointer(str(spec.parent / "checkpoints"), 0, 2).committed_steps()


def starts(spec: Path) -> list[int]:
    return [e["step"] for e in events(spec.parent) if e["event"] == "start"]


def test_all_ranks_resume_from_the_step_rank0_chose(make_spec):
    """Input 1(c): a committed checkpoint only rank 1 cannot load (its file, hash and all, is
    garbage) must not put the ranks on different steps: all resume from the previous one."""
    # 2 epochs (44 steps): the stop lands within ~0.1 s of steps (the ranks agree on it once for
    # several fast steps), well before the end.
    spec = make_spec("agree", epochs=2, checkpoint_every_steps=5, keep_latest_k=3)
    code, output = run(spec, stop_after=7)
    assert code == 75, output[-3000:]
    *_, previous, newest = committed(spec)
    shard = folder(spec, newest) / "rank-00001.pt"
    shard.write_bytes(b"not a checkpoint")
    marker = json.loads((folder(spec, newest) / MARKER).read_text())
    marker["files"]["rank-00001.pt"] = digest.of(b"not a checkpoint", marker["hash"])
    (folder(spec, newest) / MARKER).write_text(json.dumps(marker))

    code, output = run(spec, timeout_s=180)
    assert code == 0, output[-3000:]
    assert starts(spec)[-1] == previous  # rank 0 (which could read it) did not take it either
    assert f"resumed from {folder(spec, previous)}" in output
    assert list((spec.parent / "checkpoints").glob(f"corrupt-step-{newest:09d}-*"))


def test_retention_never_deletes_the_checkpoint_that_resumes(make_spec):
    """Input 4: committed-but-corrupt folders above the resume point, then keep_latest_k=1:
    the next commits keep the newest verified checkpoint, and the next run resumes from it."""
    spec = make_spec("retention", epochs=2, checkpoint_every_steps=4, keep_latest_k=3)
    code, output = run(spec, stop_after=9)
    assert code == 75, output[-3000:]
    steps = committed(spec)
    assert len(steps) == 3 and steps[0] % 4 == 0  # the oldest kept: a periodic one
    resume = steps[0]
    for step in steps[1:]:  # the two newest: a flipped byte in shared.pt
        flip_byte(folder(spec, step) / "shared.pt")
    respec(spec, keep_latest_k=1)
    code, output = run(spec, stop_after=1)  # stop (and commit) right after resuming
    assert code == 75, output[-3000:]
    assert starts(spec)[-1] == resume
    stopped = [e for e in events(spec.parent) if e["event"] == "end"][-1]["step"]
    assert committed(spec) == [stopped] and stopped > resume
    assert len(list((spec.parent / "checkpoints").glob("corrupt-step-*"))) == 2
    code, output = run(spec)
    assert code == 0, output[-3000:]
    assert starts(spec)[-1] == stopped  # not step 0
    steps = [e["step"] for e in events(spec.parent) if e["event"] == "step" and not e.get("rerun")]
    assert steps == list(range(1, 45))  # re-run steps are marked: one unmarked line per step


def test_no_usable_checkpoint_refuses_or_restarts_loudly(make_spec):
    """Input 5: every committed checkpoint corrupt. ``refuse``: exit 2 naming each folder,
    nothing moved. ``restart`` (default): a loud warning naming each folder and a run tag."""
    spec = make_spec("nothing", epochs=2, checkpoint_every_steps=4, keep_latest_k=2)
    code, output = run(spec, stop_after=5)
    assert code == 75, output[-3000:]
    steps = committed(spec)
    for step in steps:
        flip_byte(folder(spec, step) / "shared.pt")
    respec(spec, on_no_usable_checkpoint="refuse")
    code, output = run(spec)
    assert code == 2, output[-3000:]
    assert "train.on_no_usable_checkpoint=refuse" in output
    assert all(str(folder(spec, s)) in output for s in steps)
    assert committed(spec) == steps  # nothing moved or deleted

    respec(spec, on_no_usable_checkpoint="restart")
    code, output = run(spec)
    assert code == 0, output[-3000:]
    warning = next(line for line in output.splitlines()  # not in capitals (trial)
                   if "no usable checkpoint: restarting this job from step 0; skipped" in line)
    assert all(f"{folder(spec, s)}: checkpoint" in warning for s in steps)
    assert starts(spec)[-1] == 0
    loaded = RunSpec.load(spec)
    run_id = (spec.parent / "mlflow_run_id").read_text()
    tags = MlflowClient(loaded.tracking_uri).get_run(run_id).data.tags
    assert tags["stoker.restarted_from_step_0"] == "true"
    assert all(f"step-{s:09d}" in tags["stoker.checkpoints_skipped"] for s in steps)


def test_runtime_stops_with_a_checkpoint_when_the_lease_is_lost(make_spec):
    """Input 1(b): the orchestrator owning the job stops renewing its lease (it died): the
    training processes commit a checkpoint and exit 75 instead of training on as orphans."""
    from stoker.jobs.lease import JobLease

    spec = make_spec("orphan", epochs=20)
    lease = JobLease(spec.parent, ttl_s=3).acquire()
    values = yaml.safe_load(spec.read_text())
    RunSpec.model_validate({**values, "lease_token": lease.token}).dump(spec)
    result: dict = {}

    def train() -> None:
        result["code"], result["output"] = run(spec)

    thread = threading.Thread(target=train)
    thread.start()
    try:
        deadline = time.monotonic() + 240
        while not any(e["event"] == "step" for e in events(spec.parent)):
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        lease._stop.set()  # the owner's renewals stop, as when its process is SIGKILLed
    finally:
        thread.join(timeout=200)
    assert result["code"] == 75, result["output"][-3000:]
    assert "lease lost: the job lease expired" in result["output"]
    end = [e for e in events(spec.parent) if e["event"] == "end"][-1]
    assert end["outcome"] == "preempted" and end["step"] < 20 * 22
    assert (folder(spec, end["step"]) / MARKER).exists()


def test_a_full_disk_at_a_save_is_one_line_and_exit_74_leaving_no_temporary_files(make_spec):
    """Trial input: checkpoints on a disk that fills up. The ranks end the attempt with exit 74
    (EX_IOERR: it was exit 1 with two tracebacks, the second torch's 'unexpected pos', then
    exit 2, which read as bad input) and one line naming the folder and the cause; their end
    event says `storage`, and no half-written file stays behind."""
    import subprocess

    from image_support import skip_or_fail

    spec = make_spec("full-disk", epochs=2, checkpoint_every_steps=5)
    checkpoints = spec.parent / "checkpoints"
    checkpoints.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                              str(checkpoints)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        skip_or_fail(f"cannot mount a small tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        code, output = run(spec)
        left = sorted(p.name for p in checkpoints.rglob("*") if ".tmp-" in p.name)
    finally:
        subprocess.run(["umount", "-l", str(checkpoints)], check=False)
    assert code == 74, output[-3000:]
    assert [e["outcome"] for e in events(spec.parent) if e["event"] == "end"] == ["storage"]
    # rank 0's line; rank 1's too when rank 0's shared.pt filled the disk before its own file
    lines = [x for x in output.splitlines() if "could not write it" in x]
    assert any("rank 0 could not write it" in x for x in lines), output[-3000:]
    for line in lines:
        assert "ERROR" in line and "No space left on device" in line, line
        assert "step-000000005" in line and "checkpoint_dir" in line, line
    # no traceback of the rank's (torchrun's own one, about the exit, stays in train.log)
    assert "unexpected pos" not in output and "runtime/checkpoint.py" not in output, output
    assert left == []
    assert committed(spec) == []
