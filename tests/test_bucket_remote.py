# ruff: noqa: F811 - the S3 and Prefect fixtures are imported from test_bucket
"""The fully remote set-up in one `stoker run`, against moto's S3 server on 127.0.0.1: the dataset
pulled from a DVC remote in the bucket, checkpoints and job records in the bucket
(``checkpoint_dir=s3://…``), and MLflow artifacts in the bucket behind `mlflow server
--artifacts-destination s3://…`; the registered model is read back through MLflow."""

from __future__ import annotations

import subprocess
import sys

from tests.test_bucket import BUCKET, api_env, keys_in, s3, s3_env  # noqa: F401


def test_data_checkpoints_and_artifacts_all_in_the_bucket(api_env, s3_env, tmp_path,
                                                          monkeypatch):
    import mlflow
    from mlflow import MlflowClient

    from tests.data_repos import make_repo
    from tests.mlflow_server import MlflowServer

    # The server offers ranged downloads from presigned S3 URLs; against moto those ranged
    # requests are retried without end. Through the server (the proxy) it is one plain GET.
    monkeypatch.setenv("MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD", "false")
    repo = make_repo(tmp_path / "data", {"v1": {"a": 6, "b": 6}}, remote=f"s3://{BUCKET}/e2e-dvc")
    env = {**api_env, "MLFLOW_S3_ENDPOINT_URL": api_env["AWS_ENDPOINT_URL"]}
    with MlflowServer(tmp_path / "mlflow", f"s3://{BUCKET}/e2e-artifacts", env) as server:
        run = subprocess.run(
            [sys.executable, "-m", "stoker.cli", "run", f"work_dir={tmp_path / 'work'}",
             f"checkpoint_dir=s3://{BUCKET}/e2e-jobs", f"data.repo_url={repo}", "data.rev=v1",
             "data.path=data/images", f"tracking.tracking_uri={server.uri}",
             "tracking.system_metrics_interval_s=null", "train.epochs=1",
             "train.global_batch_size=4", "train.checkpoint_every_steps=1"],
            env=env, capture_output=True, text=True, timeout=500, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        client = MlflowClient(server.uri)
        [version] = client.search_model_versions()
        source = client.get_model_version_download_uri(version.name, version.version)
        local = mlflow.artifacts.download_artifacts(  # through the server, from the bucket
            artifact_uri=source, dst_path=str(tmp_path / "model"), tracking_uri=server.uri)
        assert sorted(p.name for p in (tmp_path / "model").rglob("MLmodel")), (source, local)
    stored = keys_in(s3_env, "")
    assert [k for k in stored if k.startswith("e2e-dvc/files/md5/")]  # the data's remote
    assert [k for k in stored if k.startswith("e2e-artifacts/") and k.endswith("/MLmodel")]
    jobs = [k for k in stored if k.startswith("e2e-jobs/")]
    assert [k for k in jobs if "/checkpoints/step-" in k and k.endswith("/COMMITTED")]
    assert [k for k in jobs if k.endswith("/pipeline_done.json")]
    assert [k for k in jobs if k.endswith("/attempts.jsonl")]
    assert not [k for k in jobs if k.endswith("/lease.json")]
