"""Pre-flight against real servers with auth on: a Prefect server started with
PREFECT_SERVER_API_AUTH_STRING and an ``mlflow server --app-name basic-auth``. A missing or wrong
credential is one line naming the server and the variable, exit 2, before anything is created or
started; the right one trains, and what it logged is read back from the server."""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from mlflow_server import MlflowServer, free_port
from prefect_server import PrefectServer

from stoker.server_auth import CredentialError, check_mlflow_server, check_prefect_api

pytestmark = pytest.mark.integration

PREFECT_SECRET = f"prefect-{secrets.token_hex(8)}"
MLFLOW_SECRET = f"mlflow-{secrets.token_hex(8)}"
CREDENTIAL_VARS = ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_API_KEY",
                   "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                   "MLFLOW_TRACKING_TOKEN", "PREFECT_HOME")


@pytest.fixture(scope="module")
def prefect_auth(tmp_path_factory):
    """A real Prefect server that asks for PREFECT_SERVER_API_AUTH_STRING (one per module)."""
    root = tmp_path_factory.mktemp("prefect-auth")
    with PrefectServer(root, env={"PREFECT_SERVER_API_AUTH_STRING": PREFECT_SECRET}) as server:
        yield server


@pytest.fixture(scope="module")
def mlflow_auth(tmp_path_factory):
    """A real ``mlflow server --app-name basic-auth``: user ``admin``, password MLFLOW_SECRET."""
    root = tmp_path_factory.mktemp("mlflow-auth")
    config = root / "basic_auth.ini"
    config.write_text("[mlflow]\ndefault_permission = READ\n"
                      f"database_uri = sqlite:///{root / 'basic_auth.db'}\n"
                      f"admin_username = admin\nadmin_password = {MLFLOW_SECRET}\n"
                      "authorization_function = mlflow.server.auth:"
                      "authenticate_request_basic_auth\n")
    with MlflowServer(root / "server", env={"MLFLOW_AUTH_CONFIG_PATH": str(config),
                                                "MLFLOW_FLASK_SERVER_SECRET_KEY":
                                                secrets.token_hex(16)},
                      args=("--app-name", "basic-auth")) as server:
        yield server


def stoker(work: Path, *args: str, timeout: float = 120, **env: str):
    """``stoker ARGS`` with only the credentials in ``env`` (none inherited)."""
    base = {k: v for k, v in os.environ.items() if k not in CREDENTIAL_VARS}
    return subprocess.run([sys.executable, "-m", "stoker.cli", *args], env={**base, **env},
                          cwd=work.parent, capture_output=True, text=True, timeout=timeout)


def assert_refused(result, url: str, variable: str, work: Path) -> None:
    """Exit 2, one line naming the server and the variable, no secret, nothing created."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and url in lines[0] and variable in lines[0], output
    for secret in (PREFECT_SECRET, MLFLOW_SECRET, "wrong-"):
        assert secret not in output
    assert not work.exists(), sorted(work.rglob("*"))  # no work folder, job, server or log


@pytest.mark.parametrize("given", [{}, {"PREFECT_API_AUTH_STRING": "wrong-auth-string"}],
                         ids=["missing", "wrong"])
def test_stoker_run_refuses_a_prefect_credential_in_one_line(prefect_auth, tmp_path, given):
    work = tmp_path / "work"
    result = stoker(work, "run", f"work_dir={work}", PREFECT_API_URL=prefect_auth.api_url,
                    **given)
    assert_refused(result, prefect_auth.api_url, "PREFECT_API_AUTH_STRING", work)
    assert ("refused the credential in PREFECT_API_AUTH_STRING" in result.stderr) == bool(given)


@pytest.mark.parametrize("given", [
    {}, {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": "wrong-password"},
    {"MLFLOW_TRACKING_TOKEN": "wrong-token"}], ids=["missing", "wrong", "wrong-token"])
def test_stoker_run_refuses_an_mlflow_credential_in_one_line(mlflow_auth, tmp_path, given):
    work = tmp_path / "work"
    uri = mlflow_auth.uri
    result = stoker(work, "run", f"work_dir={work}", f"tracking.tracking_uri={uri}", **given)
    variable = next(iter(given), "MLFLOW_TRACKING_USERNAME")
    assert_refused(result, uri, variable, work)


def test_stoker_predict_refuses_a_missing_mlflow_credential(mlflow_auth, tmp_path):
    image = tmp_path / "digit.png"
    image.write_bytes(b"not read: the server is asked first")
    result = stoker(tmp_path / "work", "predict", str(image), "--tracking-uri", mlflow_auth.uri)
    assert_refused(result, mlflow_auth.uri, "MLFLOW_TRACKING_USERNAME", tmp_path / "work")


def test_stoker_predict_refuses_a_credential_inside_its_url(mlflow_auth, tmp_path):
    """`--tracking-uri http://admin:SECRET@host` is refused as `stoker run` refuses it, the
    secret masked (trial: predict used it, and blamed the variables when it was wrong)."""
    image = tmp_path / "digit.png"
    image.write_bytes(b"not read")
    host = mlflow_auth.uri.removeprefix("http://")
    result = stoker(tmp_path / "work", "predict", str(image), "--tracking-uri",
                    f"http://admin:{MLFLOW_SECRET}@{host}")
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: --tracking-uri holds ") and "MLFLOW_TRACKING_PASSWORD" in line
    assert MLFLOW_SECRET not in result.stdout + result.stderr


def test_the_right_credentials_pass_and_a_run_logs_to_the_servers(prefect_auth, mlflow_auth,
                                                                    tmp_path):
    """Both servers take the credentials: a short `stoker run` trains, its metrics are on the
    MLflow server (read back with the credential) and its flow run on the Prefect server; no
    file of the work folder and no line of the output holds either secret."""
    from mlflow import MlflowClient

    credentials = {"PREFECT_API_URL": prefect_auth.api_url,
                   "PREFECT_API_AUTH_STRING": PREFECT_SECRET,
                   "MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": MLFLOW_SECRET}
    work = tmp_path / "work"
    result = stoker(work, "run", f"work_dir={work}", "train.epochs=1",
                    f"tracking.tracking_uri={mlflow_auth.uri}",
                    "tracking.system_metrics_interval_s=null", timeout=600, **credentials)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert PREFECT_SECRET not in output and MLFLOW_SECRET not in output
    # The run's link, once, in the log (trials: each end of the run printed MLflow's links,
    # rank 0's and registration's, and on stdout, where the JSON summary no longer parsed).
    assert "View run " not in output and "View experiment at" not in output, output
    json.loads(result.stdout)
    [link] = [line for line in result.stderr.splitlines() if "MLflow run: " in line]
    assert link.split("MLflow run: ")[1].startswith(f"{mlflow_auth.uri}/#/experiments/")
    for path in (p for p in work.rglob("*") if p.is_file()):
        data = path.read_bytes()
        assert PREFECT_SECRET.encode() not in data and MLFLOW_SECRET.encode() not in data, path

    run_id = next((work / "jobs").glob("*/mlflow_run_id")).read_text().strip()
    os.environ.update({k: v for k, v in credentials.items() if k.startswith("MLFLOW")})
    try:
        history = MlflowClient(mlflow_auth.uri).get_metric_history(run_id, "train_loss")
        owner = MlflowClient(mlflow_auth.uri).get_run(run_id).info.user_id
    finally:
        for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            os.environ.pop(name, None)
    assert history and history[-1].step == 22  # one epoch of the demo: 22 steps
    assert owner == "admin"  # the server's user owns the run (trial: "unknown")
    url = f"{prefect_auth.api_url}/flow_runs/filter"
    assert httpx.post(url, json={}, timeout=30).status_code == 401  # the server asks, really
    token = base64.b64encode(PREFECT_SECRET.encode()).decode()
    runs = httpx.post(url, json={}, headers={"Authorization": f"Basic {token}"}, timeout=30)
    assert [r["state_type"] for r in runs.json()] == ["COMPLETED"], runs.text


def test_the_checks_read_the_right_credentials_from_the_environment(prefect_auth, mlflow_auth,
                                                                     monkeypatch, tmp_path):
    """From the environment, or from the active Prefect profile (read without importing
    Prefect, whose settings would then miss the PREFECT_HOME that `stoker run` sets later)."""
    for name in CREDENTIAL_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_PROFILES_PATH", str(tmp_path / "profiles.toml"))
    (tmp_path / "profiles.toml").write_text(
        f'active = "team"\n[profiles.team]\nPREFECT_API_AUTH_STRING = "{PREFECT_SECRET}"\n')
    check_prefect_api(prefect_auth.api_url)
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "wrong-auth-string")  # the environment wins
    with pytest.raises(CredentialError, match="PREFECT_API_AUTH_STRING") as refused:
        check_prefect_api(prefect_auth.api_url)
    assert "wrong-auth-string" not in str(refused.value)
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", PREFECT_SECRET)
    check_prefect_api(prefect_auth.api_url)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", MLFLOW_SECRET)
    check_mlflow_server(mlflow_auth.uri)


def test_a_server_that_is_down_is_left_to_the_existing_checks():
    """No answer is not a credential problem: the checks pass, and `check_tracking_server` (a
    dead tracking server, exit 2) or Prefect's client (a dead PREFECT_API_URL) say it as before."""
    dead = f"http://127.0.0.1:{free_port()}"
    check_prefect_api(f"{dead}/api", timeout_s=2)
    check_mlflow_server(dead, timeout_s=2)


def test_the_server_is_named_without_its_userinfo():
    from stoker.server_auth import public_url

    assert public_url("http://bob:pw@host:5000/api") == "http://host:5000/api"
    assert public_url("https://[::1]:443/") == "https://[::1]:443/"


@pytest.mark.parametrize("flow_module", ["flows.pipeline", "flows.train"])
def test_the_flows_first_step_refuses_a_missing_mlflow_credential(mlflow_auth, tmp_path,
                                                                   monkeypatch, flow_module):
    """A deployment's run on a worker (no `stoker run` before it): the flow's first step says
    it, before the work folder, the job's lease or the pull."""
    import importlib

    from stoker.config import load_pipeline_config
    from stoker.images.spec import ImageRequest

    for name in CREDENTIAL_VARS[3:6]:
        monkeypatch.delenv(name, raising=False)
    work = tmp_path / "work"
    config = load_pipeline_config(None, [f"work_dir={work}", "job_id=team-job",
                                         f"tracking.tracking_uri={mlflow_auth.uri}"])
    module = importlib.import_module(flow_module)
    steps = module.run_pipeline if flow_module == "flows.pipeline" else module.run_training
    with pytest.raises(CredentialError, match="MLFLOW_TRACKING_USERNAME") as refused:
        steps(config, ImageRequest())
    assert str(refused.value).startswith(f"MLflow tracking server {mlflow_auth.uri} asks for")
    assert not work.exists()


def test_the_check_imports_no_prefect(prefect_auth):
    """Prefect's settings freeze at its import: imported by the check, they missed the
    PREFECT_HOME (``<work_dir>/.prefect``) that `stoker run` sets after it."""
    probe = ("import sys\nfrom stoker.server_auth import check_servers\n"
             "check_servers('sqlite:///unused.db')\nprint('prefect' in sys.modules)")
    env = {**os.environ, "PREFECT_API_URL": prefect_auth.api_url,
           "PREFECT_API_AUTH_STRING": PREFECT_SECRET}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                            text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"


def test_docker_containers_get_the_tracking_credential_by_name(tmp_path, monkeypatch):
    """A Docker launcher's ranks log to a tracking server that asks who they are: the
    containers get MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN from this environment (they got only
    the AWS variables), and nothing for a sqlite store."""
    from stoker.config import load_pipeline_config
    from stoker.launch.factory import tracking_environment

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret")
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN", raising=False)
    http = load_pipeline_config(None, [f"work_dir={tmp_path}", "launcher.kind=docker",
                                       "tracking.tracking_uri=http://127.0.0.1:5999"])
    assert tracking_environment(http) == {"MLFLOW_TRACKING_USERNAME": "alice",
                                          "MLFLOW_TRACKING_PASSWORD": "s3cret"}
    local = load_pipeline_config(None, [f"work_dir={tmp_path}"])
    assert tracking_environment(local) == {}
