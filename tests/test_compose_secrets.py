"""The compose stack's secrets (issue 44): both servers ask for credentials, every password
comes from a file mounted as a Docker secret, none is in an ``environment:`` value or a command
line, and the tutorial's setup step creates every secret file the stack reads.

No image can be pulled here, so the rendered file is checked (``interpolate`` as compose does)
and each service's entrypoint shell line is run for real with ``/bin/sh`` against secret files
in a temporary folder, its final ``exec`` replaced by a probe that reports its argv and
environment."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from test_infra import COMPOSE, INFRA, ROOT, env_example, interpolate

TUTORIAL = ROOT / "docs" / "tutorials" / "self-hosted.md"
SECRET_LIKE = re.compile(r"PASSWORD|SECRET|AUTH_STRING|TOKEN|CREDENTIAL", re.I)
FROM_SECRET = re.compile(r"^\$\(cat /run/secrets/(\w+)\)$")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(interpolate(COMPOSE.read_text(), env_example()))


def shell_line(service: dict) -> str | None:
    """The script of an ``entrypoint: [/bin/sh, -c, SCRIPT]``, else None."""
    entrypoint = service.get("entrypoint") or []
    return entrypoint[2] if entrypoint[:2] == ["/bin/sh", "-c"] else None


def mounted(service: dict) -> set[str]:
    return {s if isinstance(s, str) else s["source"] for s in service.get("secrets") or []}


def test_no_password_in_an_environment_value_or_a_command_line(compose):
    for name, service in compose["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if SECRET_LIKE.search(key):
                assert key.endswith("_FILE") and str(value).startswith("/run/secrets/"), \
                    f"{name}: environment {key} holds a secret's value"
        for part in ("command", "entrypoint"):
            words = service.get(part) or []
            text = " ".join(words) if isinstance(words, list) else words
            for user_password in re.findall(r"://[^/@\s]*:([^/@\s]+)@", text):
                assert FROM_SECRET.match(user_password.strip('"')), f"{name}: {part}: a URL " \
                    "with a literal password"
            for key, value in re.findall(r"\b(\w+)=(\"[^\"]*\"|\S+)", text):
                if SECRET_LIKE.search(key):
                    assert FROM_SECRET.match(value.strip('"')), f"{name}: {part}: {key}"
    assert not [v for v in env_example() if SECRET_LIKE.search(v)], "a password in .env.example"


def test_every_secret_a_service_reads_is_mounted_and_declared_as_a_file(compose):
    declared = compose["secrets"]
    for name, service in compose["services"].items():
        read = set(re.findall(r"/run/secrets/(\w+)", json.dumps(service)))
        assert read <= mounted(service), f"{name}: reads {read - mounted(service)} unmounted"
        assert mounted(service) <= set(declared), name
    for name, secret in declared.items():
        assert secret == {"file": f"./secrets/{name}"}, name
    assert (INFRA / ".gitignore").read_text().splitlines().count("secrets/") == 1


def test_both_servers_require_credentials(compose, tmp_path, monkeypatch):
    prefect = shell_line(compose["services"]["prefect-server"])
    assert 'PREFECT_SERVER_API_AUTH_STRING="$(cat /run/secrets/prefect_api_auth_string)"' in \
        prefect
    mlflow = compose["services"]["mlflow"]
    assert "exec mlflow server --app-name basic-auth " in shell_line(mlflow)
    dockerfile = (INFRA / "mlflow" / "Dockerfile").read_text()
    assert re.search(r'"Flask-WTF>=[\d.]+,<\d+"', dockerfile), "the auth app needs Flask-WTF"
    ini = mlflow["environment"]["MLFLOW_AUTH_CONFIG_PATH"]
    assert f"COPY basic_auth.ini {ini}" in dockerfile
    # MLflow's own reader: the admin password comes from the variable, none is in the file.
    from mlflow.server.auth.config import read_auth_config

    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(INFRA / "mlflow" / "basic_auth.ini"))
    monkeypatch.delenv("MLFLOW_AUTH_ADMIN_PASSWORD", raising=False)
    assert read_auth_config().admin_password is None
    monkeypatch.setenv("MLFLOW_AUTH_ADMIN_PASSWORD", "from-the-secret")
    config = read_auth_config()
    assert (config.admin_username, config.admin_password) == ("admin", "from-the-secret")
    store = config.database_uri.removeprefix("sqlite:///").rsplit("/", 1)[0]
    assert f"mlflow-auth:{store}" in mlflow["volumes"]  # users survive a restart


PROBE = """#!{python}
import json, os, sys
with open({calls!r}, "a") as f:
    f.write(json.dumps({{"argv": sys.argv, "env": dict(os.environ)}}) + "\\n")
"""


@pytest.mark.parametrize("name", ["prefect-server", "minio", "minio-buckets", "mlflow"])
def test_each_entrypoint_reads_its_secrets_from_the_files_and_puts_none_on_a_command_line(
        compose, tmp_path, name):
    service = compose["services"][name]
    values = {s: f"{s}-value-{i}" for i, s in enumerate(sorted(mounted(service)))}
    assert values, f"{name} reads no secret"
    secrets, bin_dir, calls = tmp_path / "secrets", tmp_path / "bin", tmp_path / "calls.jsonl"
    secrets.mkdir()
    bin_dir.mkdir()
    for secret, value in values.items():
        (secrets / secret).write_text(value)
    for program in ("prefect", "minio", "mc", "mlflow"):  # stand-ins that record their call
        (bin_dir / program).write_text(PROBE.format(python=sys.executable, calls=str(calls)))
        (bin_dir / program).chmod(0o700)
    script = shell_line(service).replace("/run/secrets/", f"{secrets}/")
    env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
    done = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env}, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    assert seen, f"{name}: its program never ran"
    for call in seen:
        argv = " ".join(call["argv"])
        assert not [v for v in values.values() if v in argv], f"{name}: a secret in argv: {argv}"
    environment = " ".join(seen[0]["env"].values())
    assert all(v in environment for v in values.values()), \
        f"{name}: not every secret reached its program's environment"


def test_the_setup_step_creates_every_secret_file(compose):
    text = TUTORIAL.read_text()
    created = set(re.findall(r"> *infra/secrets/(\w+)", text))
    assert created == set(compose["secrets"]), created ^ set(compose["secrets"])
    for variable in ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME",
                     "MLFLOW_TRACKING_PASSWORD"):
        assert variable in text, f"the tutorial does not say how clients pass {variable}"
