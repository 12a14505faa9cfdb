"""The slurm launcher on a real Slurm (.ci/start-slurm.sh: slurmctld and two slurmd, n1 and n2,
a low and a high partition for preemption). Skipped without one, failed under CI=true."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from conftest import events
from slurm_cluster import require_cluster

from stoker.config import RetryConfig, SlurmLauncherConfig, TrainConfig
from stoker.jobs.stop_request import read_stop_request
from stoker.launch.retry import Outcome, run_with_retries
from stoker.launch.slurm import SlurmLauncher, exit_code_for_job, jobs_of, slurm
from stoker.runtime.spec import RunSpec

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("slurm")]
TRAIN = {"epochs": 2, "checkpoint_every_steps": 4, "keep_latest_k": 2}


def test_job_ends_map_to_stokers_exit_codes():
    assert exit_code_for_job("COMPLETED", "0:0", False) == 0
    assert exit_code_for_job("PREEMPTED", "0:15", False) == 75
    assert exit_code_for_job("FAILED", "75:0", False) == 75  # a stop checkpoint committed
    assert exit_code_for_job("NODE_FAIL", "0:0", False) == 137
    assert exit_code_for_job("FAILED", "137:0", False) == 137
    assert exit_code_for_job("TIMEOUT", "0:15", False) == 137
    assert exit_code_for_job("FAILED", "2:0", False) == 2  # user error
    assert exit_code_for_job("CANCELLED", "0:15", True) == 75


@pytest.fixture(scope="module")
def cluster():
    """A Slurm that answers (SLURM_CONF, else the one .ci/start-slurm.sh writes)."""
    return require_cluster("low")


@pytest.fixture(scope="module")
def spec_for(dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm-jobs")

    def make(job: str, **train) -> Path:
        job_dir = root / f"{job}-{uuid.uuid4().hex[:6]}"
        job_dir.mkdir()
        spec = RunSpec(train=TrainConfig(**{**TRAIN, **train}), data_dir=dataset.local_path,
                       job_dir=str(job_dir), tracking_uri=None, artifact_location=None,
                       run_name=job, tags={})
        spec.dump(job_dir / "spec.yaml")
        return job_dir / "spec.yaml"

    return make


def launcher(**fields) -> SlurmLauncher:
    return SlurmLauncher(SlurmLauncherConfig(**{"nodes": 2, **fields}), shutdown_grace_s=15,
                         poll_s=0.5, orphan_wait_s=30)


def final_weights(spec: Path) -> dict:
    return torch.load(spec.parent / "final" / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(cluster, spec_for) -> Path:
    """One 2-node job trained without interruption: the reference for the resumed ones."""
    spec = spec_for("reference")
    lines: list[str] = []
    code = launcher().run(spec, on_line=lines.append, timeout_s=300)
    assert code == 0, "\n".join(lines[-40:])
    return spec


def test_two_nodes_one_rank_each_train_one_job(uninterrupted):
    import json

    result = json.loads((uninterrupted.parent / "result.json").read_text())
    assert result["world_size"] == 2 and result["step"] == 44
    assert not jobs_of(uninterrupted.parent.name)  # nothing left queued


def wait_for_step(job_dir: Path, step: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(e["event"] == "step" and e["step"] >= step for e in events(job_dir)):
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.2)


def in_background(run) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(run()), daemon=True)
    thread.start()
    return thread, out


def assert_resumed_at_the_stop_step(job_dir: Path) -> None:
    """The first attempt ended preempted at step N (its stop checkpoint), the next started
    there."""
    ends = [e for e in events(job_dir) if e["event"] == "end"]
    starts = [e for e in events(job_dir) if e["event"] == "start"]
    assert ends[0]["outcome"] == "preempted" and 0 < ends[0]["step"] < 44, ends
    assert starts[1]["resumed"] and starts[1]["step"] == ends[0]["step"], starts


def assert_same_weights(spec: Path, reference: Path) -> None:
    ours, theirs = final_weights(spec), final_weights(reference)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_higher_priority_job_preempts_and_the_next_attempt_resumes(uninterrupted, spec_for):
    spec = spec_for("preempted")
    slurm_launcher = launcher(partition="low")
    lines: list[str] = []
    thread, attempts = in_background(lambda: run_with_retries(
        lambda n: slurm_launcher.run(spec, on_line=lines.append, timeout_s=300), RetryConfig()))
    wait_for_step(spec.parent, 4)
    high = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N2", "-o", "/dev/null",
                           "--wrap", "sleep 2"],
                          check=True, capture_output=True, text=True).stdout.strip()
    thread.join(timeout=240)
    outcomes = [a.outcome for a in attempts[0]]
    assert outcomes == [Outcome.PREEMPTED, Outcome.COMPLETED], "\n".join(lines[-40:])
    # Slurm ends the job PREEMPTED, or FAILED with the batch script's 75 when every rank
    # committed its stop checkpoint within GraceTime (first).
    ended = [line for line in lines if line.startswith("Slurm job ")][0]
    assert "ended PREEMPTED" in ended or "exit 75:0" in ended, (ended, high)
    assert_resumed_at_the_stop_step(spec.parent)
    assert_same_weights(spec, uninterrupted)


def test_a_stop_while_the_job_is_queued_cancels_it_at_once(cluster, spec_for):
    """Ctrl-C of ``stoker run`` (the launcher's cancel) while its job waits for nodes: the job
    leaves the queue at once (trial: ``scancel --signal=TERM`` of a pending job was refused,
    the refusal swallowed, and the job later trained with nothing watching it)."""
    blocker = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N2", "-o", "/dev/null",
                              "--wrap", "sleep 120"],
                             check=True, capture_output=True, text=True).stdout.strip()
    try:
        spec = spec_for("queued")
        slurm_launcher = launcher(partition="low")
        thread, _ = in_background(lambda: slurm_launcher.run(spec, on_line=lambda _: None,
                                                             timeout_s=300))
        deadline = time.monotonic() + 60
        while slurm_launcher.job_id is None:
            assert time.monotonic() < deadline, "not submitted"
            time.sleep(0.2)
        job_id = slurm_launcher.job_id
        state = slurm("squeue", "-h", "-j", job_id, "-o", "%T").strip()
        assert state == "PENDING", state
        began = time.monotonic()
        slurm_launcher.cancel()
        assert time.monotonic() - began < 10
        thread.join(timeout=60)
        assert not thread.is_alive()
        left = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                              text=True).stdout.strip()
        assert left in ("", "CANCELLED"), left
        assert not any(e["event"] == "step" for e in events(spec.parent))
    finally:
        subprocess.run(["scancel", blocker], check=False)


def test_sigterm_to_the_batch_shell_ends_with_a_stop_checkpoint(cluster, spec_for):
    """The time limit's ``--signal=B:TERM@<grace>`` signals the batch shell, which passed
    SIGTERM on to srun: srun ended the step itself ("forcing job termination"), the tasks were
    killed after KillWait and the attempt was an infrastructure failure (137) without a stop
    checkpoint. The shell now passes it to the step's tasks: every rank commits, exit 75."""
    spec = spec_for("time-limit", epochs=8)
    slurm_launcher = launcher()
    lines: list[str] = []
    thread, codes = in_background(lambda: slurm_launcher.run(spec, on_line=lines.append,
                                                             timeout_s=300))
    wait_for_step(spec.parent, 4)
    # What Slurm sends at the time limit minus the grace (scancel --batch: the shell only).
    slurm("scancel", "--batch", "--signal=TERM", slurm_launcher.job_id)
    thread.join(timeout=120)
    assert codes == [75], "\n".join(lines[-40:])
    ends = [e for e in events(spec.parent) if e["event"] == "end"]
    assert ends[-1]["outcome"] == "preempted" and ends[-1]["step"] >= 4, ends
    assert not jobs_of(spec.parent.name)


def node_launcher(spec: Path, node_id: str) -> psutil.Process:
    """The ``stoker.runtime.launch`` process that srun started on node ``node_id`` for the job
    of ``spec``, found by its title (``stoker-launch job <JOB>: python -m stoker.runtime.launch
    ... --node-rank=<N> ...``; setting the title overwrote the process's environment, so
    SLURM_NODEID cannot be read). The job is matched too: another test's two-node job (the
    Docker launcher's containers, in CI beside this one) has a node 1 as well."""
    from stoker.runtime.preemption import spec_job

    title = ["stoker-launch", "job", f"{spec_job(spec)}:"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for proc in psutil.process_iter(["cmdline"]):
            args = " ".join(proc.info["cmdline"] or []).split()
            if args[:3] == title and f"--node-rank={node_id}" in args:
                return proc
        time.sleep(0.2)
    raise AssertionError(f"no launcher on node {node_id}")


def test_kill_9_of_one_nodes_launcher_is_an_infrastructure_failure_resumed(uninterrupted,
                                                                            spec_for):
    spec = spec_for("node-lost")
    lines: list[str] = []
    thread, attempts = in_background(lambda: run_with_retries(
        lambda n: launcher().run(spec, on_line=lines.append, timeout_s=300),
        RetryConfig(backoff_s=0)))
    wait_for_step(spec.parent, 6)
    node_launcher(spec, "1").kill()
    thread.join(timeout=240)
    outcomes = [a.outcome for a in attempts[0]]
    assert outcomes == [Outcome.INFRASTRUCTURE, Outcome.COMPLETED], "\n".join(lines[-40:])
    assert_same_weights(spec, uninterrupted)


def test_a_job_left_by_a_killed_orchestrator_is_stopped_and_resumed(uninterrupted, spec_for):
    """An orchestrator that died after ``sbatch`` left its job training: the next run's
    launcher stops it (stop checkpoint) before submitting, and resumes from it."""
    spec = spec_for("orphan")
    orphan = launcher().submit(spec)  # its follower is gone
    wait_for_step(spec.parent, 6)
    lines: list[str] = []
    code = launcher().run(spec, on_line=lines.append, timeout_s=300)
    assert code == 0, "\n".join(lines[-40:])
    assert any(f"Slurm job(s) {orphan}" in line for line in lines)
    assert not jobs_of(spec.parent.name)
    assert_same_weights(spec, uninterrupted)


def test_a_bad_partition_or_too_many_nodes_is_one_line_before_submitting(cluster, mlflow_http,
                                                                        tmp_path):
    cases = {
        "launcher.slurm.partition=nope": "launcher.slurm.partition: 'nope' is not a partition of "
        "the cluster (it has: high, low)",
        "launcher.slurm.nodes=3": "launcher.slurm.nodes: 3 nodes asked, partition low has 2",
        "launcher.slurm.gpus_per_node=1": "launcher.slurm (nodes=2, gpus_per_node=1): Slurm "
        "refuses the job: Invalid generic resource (gres) specification"}
    runs = {override: subprocess.Popen(  # the three at once: each is mostly interpreter start
        [sys.executable, "-m", "stoker.cli", "run", f"work_dir={tmp_path / f'work{i}'}",
         "launcher.kind=slurm", "launcher.slurm.nodes=2",
         f"tracking.tracking_uri={mlflow_http.uri}", override],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        for i, override in enumerate(cases)}
    for override, run in runs.items():
        try:
            _, stderr = run.communicate(timeout=120)
        finally:
            run.kill()
        assert run.returncode == 2, stderr[-2000:]
        assert stderr.strip().splitlines() == [f"error: {cases[override]}"]
    assert not list(tmp_path.glob("work*/datasets"))  # nothing pulled or submitted


@pytest.fixture(scope="module")
def api_env(cluster, tmp_path_factory):
    """A Prefect server for ``stoker run``, started from the migrated template database (about
    5 s; prefect_test_harness migrated a database of its own first)."""
    from prefect_server import PrefectServer

    with PrefectServer(tmp_path_factory.mktemp("prefect-slurm")) as server:
        yield server.env


def stoker_run(work: Path, tracking: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "stoker.cli", "run", f"work_dir={work}",
            "launcher.kind=slurm", "launcher.slurm.nodes=2", "train.nproc_per_node=1",
            f"tracking.tracking_uri={tracking}", "tracking.system_metrics_interval_s=null",
            "train.epochs=2", "train.checkpoint_every_steps=4", *overrides]


def test_stoker_run_trains_on_two_nodes_and_registers_one_run(api_env, mlflow_http, tmp_path):
    from mlflow import MlflowClient

    model = f"slurm-{uuid.uuid4().hex[:6]}"
    run = subprocess.run(stoker_run(tmp_path / "work", mlflow_http.uri, "job_id=two-nodes",
                                    f"tracking.registered_model={model}", "train.epochs=1"),
                         env=api_env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    job = tmp_path / "work" / "jobs" / "two-nodes"
    client = MlflowClient(mlflow_http.uri)
    mlflow_run = client.get_run((job / "mlflow_run_id").read_text())
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.tags["stoker.world_size"] == "2"
    assert mlflow_run.data.tags["stoker.launcher"] == "slurm"
    # Both nodes' devices are billed (trial: devices 1, GPU-hours half the real ones).
    metrics = mlflow_run.data.metrics
    assert metrics["devices"] == 2.0, metrics
    assert metrics["gpu_hours"] == pytest.approx(2 * metrics["billed_s"] / 3600, rel=0.01)
    [version] = client.search_model_versions(f"name='{model}'")
    assert version.run_id == mlflow_run.info.run_id
    assert "submitted Slurm job" in (job / "train.log").read_text()


def test_scancel_ends_stoker_run_stopped_with_exit_3_and_nothing_retried(api_env, mlflow_http,
                                                                          tmp_path):
    from stoker.jobs.attempts import AttemptLog

    job = tmp_path / "work" / "jobs" / "cancelled"
    cmd = stoker_run(tmp_path / "work", mlflow_http.uri, "job_id=cancelled", "train.epochs=8",
                     "retry.max_user_errors=2", "retry.max_infra_failures=2")
    run = subprocess.Popen(cmd, env=api_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        wait_for_step(job, 3, timeout_s=180)
        subprocess.run(["scancel", *jobs_of("cancelled")], check=True)
        out = run.communicate(timeout=180)[0]
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 3, out[-3000:]
    assert [a["outcome"] for a in AttemptLog(job).history()] == ["stopped"]
    assert "scancel" in read_stop_request(job).reason
    assert not jobs_of("cancelled")


def test_stoker_stop_commits_a_stop_checkpoint_and_ends_the_run_with_exit_3(api_env,
                                                                           mlflow_http,
                                                                           tmp_path):
    """``stoker stop`` looked for the ranks below ``stoker run`` (none: slurmd starts them)
    and gave up after its timeout. The Slurm launcher now reads the request at its next poll
    and sends the batch job SIGTERM: every rank commits a stop checkpoint, the attempt ends
    stopped (not retried), ``stoker run`` exits 3 and nothing stays queued."""
    from stoker.jobs.attempts import AttemptLog

    work = tmp_path / "work"
    job = work / "jobs" / "user-stop"
    cmd = stoker_run(work, mlflow_http.uri, "job_id=user-stop", "train.epochs=8",
                     "retry.max_infra_failures=2")
    run = subprocess.Popen(cmd, env=api_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        wait_for_step(job, 3, timeout_s=180)
        stop = subprocess.run([sys.executable, "-m", "stoker.cli", "stop", "user-stop",
                               "--reason", "maintenance", "--timeout", "90",
                               "--work-dir", str(work)],
                              capture_output=True, text=True, timeout=150)
        out = run.communicate(timeout=180)[0]
    finally:
        if run.poll() is None:
            run.kill()
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "stopped by user: maintenance" in stop.stdout, stop.stdout
    assert run.returncode == 3, out[-3000:]
    assert [a["outcome"] for a in AttemptLog(job).history()] == ["stopped"]
    log = (job / "train.log").read_text()
    assert "stop requested (SIGTERM: stopped by user: maintenance): checkpoint committed" \
        in log, log[-3000:]
    ends = [e for e in events(job) if e["event"] == "end"]
    assert ends[-1]["outcome"] == "preempted" and ends[-1]["step"] >= 3, ends
    assert not jobs_of("user-stop")


def test_kill_9_of_stoker_run_leaves_no_job_training_and_a_rerun_resumes(api_env, mlflow_http,
                                                                         tmp_path):
    """The orchestrator is SIGKILLed while its Slurm job trains: the job stops by itself once
    the lease expires (stop checkpoint; nothing trains unowned), and the rerun resumes it."""
    job = tmp_path / "work" / "jobs" / "orphaned"
    # 5 epochs (110 steps, ~25 s here after step 4) outlast the lease's expiry and the ranks'
    # lease watch (3 s + 2 s polls) several times over; 12 made the rerun train 264 steps.
    cmd = stoker_run(tmp_path / "work", mlflow_http.uri, "job_id=orphaned", "job_lease_s=3",
                     "train.epochs=5")
    first = subprocess.Popen(cmd, env=api_env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_step(job, 4, timeout_s=180)
        first.kill()
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    deadline = time.monotonic() + 60
    while jobs_of("orphaned"):  # the lease expired: the ranks stop, the Slurm job ends
        assert time.monotonic() < deadline, "the orphaned Slurm job trains on"
        time.sleep(0.5)
    ends = [e for e in events(job) if e["event"] == "end"]
    assert ends and ends[0]["outcome"] == "preempted"
    rerun = subprocess.run(cmd, env=api_env, capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    every = events(job)
    after = every[every.index(ends[0]) + 1:]  # the rerun's attempts (one may retry under load)
    start = next(e for e in after if e["event"] == "start")
    assert start["resumed"] and start["step"] == ends[0]["step"], after


def test_the_slurm_deployment_builds_a_slurm_config():
    import yaml

    from stoker.forms import SlurmPipelineForm

    root = Path(__file__).resolve().parents[1]
    deployments = {d["name"]: d for d in yaml.safe_load((root / "prefect.yaml").read_text())
                   ["deployments"]}
    entry = deployments["pipeline-slurm"]
    assert entry["entrypoint"] == "flows/pipeline.py:pipeline_slurm"
    form = SlurmPipelineForm(**entry["parameters"]["config"],
                             tracking={"tracking_uri": "http://127.0.0.1:5000"})
    config = form.to_config()
    assert config.launcher.kind == "slurm" and config.launcher.slurm.nodes == 2


def test_the_controller_listens_on_loopback_only(cluster):
    """slurmctld bound 0.0.0.0:<port>: every interface of the machine took Slurm RPCs.
    .ci/start-slurm.sh sets CommunicationParameters=NoCtldInAddrAny, so it binds the address of
    SlurmctldHost (127.0.0.1), as the slurmd do with NoInAddrAny."""
    conf = dict(line.split("=", 1) for line in Path(cluster).read_text().splitlines()
                if "=" in line and not line.startswith("#"))
    controller = psutil.Process(int(Path(conf["SlurmctldPidFile"]).read_text()))
    listening = {c.laddr.ip for c in controller.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN}
    assert listening == {"127.0.0.1"}, (listening, conf.get("CommunicationParameters"))


def test_a_time_limit_too_short_to_train_is_refused_at_config_time(tmp_path):
    """A 1-minute limit: the stop signal (grace + 5 s before the limit, Slurm may send it up to
    60 s earlier) came 10 s in, before the ranks trained, and the attempt failed as a user error
    (trial). Refused in one line naming the field; 2 minutes is accepted."""
    from stoker.config import ConfigError, load_pipeline_config

    base = [f"work_dir={tmp_path}", "launcher.kind=slurm",
            "tracking.tracking_uri=http://127.0.0.1:5999"]
    with pytest.raises(ConfigError, match=r"launcher.slurm.time_limit_min: 1 minute\(s\) leaves "
                                          r"no time to train"):
        load_pipeline_config(None, [*base, "launcher.slurm.time_limit_min=1"])
    config = load_pipeline_config(None, [*base, "launcher.slurm.time_limit_min=2"])
    assert config.launcher.slurm.time_limit_min == 2
