"""One trainer per job, on real processes: `stoker run` (Prefect, DVC, torchrun, MLflow sqlite)
started again while the job runs, after its training, after it is done, after its
orchestrator was killed; torn record files left by a crash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from stoker.runtime.progress import read_events

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def api_env():
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}


def command(work: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "stoker.cli", "run", f"work_dir={work}",
            "tracking.system_metrics_interval_s=null", *overrides]


def start(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def wait_for(condition, timeout_s: float = 240, process: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        if process is not None and process.poll() is not None:
            raise AssertionError(f"process ended ({process.returncode}): "
                                 f"{process.stdout.read()[-3000:]}")
        time.sleep(0.01)
    raise AssertionError("timed out waiting")


def attempt_history(job: Path) -> list[dict]:
    from stoker.jobs.attempts import AttemptLog

    return AttemptLog(job).history()


def stepped(job: Path, at_least: int = 1) -> bool:
    return any(e.get("event") == "step" and e["step"] >= at_least for e in read_events(job))


def test_a_second_run_is_refused_at_once_until_the_job_is_done(api_env, tmp_path):
    """Inputs 2 and 3: a concurrent run is refused in one line before anything is written, also
    between training and registration; a run of the done job says so and does nothing."""
    work, job = tmp_path / "work", tmp_path / "work" / "jobs" / "owned"
    cmd = command(work, "job_id=owned", "train.epochs=2")
    first = start(cmd, api_env)
    try:
        wait_for(lambda: stepped(job), process=first)
        spec = (job / "spec.yaml").read_bytes()
        started = time.monotonic()
        second = subprocess.run(cmd, env=api_env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 4, second.stdout[-2000:] + second.stderr[-2000:]
        assert time.monotonic() - started < 30  # before any pull or flow start
        assert second.stderr.strip().count("\n") == 0 and "Traceback" not in second.stderr
        assert "job owned is being trained by host" in second.stderr and f"pid {first.pid}" \
            in second.stderr
        assert (job / "spec.yaml").read_bytes() == spec  # the running job is untouched

        # Training over, registration running: the job is still owned.
        wait_for(lambda: (job / "result.json").exists(), process=first)
        os.kill(first.pid, signal.SIGSTOP)
        try:
            assert not (job / "pipeline_done.json").exists()
            third = subprocess.run(cmd, env=api_env, capture_output=True, text=True, timeout=300)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert third.returncode == 4, third.stdout[-2000:] + third.stderr[-2000:]
        assert first.wait(timeout=300) == 0, first.stdout.read()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    events, attempts = read_events(job), (job / "attempts.jsonl").read_bytes()

    done = subprocess.run(cmd, env=api_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "job owned is already done; nothing to do" in done.stderr
    assert json.loads(done.stdout)["already_done"] is True
    assert read_events(job) == events and (job / "attempts.jsonl").read_bytes() == attempts
    made = attempt_history(job)
    assert [(a["number"], a["outcome"]) for a in made] == [(1, "completed")]
    assert [e["event"] for e in events].count("start") == 1
    assert not (job / "lease.json").exists()  # released when the flow ended


def test_without_job_id_a_busy_job_is_refused_before_any_flow_run(api_env, tmp_path):
    """QA: without job_id the second run of the same config and data was refused (exit 4) only
    after its flow started and pulled (~8 s), leaving a Failed flow run. For a repository on
    this machine the dataset hash is read without a pull: refused at once, no flow run."""
    from prefect.client.orchestration import get_client

    work = tmp_path / "work"
    # 20 epochs: the first run is still training when the second checks, also on a loaded
    # machine (it is interrupted at the end, so the extra epochs never train).
    cmd = command(work, "train.epochs=20")
    first = start(cmd, api_env)
    try:
        wait_for(lambda: any(stepped(job) for job in (work / "jobs").glob("*")), process=first)
        with get_client(sync_client=True) as client:
            runs_before = len(client.read_flow_runs())
        started = time.monotonic()
        second = subprocess.run(cmd, env=api_env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 4, second.stdout[-2000:] + second.stderr[-2000:]
        assert time.monotonic() - started < 30
        assert second.stderr.strip().count("\n") == 0, second.stderr
        assert "is being trained by host" in second.stderr and f"pid {first.pid}" in \
            second.stderr
        assert "Beginning flow run" not in second.stdout + second.stderr
        with get_client(sync_client=True) as client:
            assert len(client.read_flow_runs()) == runs_before  # no Failed flow run left
    finally:
        os.kill(first.pid, signal.SIGINT)
        first.wait(timeout=120)


def test_a_killed_orchestrator_is_taken_over_and_its_attempt_is_billed(api_env, tmp_path):
    """Input 7 (and an orphaned lease): SIGKILL of `stoker run` mid-training; the rerun takes
    the dead owner's lease over, closes its open attempt, and numbers, preemptions, billed
    time and cost add up over both attempts."""
    work, job = tmp_path / "work", tmp_path / "work" / "jobs" / "killed"
    cmd = command(work, "job_id=killed", "train.epochs=3")
    first = start(cmd, api_env)
    try:
        wait_for(lambda: any(e.get("event") == "checkpoint" for e in read_events(job)),
                 process=first)
        os.kill(first.pid, signal.SIGKILL)  # the orchestrator only; torchrun gets PDEATHSIG
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    wait_for(lambda: any(e.get("event") == "end" for e in read_events(job)), timeout_s=120)
    left = (job / "lease.json").read_text() if (job / "lease.json").exists() else "{}"

    rerun = subprocess.run(cmd, env=api_env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    run_id = (job / "mlflow_run_id").read_text()
    run = MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_run(run_id)
    assert run.data.tags["stoker.attempts"] == "2" and run.data.tags["stoker.preemptions"] == "0"
    history = attempt_history(job)
    assert [a["number"] for a in history] == [1, 2]
    assert history[0]["outcome"] == "interrupted" and history[0]["interrupted"]
    assert history[0]["runtime_outcome"] == "preempted"  # the ranks committed a stop checkpoint
    assert history[0]["duration_s"] > 1.0 and history[1]["outcome"] == "completed"
    # New-user trial: `stoker status` said only "interrupted after 10.7 s"; it says why and what
    # the ranks did, and train.log (whose ranks' output stopped with their run) says so too.
    stop = history[0]["runtime_end_step"]
    assert history[0]["left_open"] and history[0]["checkpoint_step"] == stop
    did = f"its ranks committed a stop checkpoint at step {stop}"
    status = subprocess.run([sys.executable, "-m", "stoker.cli", "status", "killed",
                             "--work-dir", str(work)], capture_output=True, text=True, timeout=60)
    assert f"its run's process died (no one recorded the attempt's end; the next run closed " \
        f"it); {did}" in status.stdout, status.stdout
    assert "attempt 1 closed as interrupted by this run: the run that started it died" in \
        (job / "train.log").read_text() and f"in progress.jsonl, {did}" in \
        (job / "train.log").read_text()
    billed = sum(a["duration_s"] for a in history)
    assert run.data.metrics["billed_s"] == pytest.approx(billed, abs=0.01)
    assert run.data.metrics["attempts"] == 2.0
    assert json.loads(left).get("pid") == first.pid  # the dead owner's lease was taken over
    # The dead owner's flow run does not stay Running forever: it is marked Crashed.
    from uuid import UUID

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        orphan = client.read_flow_run(UUID(json.loads(left)["flow_run_id"]))
    assert orphan.state.type.value == "CRASHED", orphan.state
    # by the next command's sweep of dead processes' runs, or by the lease takeover
    assert "taken over" in orphan.state.message or (
        f"its process (pid {first.pid}) died" in orphan.state.message), orphan.state.message


def test_a_run_stalled_past_its_lease_writes_nothing_once_another_took_the_job_over(
        api_env, tmp_path):
    """Break-it trial: `kill -STOP` of `stoker run` past its lease; its ranks stop (lease
    expired), a second run takes the job over and trains attempt 2; `kill -CONT` of the first.
    It recorded a second end of attempt 1 (steps lost read from attempt 2's progress), closed
    attempt 2 as interrupted while it trained, and ended the shared MLflow run KILLED. Now it
    exits 4 in one line and writes nothing."""
    work, job = tmp_path / "work", tmp_path / "work" / "jobs" / "stalled"
    cmd = command(work, "job_id=stalled", "train.epochs=60", "job_lease_s=6")
    first = start(cmd, api_env)
    second = None
    try:
        wait_for(lambda: stepped(job, 3), process=first)
        os.kill(first.pid, signal.SIGSTOP)
        wait_for(lambda: any(e.get("event") == "end" for e in read_events(job)), timeout_s=120)
        second = start(cmd, api_env)
        wait_for(lambda: any(e.get("event") == "step" and e.get("attempt") == 2
                             for e in read_events(job)), process=second)
        client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
        # rank 0 opens the run in the background: under load its id may follow the first steps
        wait_for(lambda: (job / "mlflow_run_id").exists(), process=second)
        run_id = (job / "mlflow_run_id").read_text()
        # KILLED by the first run's ranks as they stopped, RUNNING again once the second's open
        wait_for(lambda: client.get_run(run_id).info.status == "RUNNING", process=second)
        records = (job / "attempts.jsonl").read_text()
        os.kill(first.pid, signal.SIGCONT)
        out = first.communicate(timeout=120)[0]
        assert (job / "attempts.jsonl").read_text() == records  # nothing written since
        assert client.get_run(run_id).info.status == "RUNNING"  # the second run's, training
        assert first.returncode == 4, out[-3000:]
        assert "lease lost (taken over by" in out and "this run records nothing more" in out
        assert "Traceback" not in out, out[-3000:]
        assert second.poll() is None
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                os.kill(process.pid, signal.SIGINT)
                process.wait(timeout=120)


def test_a_job_trained_to_the_end_whose_orchestrator_died_registers_without_a_launch(
        api_env, tmp_path):
    """QA: `kill -9` of `stoker run` after the ranks finished, before registration: the rerun
    launched torchrun once more for a 0-step attempt (seconds of start-up, billed). Now it goes
    on to registration at once; the dead run's attempt is the only one, billed once."""
    work, job = tmp_path / "work", tmp_path / "work" / "jobs" / "trained"
    cmd = command(work, "job_id=trained", "train.epochs=1")
    first = start(cmd, api_env)
    try:
        wait_for(lambda: any(e.get("event") == "end" for e in read_events(job)), process=first)
        os.kill(first.pid, signal.SIGKILL)  # between the ranks' end and registration
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    assert not (job / "pipeline_done.json").exists()  # killed before the pipeline was done
    events = read_events(job)
    assert [e["event"] for e in events].count("start") == 1
    assert events[-1]["event"] == "end" and events[-1]["outcome"] == "completed"

    rerun = subprocess.run(cmd, env=api_env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "training already completed (step 22/22); going on to registration without " \
        "launching" in rerun.stdout + rerun.stderr
    assert [e["event"] for e in read_events(job)].count("start") == 1  # no torchrun again
    assert [a["number"] for a in attempt_history(job)] == [1]
    summary = json.loads(rerun.stdout)
    assert summary["registration"]["version"] == "1" and summary["cost"]["attempts"] == 1
    run_id = (job / "mlflow_run_id").read_text()
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [v.run_id for v in client.search_model_versions("name = 'stoker-digits'")] == [run_id]


def test_torn_records_after_a_crash_do_not_break_the_job(api_env, tmp_path):
    """Input 6: an unfinished job whose progress, attempts and heartbeat files were torn by a
    crash trains to the end; the torn lines stay skipped and new lines stay whole."""
    work, job = tmp_path / "work", tmp_path / "work" / "jobs" / "torn"
    job.mkdir(parents=True)
    (job / "progress.jsonl").write_text(
        json.dumps({"event": "start", "time": time.time() - 60, "step": 0, "total_steps": 22})
        + '\n{"event": "step", "time": 17')
    (job / "attempts.jsonl").write_text(
        json.dumps({"number": 1, "state": "started", "started": time.time() - 60,
                    "capacity_type": "on_demand"}) + '\n{"number": 1, "state": "en')
    (job / "heartbeat.json").write_text('{"time": 17')
    cmd = command(work, "job_id=torn", "train.epochs=1")
    run = subprocess.run(cmd, env=api_env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    warnings: list[str] = []
    from stoker.runtime.records import read_jsonl

    events = read_jsonl(job / "progress.jsonl", warn=warnings.append)
    assert len(warnings) == 1 and "line 2" in warnings[0]  # the torn line, and only it
    starts = [e for e in events if e["event"] == "start"]
    assert [s.get("attempt") for s in starts] == [None, 2]  # the first predates the field
    steps = [e["step"] for e in events if e["event"] == "step" and not e.get("rerun")]
    assert steps == list(range(1, 23))
    assert [a["number"] for a in attempt_history(job)] == [1, 2]
