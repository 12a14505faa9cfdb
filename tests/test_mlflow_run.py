"""The job's MLflow run at resume (stoker.jobs.mlflow_run), on MLflow's real sqlite store and a
REST client facing a closed port: a run the store holds is reopened as is; a run it lost (or
that was deleted, or a damaged record) is continued in a new run that links it and carries the
job's record; a store that cannot be read is one line naming it and the run."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from stoker.jobs.mlflow_run import LINK_TAG, continue_lost_run, open_job_store
from stoker.launch.supervisor import finish_run
from stoker.runtime.records import read_json, write_json
from stoker.runtime.spec import RunSpec
from stoker.tracking.store import TrackingStoreError

HISTORY = [{"number": 1, "outcome": "preempted", "duration_s": 30.0, "steps_lost": 0},
           {"number": 2, "outcome": "interrupted", "duration_s": 90.0, "steps_lost": 7}]


def spec_for(tmp_path: Path, uri: str, run_id: str | None) -> RunSpec:
    """A job folder recording ``run_id`` (if any), with a committed checkpoint at step 30."""
    job = tmp_path / "jobs" / "digits-1"
    (job / "checkpoints" / "step-000000030").mkdir(parents=True)
    (job / "checkpoints" / "step-000000030" / "COMMITTED").write_text("")
    if run_id is not None:
        (job / "mlflow_run_id").write_text(run_id)
    return RunSpec(data_dir=str(tmp_path), job_dir=str(job), tracking_uri=uri,
                   experiment="lost", run_name="digits-1",
                   tags={"stoker.job": "digits-1", "mlflow.note.content": "the job"})


def test_a_run_the_store_holds_is_reopened_as_is(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("lost"))
    spec = spec_for(tmp_path, uri, run.info.run_id)
    assert continue_lost_run(spec, HISTORY, [], 2) is None
    assert (Path(spec.job_dir) / "mlflow_run_id").read_text() == run.info.run_id
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_a_run_the_store_lost_continues_in_a_linked_run_with_the_job_s_record(tmp_path):
    """The default store on a new node: empty. The new run links the lost one and carries the
    attempts, preemptions, billed time and steps lost; the job records the new run."""
    uri = f"sqlite:///{tmp_path / 'node-b' / 'mlflow.db'}"
    lost = uuid.uuid4().hex
    spec = spec_for(tmp_path, uri, lost)
    continued = continue_lost_run(spec, HISTORY, [], 2)
    assert continued is not None and continued.run_id != lost
    assert (Path(spec.job_dir) / "mlflow_run_id").read_text() == continued.run_id
    run = MlflowClient(uri).get_run(continued.run_id)  # read back from the store
    assert run.info.status == "RUNNING"  # the runtime reopens it
    assert run.data.tags[LINK_TAG] == lost and run.data.tags["stoker.lost_run_step"] == "30"
    assert run.data.tags["stoker.attempts"] == "2" and run.data.tags["stoker.preemptions"] == "1"
    assert run.data.tags["stoker.job"] == "digits-1"
    assert lost in run.data.tags["mlflow.note.content"]
    # The ranks reopen it with the spec's tags: the description that names the lost run stays.
    from stoker.runtime.tracking import RunTracker

    RunTracker(uri, "lost", run_id=continued.run_id, tags=spec.tags)
    run = MlflowClient(uri).get_run(continued.run_id)
    assert run.data.tags["mlflow.note.content"].startswith(f"Continues MLflow run {lost}")
    assert run.data.metrics == {"billed_s": 120.0, "gpu_hours": pytest.approx(2 * 120 / 3600),
                                "steps_lost": 7.0}
    assert [m.step for m in MlflowClient(uri).get_metric_history(run.info.run_id, "billed_s")] \
        == [30]
    line = continued.line()
    assert "\n" not in line and lost in line and continued.run_id in line
    assert "is not in the tracking store" in line and "gone" in line
    assert f"{LINK_TAG}={lost}" in line and "2 attempt(s), 120 s billed and 7 step(s)" in line


def test_a_finished_training_s_result_names_the_new_run(tmp_path):
    """The ranks finished on the lost node (its result.json, in the bucket, names the lost
    run): registration must log the model to a run the store holds."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    lost = uuid.uuid4().hex
    spec = spec_for(tmp_path, uri, lost)
    write_json(Path(spec.job_dir) / "result.json", {"run_id": lost, "step": 30})
    continued = continue_lost_run(spec, HISTORY, [], 1)
    assert read_json(Path(spec.job_dir) / "result.json") == {"run_id": continued.run_id,
                                                              "step": 30}


def test_ending_a_run_the_store_lost_is_a_warning_not_a_traceback(tmp_path, caplog):
    """Closing the job's run (a stop, a failed job) never masks how the job ended."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    lost = uuid.uuid4().hex
    finish_run(MlflowClient(uri), lost, "KILLED")
    [warning] = [r.getMessage() for r in caplog.records if lost in r.getMessage()]
    assert f"could not end MLflow run {lost} as KILLED in the tracking store {uri}" in warning


def test_a_deleted_run_or_a_damaged_record_is_continued_too(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("lost"))
    client.delete_run(run.info.run_id)
    continued = continue_lost_run(spec_for(tmp_path / "a", uri, run.info.run_id), [], [], 1)
    assert continued is not None and "was deleted from" in continued.line()
    damaged = continue_lost_run(spec_for(tmp_path / "b", uri, "../../x\ny" + "z" * 500), [],
                                [], 1)
    assert damaged is not None and "\n" not in damaged.line()
    assert client.get_run(damaged.run_id).data.tags[LINK_TAG] == "../../x y" + "z" * 91


def test_nothing_recorded_yet_or_no_tracking_changes_nothing(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert continue_lost_run(spec_for(tmp_path / "a", uri, None), [], [], 1) is None
    spec = spec_for(tmp_path / "b", uri, uuid.uuid4().hex).model_copy(
        update={"tracking_uri": None})
    assert continue_lost_run(spec, [], [], 1) is None


def test_a_store_that_cannot_be_read_is_one_line_naming_it_and_the_run(tmp_path, monkeypatch):
    """A tracking server that does not answer: one line with the store (its password masked)
    and the run; the job's record is left as it was."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    lost = uuid.uuid4().hex
    spec = spec_for(tmp_path, f"http://alice:hunter2secret@127.0.0.1:{port}", lost)
    with pytest.raises(TrackingStoreError) as error:
        continue_lost_run(spec, HISTORY, [], 1)
    message = str(error.value)
    assert "\n" not in message and "hunter2secret" not in message
    assert message.startswith(f"tracking store http://alice:***@127.0.0.1:{port}: cannot read "
                              f"MLflow run {lost} of job digits-1")
    assert (Path(spec.job_dir) / "mlflow_run_id").read_text() == lost


def test_a_store_file_that_is_not_a_database_is_one_line_naming_it_and_the_run(tmp_path):
    """The sqlite store damaged (another program wrote over it): one line, not sqlalchemy's
    traceback, before anything trains."""
    db = tmp_path / "mlflow.db"
    db.write_text("not a database")
    lost = uuid.uuid4().hex
    spec = spec_for(tmp_path, f"sqlite:///{db}", lost)
    for call in (lambda: open_job_store(spec.tracking_uri, Path(spec.job_dir)),
                 lambda: continue_lost_run(spec, [], [], 1)):
        with pytest.raises(TrackingStoreError) as error:
            call()
        message = str(error.value)
        assert "\n" not in message, message
        assert message.startswith(f"tracking store sqlite:///{db}: cannot read MLflow run "
                                  f"{lost} of job digits-1 (DatabaseError: ")
    fresh = tmp_path / "fresh-job"
    with pytest.raises(TrackingStoreError, match=r": cannot be opened for job fresh-job \("):
        open_job_store(f"sqlite:///{db}", fresh)


def test_the_runtime_reopening_a_run_the_store_lost_logs_to_a_new_linked_run(tmp_path, caplog):
    """The rank's own guard (a checkpoint naming a run the job's record never got): a new run
    tagged with the lost one, recorded through ``on_created``, and a warning."""
    from stoker.runtime.tracking import RunTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    lost, created = uuid.uuid4().hex, []
    tracker = RunTracker(uri, "lost", run_id=lost, tags={"stoker.job": "digits-1"},
                         on_created=created.append)
    assert created == [tracker.run_id] and tracker.run_id != lost
    tags = MlflowClient(uri).get_run(tracker.run_id).data.tags
    assert tags[LINK_TAG] == lost and tags["stoker.job"] == "digits-1"
    assert any(lost in r.getMessage() and "not in the tracking store" in r.getMessage()
               for r in caplog.records)
