"""A credential inside a URL is never stored (issue 44): a tracking URI, a data repository URL
or a job store URL that carries one is refused at config time, in one line naming the field
and the variables that take the credential, the secret itself masked, exit 2, before anything
is created or pulled."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from stoker.cli import app
from stoker.config_base import masked_url, url_credentials

SECRET = "s3cr3t-t0ken"


@pytest.mark.parametrize(("override", "names"), [
    (f"tracking.tracking_uri=http://alice:{SECRET}@127.0.0.1:5000", "MLFLOW_TRACKING_PASSWORD"),
    (f"tracking.tracking_uri=postgresql://mlflow:{SECRET}@db/mlflow", "PGPASSWORD"),
    (f"data.repo_url=https://{SECRET}@github.com/org/data.git", "credential helper"),
    (f"data.repo_url=https://ci:{SECRET}@git.example/data.git", "GIT_ASKPASS"),
    (f"checkpoint_dir=s3://bucket/jobs?X-Amz-Signature={SECRET}", "AWS_SECRET_ACCESS_KEY"),
])
def test_a_url_with_a_credential_is_refused_before_anything_starts(tmp_path, override, names):
    work = tmp_path / "work"
    result = CliRunner().invoke(app, ["run", f"work_dir={work}", override])
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    field = override.split("=", 1)[0]
    assert line.startswith(f"error: {field}: holds ") and names in line, line
    assert SECRET not in result.output and "***" in line
    assert not work.exists()  # nothing created, nothing pulled


@pytest.mark.parametrize("url", [
    "git@github.com:org/data.git", "ssh://git@github.com/org/data.git", "/srv/git/data",
    "http://127.0.0.1:5000", "sqlite:///work/mlflow.db", "s3://bucket/jobs",
    "https://github.com/org/data.git?ref=main"])
def test_urls_without_credentials_pass(url):
    assert url_credentials(url) is None


def test_the_masked_form_keeps_what_tells_the_url_apart():
    assert masked_url(f"https://u:{SECRET}@host:8443/p?token={SECRET}&a=1") == \
        "https://***@host:8443/p?token=***&a=1"


def test_a_fragment_is_never_quoted_nor_sent():
    """`http://host/#token=...`: the fragment (a token pasted after '#') is not in the line
    that says no server answers, and the health request goes without it (trial: printed)."""
    from stoker.config_base import ConfigError, masked_url
    from stoker.tracking.server import check_tracking_server

    assert masked_url("http://127.0.0.1:1/#token=Sekrit42") == "http://127.0.0.1:1/#***"
    with pytest.raises(ConfigError) as refused:
        check_tracking_server("http://127.0.0.1:1/#token=Sekrit42", timeout_s=2)
    assert "Sekrit42" not in str(refused.value) and "no MLflow server answers" in str(
        refused.value)
