# ruff: noqa: F811 - the S3 and Prefect fixtures are imported from test_bucket, used as parameters
"""A job whose MLflow store was lost with its node (the default sqlite store in the node's
work_dir) resumes on another node from the bucket, in a new MLflow run that links the lost one;
against moto's S3 HTTP server, a Prefect test server, torchrun and MLflow's sqlite store."""

from __future__ import annotations

import shutil
import subprocess

from stoker.runtime.checkpoint import Checkpointer
from tests.test_bucket import (  # noqa: F401
    BUCKET,
    api_env,
    command,
    keys_in,
    kill_everything,
    s3,
    s3_env,
    wait_for,
)

MIN_STEP = 20  # node A is killed once the bucket holds a committed checkpoint at least this far


def committed(env: dict, prefix: str) -> list[int]:
    """The committed checkpoint steps under ``prefix`` of the bucket, from their markers."""
    return sorted(int(k.split("/step-")[1].split("/")[0]) for k in keys_in(env, prefix)
                  if k.endswith("/COMMITTED"))


def test_a_job_whose_tracking_store_was_lost_resumes_in_a_linked_run(api_env, s3_env, tmp_path):
    """Node A (default tracking store: its work_dir's mlflow.db) is SIGKILLed with its process
    group after a committed step >= 20 and its disk deleted; node B runs the same command: it
    resumes at the committed step from the bucket (no `Run with id=... not found`), says in a
    WARNING that the earlier metrics were in a store that is gone, and its own store holds a
    finished run for the job tagged with the lost run's id and both attempts."""
    from mlflow import MlflowClient

    from stoker.jobs.attempts import AttemptLog
    from stoker.runtime.progress import read_events

    store = f"s3://{BUCKET}/lost-tracking"
    sized = ("train.epochs=10", "train.checkpoint_every_steps=10")
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    first = subprocess.Popen(command(node_a, store, *sized), env=api_env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=tmp_path, start_new_session=True)
    try:
        wait_for(lambda: committed(api_env, "lost-tracking/")
                 and committed(api_env, "lost-tracking/")[-1] >= MIN_STEP
                 and any(k.endswith("/mlflow_run_id") for k in keys_in(api_env, "lost-tracking/"))
                 and any(k.endswith("/heartbeat.json")
                         for k in keys_in(api_env, "lost-tracking/")), process=first)
        kill_everything(first)  # the whole process group at once: a lost machine
    finally:
        if first.poll() is None:
            first.kill()
    name = keys_in(api_env, "lost-tracking/")[0].split("/")[1]
    lost_run = (node_a / "jobs" / name / "mlflow_run_id").read_text().strip()
    assert not [e for e in read_events(node_a / "jobs" / name) if e["event"] == "end"], \
        "node A finished training before it was killed"
    shutil.rmtree(node_a)  # the disk, with its mlflow.db, is gone
    at_kill = Checkpointer(f"{store}/{name}/checkpoints", 0, 1).committed_steps()[-1]
    assert at_kill >= MIN_STEP

    second = subprocess.run(command(node_b, store, *sized), env=api_env, capture_output=True,
                            text=True, timeout=600, cwd=tmp_path)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-4000:]
    assert "Traceback" not in output and "not found" not in output, output[-4000:]
    [warning] = [line for line in output.splitlines() if "WARNING" in line and lost_run in line]
    assert "gone" in warning and "stoker.lost_run_id" in warning, warning

    job = node_b / "jobs" / name
    starts = [e for e in read_events(job) if e["event"] == "start"]
    assert starts[-1]["step"] == at_kill  # resumed at the committed step, from the bucket
    history = AttemptLog(job).history()
    assert [(a["number"], a["outcome"]) for a in history] == [(1, "interrupted"), (2, "completed")]

    client = MlflowClient(f"sqlite:///{node_b / 'mlflow.db'}")
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()],
                               filter_string=f"tags.`stoker.job` = '{name}'")
    assert run.info.status == "FINISHED" and run.info.run_id != lost_run
    assert run.data.tags["stoker.lost_run_id"] == lost_run
    # The description says so after the ranks reopened the run (they kept their own before).
    assert f"Continues MLflow run {lost_run}" in run.data.tags["mlflow.note.content"]
    assert run.data.tags["stoker.attempts"] == "2"  # node A's attempt counts
    assert (job / "mlflow_run_id").read_text().strip() == run.info.run_id
    assert store_record(s3_env, name) == run.info.run_id  # the bucket names the new run too


def store_record(env: dict, name: str) -> str:
    """The job's ``mlflow_run_id`` record in the bucket."""
    from stoker.jobs.store import JobStore

    return JobStore(f"s3://{BUCKET}/lost-tracking").fs.cat_file(
        f"{BUCKET}/lost-tracking/{name}/mlflow_run_id").decode().strip()



def test_a_tracking_store_that_cannot_be_opened_is_one_line(api_env, s3_env, tmp_path):
    """The node's sqlite store is not a database (written over): `stoker run` exits 2 with
    one line naming the store, before anything trains, and no traceback."""
    work = tmp_path / "node"
    work.mkdir()
    (work / "mlflow.db").write_text("not a database")
    run = subprocess.run(command(work, f"s3://{BUCKET}/damaged-store"), env=api_env,
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 2, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: tracking store sqlite:///{work / 'mlflow.db'}: cannot be "
                           "opened (DatabaseError: "), last  # at its first contact: the pull
    assert not list(work.glob("jobs/*/progress.jsonl"))  # nothing trained
