"""What opening rank 0's MLflow run asks of the store: every call is part of each attempt's
tracking one-off (benchmark 12), so none may be spent twice. Real sqlite stores, counted calls."""

from __future__ import annotations

import collections

import pytest
import torch
from mlflow import MlflowClient
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

from stoker.config import TrainConfig
from stoker.runtime.distributed import DistEnv
from stoker.runtime.reporting import ReportingMixin
from stoker.runtime.spec import RunSpec
from stoker.runtime.tracking import RunTracker, ensure_store


@pytest.fixture
def store_calls(monkeypatch):
    """Counts of the sqlite store's calls by method name (the calls still reach the store)."""
    counts: collections.Counter = collections.Counter()
    for name in ("search_experiments", "log_batch", "create_run", "get_experiment_by_name"):
        real = getattr(SqlAlchemyStore, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(SqlAlchemyStore, name, counted)
    return counts


def test_an_existing_store_is_read_by_the_run_itself_not_probed_first(tmp_path, store_calls):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ensure_store(uri)  # made by the command (or an earlier attempt)
    store_calls.clear()
    tracker = RunTracker(uri, "exp", run_name="r", tags={"team": "vision"},
                         params={"train.lr": "0.1"})
    tracker.end("FINISHED")
    assert store_calls["search_experiments"] == 0  # the old probe: one query and the file lock
    run = MlflowClient(uri).get_run(tracker.run_id)
    assert run.data.tags["team"] == "vision" and run.data.params == {"train.lr": "0.1"}


def test_a_store_that_is_no_database_still_fails_where_the_command_probes_it(tmp_path):
    db = tmp_path / "mlflow.db"
    db.write_text("not a database\n")
    with pytest.raises(Exception, match="(?i)database"):
        ensure_store(f"sqlite:///{db}")  # open_store's early, one-line check keeps its probe
    ensure_store(f"sqlite:///{db}", probe=False)  # left for the run's own first call
    with pytest.raises(Exception, match="(?i)database"):
        RunTracker(f"sqlite:///{db}", "exp")


class _Rank0(ReportingMixin):
    """The attributes of a Trainer that opening its run reads."""

    def __init__(self, spec: RunSpec):
        self.spec, self.cfg, self.run_id = spec, spec.train, None
        self.env = DistEnv(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"),
                           backend="gloo")


def test_a_new_run_gets_its_runtime_tags_at_creation_not_in_a_batch_of_their_own(
        tmp_path, store_calls):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ensure_store(uri)
    job = tmp_path / "job"
    job.mkdir()
    spec = RunSpec(train=TrainConfig(epochs=1), data_dir=str(tmp_path), job_dir=str(job),
                   tracking_uri=uri, experiment="exp", run_name="r", tags={"team": "vision"},
                   system_metrics_interval_s=None)
    store_calls.clear()
    tracker = _Rank0(spec)._open_tracker()
    run_id = tracker.wait_open(60)
    tracker.end("FINISHED")
    # the params (one batch), then the end's flush of nothing: the tags came with create_run
    assert store_calls["create_run"] == 1
    assert store_calls["log_batch"] == 1, store_calls
    tags = MlflowClient(uri).get_run(run_id).data.tags
    assert tags["stoker.world_size"] == "2" and tags["stoker.gpu_model"] == "cpu"
    assert tags["team"] == "vision"
    assert (job / "mlflow_run_id").read_text() == run_id
