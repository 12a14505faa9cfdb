"""Issue 43/44 follow-up: a value that git, DVC, ssh, Slurm or docker would read as an option
(it starts with ``-``) is refused by the config model itself, in one line naming its field, exit
2, before any server starts and before anything is written: `stoker run`, `show-config`, the
deployments' forms and the image request all get it. The runtime's ``--`` guards stay."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from stoker.cli import app
from stoker.config import ConfigError, load_pipeline_config, validate


@pytest.mark.parametrize(("value", "says"), [
    ("-oProxyCommand=touch {marker}", "written ./-oProxyCommand=touch "),
    ("--upload-pack=touch {marker}", "written ./--upload-pack=touch "),
    ("ssh://-oProxyCommand=touch {marker}/repo", "its host '-oProxyCommand=touch "),
    ("git@-oProxyCommand=x:repo", "its host '-oProxyCommand=x'"),
    ("ssh://-oProxyCommand=x@host/repo", "its user '-oProxyCommand=x'"),
])
def test_stoker_run_refuses_an_option_like_repo_url_at_config_time(tmp_path, value, says):
    """Trial: `-oProxyCommand=...` read as a missing folder, `ssh://-oProxy...` refused only
    inside the flow, after the Prefect server started and the work folder was made."""
    import os
    import subprocess
    import sys

    from prefect_server import seed_prefect_home

    marker = tmp_path / "pwned"
    work = tmp_path / "work"
    given = value.format(marker=marker)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    home = seed_prefect_home(tmp_path / "prefect")  # where a server would start (none must)
    result = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "run", f"work_dir={work}", f"data.repo_url={given}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**env, "PREFECT_HOME": str(home)})
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: data.repo_url: ") and "starts with '-'" in line, line
    assert says in line and "would read as an option" in line, line
    assert not work.exists() and not marker.exists()  # nothing written, nothing run
    assert "Prefect server" not in result.stderr  # refused before any server starts


@pytest.mark.parametrize(("override", "field"), [
    ("data.rev=--output=x", "data.rev"),
    ("data.path=-data", "data.path"),
    ("data.remote=-x", "data.remote"),
    ("launcher.slurm.python=-c", "launcher.slurm.python"),
    ("launcher.slurm.partition=--uid=0", "launcher.slurm.partition"),
    ("launcher.slurm.account=-x", "launcher.slurm.account"),
    ("launcher.slurm.qos=-x", "launcher.slurm.qos"),
    ("launcher.docker.image=--privileged", "launcher.docker.image"),
])
def test_other_values_given_to_commands_are_refused_the_same_way(override, field):
    with pytest.raises(ConfigError) as refused:
        load_pipeline_config(None, [override], environ={})
    message = str(refused.value)
    assert message.startswith(f"{field}: starts with '-'"), message
    assert len(message.splitlines()) == 1


def test_show_config_and_the_deployment_forms_refuse_it_too():
    from stoker.forms import PipelineForm, TrainForm

    shown = CliRunner().invoke(app, ["show-config", "data.repo_url=--upload-pack=x"])
    assert shown.exit_code == 2 and shown.output.startswith("error: data.repo_url: starts "
                                                            "with '-'"), shown.output
    for form in (TrainForm, PipelineForm):
        with pytest.raises(ValidationError, match=r"data\.repo_url: starts with '-'"):
            form(data={"repo_url": "--upload-pack=x"})
        with pytest.raises(ValidationError, match=r"data\.rev: starts with '-'"):
            form(data={"rev": "--output=x"})


@pytest.mark.parametrize("fields", [{"registry": "-x"}, {"base_image": "--privileged"}])
def test_the_image_request_refuses_an_option_like_registry_or_base(fields):
    from stoker.images.spec import ImageRequest, ImageSpec

    [(name, value)] = fields.items()
    with pytest.raises(ConfigError, match=rf"^image\.{name}: starts with '-'"):
        validate(ImageRequest, fields, prefix="image.")
    if name == "registry":  # the spec itself, whoever builds it
        with pytest.raises(ConfigError, match=r"^image\.registry: starts with '-'"):
            ImageSpec.from_matrix(registry=value)


def test_a_folder_whose_name_starts_with_a_dash_is_written_dot_slash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_pipeline_config(None, ["data.repo_url=./-name", "data.path=data/-x"],
                                  environ={})
    assert config.data.repo_url == str(tmp_path.resolve() / "-name")
    assert config.data.path == "data/-x"
    for url in ("git@github.com:org/data.git", "ssh://git@github.com/org/data.git",
                "https://github.com/org/data-set.git", "/srv/git/-data"):
        assert load_pipeline_config(None, [f"data.repo_url={url}"], environ={})


@pytest.mark.parametrize(("url", "says"), [
    ("ssh://[-oProxyCommand=x]/repo.git", "its host '-oProxyCommand=x]'"),
    ("ssh://%2DoProxyCommand=x/repo.git", "its host '-oProxyCommand=x'"),
    ("ssh://git@%2DoProxyCommand=x/repo.git", "its host '-oProxyCommand=x'"),
    ("ssh://git@[-oProxyCommand=x]:22/repo.git", "its host '-oProxyCommand=x]:22'"),
    ("ssh://%2Du@host/repo.git", "its user '-u'"),
])
def test_a_host_disguised_by_brackets_or_percent_encoding_is_refused_too(url, says):
    """Trial: a bracketed or percent-encoded host passed the config check; git decodes both,
    so only its own 'strange hostname' check stopped them, after the flow had started."""
    with pytest.raises(ConfigError) as refused:
        load_pipeline_config(None, [f"data.repo_url={url}"], environ={})
    message = str(refused.value)
    assert message.startswith("data.repo_url: ") and says in message, message
    assert len(message.splitlines()) == 1
