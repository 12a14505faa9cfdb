"""Stops of a deployment run on a real process worker (real Prefect server, ``prefect worker
start --run-once``, torchrun with 2 gloo ranks, MLflow sqlite): a Prefect cancel, and the death
of the worker itself. Speed figures are in ``benchmarks/bench_cancel.py``, not asserted here."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient
from prefect_server import PrefectServer

from stoker.jobs.attempts import AttemptLog
from stoker.jobs.status import job_summary
from stoker.launch.local import terminate_tree
from stoker.runtime.progress import read_events

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_cancel import POOL, cancel_trial, deploy  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    with PrefectServer(tmp_path_factory.mktemp("prefect-worker-stops")) as server:
        deploy(server)
        yield server


def flow_run_state(server: PrefectServer, flow_run_id: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}), \
            get_client(sync_client=True) as client:
        return client.read_flow_run(uuid.UUID(flow_run_id)).state


def flow_run_logs(server: PrefectServer, flow_run_id: str) -> list[tuple[float, str]]:
    """The flow run's log lines on the server: (Unix time, message), oldest first."""
    import httpx

    found, offset = [], 0
    while True:
        page = httpx.post(f"{server.api_url}/logs/filter", timeout=30, json={
            "logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_ASC",
            "offset": offset, "limit": 200}).json()
        found += [(dt.datetime.fromisoformat(r["timestamp"]).timestamp(), r["message"])
                  for r in page]
        if len(page) < 200:
            return found
        offset += len(page)


def flow_run_name(server: PrefectServer, flow_run_id: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}), \
            get_client(sync_client=True) as client:
        return client.read_flow_run(uuid.UUID(flow_run_id)).name


def task_run_states(server: PrefectServer, flow_run_id: str) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}), \
            get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[uuid.UUID(flow_run_id)])))
    return {t.name: t.state for t in runs}


@dataclass
class Training:
    """A deployment run training on a ``--run-once`` process worker."""

    flow_run_id: str
    worker: subprocess.Popen
    flow_process: psutil.Process
    job_dir: Path

    def clean_up(self) -> None:
        terminate_tree(self.worker.pid, grace_s=5)
        if self.flow_process.is_running():
            terminate_tree(self.flow_process.pid, grace_s=5)


def train_on_a_worker(server: PrefectServer, work: Path, epochs: int,
                      worker_output: int = subprocess.PIPE) -> Training:
    """Run the pipeline deployment (``epochs``, no system metrics) on a new process worker and
    return once its first step is recorded (the worker and its flow process alive)."""
    params = {"config": {"work_dir": str(work), "train": {"epochs": epochs},
                         "overrides": ["tracking.system_metrics_interval_s=null"]}}
    out = server.prefect("deployment", "run", "pipeline/pipeline", "--params",
                         json.dumps(params)).stdout
    flow_run_id = next(line.split("UUID:")[1].strip() for line in out.splitlines()
                       if "UUID:" in line)
    worker = subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--run-once"],
        env={**server.env, "PYTHONPATH": str(REPO)}, cwd=REPO, stdout=worker_output,
        stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if worker.poll() is not None:
                output = worker.stdout.read().decode(errors="replace") if worker.stdout else ""
                raise AssertionError(f"the worker ended before training: {output[-3000:]}")
            jobs = list((work / "jobs").glob("*")) if (work / "jobs").is_dir() else []
            if jobs and any(e["event"] == "step" for e in read_events(jobs[0])):
                flow_process = next(p for p in psutil.Process(worker.pid).children()
                                    if "prefect.engine" in " ".join(p.cmdline()))
                return Training(flow_run_id, worker, flow_process, jobs[0])
            time.sleep(0.05)
        raise AssertionError("training never started")
    except BaseException:
        terminate_tree(worker.pid, grace_s=5)
        raise


def test_a_prefect_cancel_commits_the_stop_checkpoint_and_ends_cancelled(deployed, tmp_path):
    """Input 8: cancel mid-training -> the ranks commit a stop checkpoint, the flow run and its
    ``train`` and ``attempt-1`` task runs end Cancelled (they were Crashed), the MLflow run
    KILLED."""
    work = tmp_path / "work"
    trial = cancel_trial(deployed, work)
    print(f"cancel -> ranks stopped {trial.to_ranks_stopped_s} s, -> Cancelled "
          f"{trial.to_cancelled_s} s")
    assert trial.final_state == "CANCELLED", trial.worker_output[-4000:]
    state = flow_run_state(deployed, trial.flow_run_id)
    assert state.type.value == "CANCELLED", state
    tasks = task_run_states(deployed, trial.flow_run_id)  # not Crashed: a cancel is no crash
    assert tasks["attempt-1"].type.value == "CANCELLED", tasks
    assert next(s for name, s in tasks.items() if name.startswith("train")).type.value \
        == "CANCELLED", tasks
    end = [e for e in read_events(trial.job_dir) if e["event"] == "end"][-1]
    assert end["outcome"] == "preempted", end
    assert (trial.job_dir / "checkpoints" / f"step-{end['step']:09d}" / "COMMITTED").exists()
    run_id = (trial.job_dir / "mlflow_run_id").read_text().strip()
    run = MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_run(run_id)
    assert run.info.status == "KILLED"
    assert not (trial.job_dir / "pipeline_done.json").exists()
    summary = job_summary(trial.job_dir)
    assert summary.state == "stopped"  # `stoker jobs`: a cancel is a stop
    # `stoker status` names the flow run, as the log lines do (trial: a bare "a Prefect cancel")
    name = flow_run_name(deployed, trial.flow_run_id)
    assert AttemptLog(trial.job_dir).history()[-1]["stopped_by"] \
        == f"a Prefect cancel of flow run {name!r}"
    assert summary.stopped_by == f"stopped by a Prefect cancel of flow run {name!r}", summary
    # The ranks' stop line names the cancel (it said a bare SIGTERM: the flow's SIGTERM handler
    # on a worker is Prefect's, and no sender was recorded).
    stops = [line for line in (trial.job_dir / "train.log").read_text().splitlines()
             if "stop requested" in line]
    assert stops and all("stop requested (SIGTERM: a Prefect cancel of flow run '" in line
                         for line in stops), stops
    # ... and the task says stopping, not "restarting (attempt 2 ...)" (trial: nothing restarts)
    assert "restarting (attempt 2" not in trial.worker_output, trial.worker_output[-3000:]
    assert "stopping (a Prefect cancel of flow run '" in trial.worker_output, \
        trial.worker_output[-3000:]


def test_worker_death_mid_training_still_finishes_and_registers(deployed, tmp_path):
    """Worker death: SIGKILL of the process worker while its flow run trains -> the flow process
    trains on, its MLflow run ends FINISHED, the model is registered, the job is marked done and
    the flow run is Completed; its progress lines keep reaching the Prefect log (trial: they
    stopped with the worker until the flow ended)."""
    work = tmp_path / "work"
    run = train_on_a_worker(deployed, work, epochs=60)  # trains on >= 12 s after the kill
    try:
        run.worker.kill()  # SIGKILL: its pipes to the flow process are gone with it
        run.worker.wait(timeout=30)
        killed_at = time.time()
        run.flow_process.wait(timeout=600)
    finally:
        run.clean_up()
    flow_run_id = run.flow_run_id

    assert flow_run_state(deployed, flow_run_id).type.value == "COMPLETED"
    done = json.loads(next((work / "jobs").glob("*/pipeline_done.json")).read_text())
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    assert client.get_run(done["run_id"]).info.status == "FINISHED"
    assert client.get_model_version("stoker-digits", "1").run_id == done["run_id"]
    after = [line for at, line in flow_run_logs(deployed, flow_run_id)
             if at > killed_at + 6 and line.startswith("step ") and "samples/s" in line]
    assert after, "no progress line reached the Prefect log after the worker died"


def test_a_killed_flow_process_ends_crashed_with_its_ranks_and_no_hook_error(deployed, tmp_path):
    """``kill -9`` of the flow process on a worker: its ranks stop with it (no trainer left),
    the worker reports the flow run Crashed and exits, and the worker's run of the flow's
    ``on_crashed`` hook raises nothing (trial: the worker calls hooks with keyword arguments,
    and ours took ``_flow``: an ERROR with a TypeError traceback in the run's log)."""
    run = train_on_a_worker(deployed, tmp_path / "work", epochs=200)
    ranks: list[psutil.Process] = []
    try:
        ranks = [p for p in run.flow_process.children(recursive=True)
                 if p.name().startswith("stoker-rank")]
        assert ranks, run.flow_process.children(recursive=True)
        run.flow_process.kill()
        output = run.worker.communicate(timeout=120)[0].decode(errors="replace")
        _, alive = psutil.wait_procs(ranks, timeout=30)
    finally:
        run.clean_up()
        for rank in ranks:
            if rank.is_running():
                rank.kill()
    flow_run_id = run.flow_run_id
    assert run.worker.returncode == 0, output[-3000:]
    assert not alive, alive  # no trainer outlives its flow process
    assert flow_run_state(deployed, flow_run_id).type.value == "CRASHED"
    hook_errors = [line for _, line in flow_run_logs(deployed, flow_run_id) if "hook" in line]
    assert not hook_errors, hook_errors
    assert "while running hook" not in output, output[-3000:]


def test_a_cancel_after_the_worker_died_still_stops_the_job(deployed, tmp_path):
    """A Prefect cancel is carried out by the worker (SIGTERM to the flow process). With the
    worker SIGKILLed the run stayed Cancelling and trained on to the end (trial). The flow's
    own watcher stops the job once no worker acted within its grace: the ranks commit a stop
    checkpoint, the run ends Cancelled, the MLflow run KILLED, and the attempt names who
    stopped it."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    work = tmp_path / "work"
    run = train_on_a_worker(deployed, work, epochs=300, worker_output=subprocess.DEVNULL)
    flow_run_id = run.flow_run_id
    try:
        run.worker.kill()
        run.worker.wait(timeout=30)
        with temporary_settings({PREFECT_API_URL: deployed.api_url}), \
                get_client(sync_client=True) as client:
            client.set_flow_run_state(uuid.UUID(flow_run_id), Cancelling(), force=True)
        run.flow_process.wait(timeout=120)  # 300 epochs train for minutes
    finally:
        run.clean_up()
    assert flow_run_state(deployed, flow_run_id).type.value == "CANCELLED"
    job_dir = run.job_dir
    end = [e for e in read_events(job_dir) if e["event"] == "end"][-1]
    assert end["outcome"] == "preempted", end  # the ranks' stop checkpoint
    assert (job_dir / "checkpoints" / f"step-{end['step']:09d}" / "COMMITTED").exists()
    assert end["step"] < 300 * 22, end  # stopped, not trained to the end
    name = flow_run_name(deployed, flow_run_id)
    assert AttemptLog(job_dir).history()[-1]["stopped_by"] == (
        f"a Prefect cancel of flow run {name!r}: no worker carried it out in 15 s, so the flow "
        "stops the job itself")
    run_id = (job_dir / "mlflow_run_id").read_text().strip()
    assert MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_run(run_id).info.status \
        == "KILLED"
