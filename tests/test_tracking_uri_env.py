"""MLFLOW_TRACKING_URI is the default of tracking.tracking_uri (issue 46.8): an MLflow user who
exported it found `stoker run` and `show-config` on the local sqlite store instead."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from stoker.cli import app
from stoker.config import load_pipeline_config

SERVER = "http://127.0.0.1:5099"


def test_the_variable_is_the_default_and_an_explicit_value_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", SERVER)
    assert load_pipeline_config().tracking_uri() == SERVER
    assert load_pipeline_config(environ={}).tracking.tracking_uri is None
    given = "sqlite:///elsewhere.db"
    assert load_pipeline_config(None, [f"tracking.tracking_uri={given}"]).tracking_uri() == given
    (tmp_path / "c.yaml").write_text(f"tracking:\n  tracking_uri: {given}\n")
    assert load_pipeline_config(tmp_path / "c.yaml").tracking_uri() == given
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "  ")  # blank: unset
    assert load_pipeline_config().tracking.tracking_uri is None


def test_show_config_shows_the_variable_and_says_it_came_from_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", SERVER)
    result = CliRunner().invoke(app, ["show-config"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.output)["tracking"]["tracking_uri"] == SERVER
    assert "a run uses MLFLOW_TRACKING_URI of the environment" in result.output
    given = CliRunner().invoke(app, ["show-config", "tracking.tracking_uri=sqlite:///x.db"])
    assert yaml.safe_load(given.output)["tracking"]["tracking_uri"] == "sqlite:///x.db"
    assert "MLFLOW_TRACKING_URI" not in given.output


def test_credentials_in_the_variable_stay_refused_without_showing_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:s3cret@127.0.0.1:5099")
    result = CliRunner().invoke(app, ["show-config"])
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: tracking.tracking_uri: ") and "s3cret" not in line, line
    assert "MLFLOW_TRACKING_URI is set: it is the default of tracking.tracking_uri" in line, line
