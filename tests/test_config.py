import os

import pytest
from local_servers import marked_processes

from stoker.config import ConfigError, PipelineConfig, TrainConfig, load_pipeline_config


def test_defaults_are_valid_and_run_on_cpu():
    config = PipelineConfig()
    assert config.train.precision == "fp32"
    assert config.tracking_uri().startswith("sqlite:///")
    assert config.tracking_uri().endswith("/work/mlflow.db")


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  epochs: 5\n  lr: 0.01\ndata:\n  rev: v2\n")
    config = load_pipeline_config(path, ["train.epochs=7", "tracking.experiment=exp"])
    assert config.train.epochs == 7  # the command line wins over the file
    assert config.train.lr == 0.01
    assert config.data.rev == "v2"
    assert config.tracking.experiment == "exp"


@pytest.mark.parametrize(("override", "field"), [
    ("train.lr=-1", "train.lr"),
    ("train.epochs=0", "train.epochs"),
    ("train.precision=fp8", "train.precision"),
    ("train.nproc_per_node=0", "train.nproc_per_node"),
    ("data.rev=", "data.rev"),
    ("train.val_fraction=1.5", "train.val_fraction"),
    ("train.unknown=1", "train.unknown"),
])
def test_invalid_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(None, [override])
    assert str(info.value).startswith(f"{field}:")


def test_error_shows_the_bad_value():
    with pytest.raises(ConfigError, match=r"train.lr: .*greater than 0, got -1"):
        load_pipeline_config(None, ["train.lr=-1"])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="expected field=value"):
        load_pipeline_config(None, ["train.epochs"])
    with pytest.raises(ConfigError, match="not found"):
        load_pipeline_config(tmp_path / "nope.yaml", [])
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: {epochs: 3\n  lr: [\n")
    with pytest.raises(ConfigError, match="broken.yaml: not valid YAML"):
        load_pipeline_config(broken, [])
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_pipeline_config(bad, [])


def test_batch_must_split_into_micro_batches():
    with pytest.raises(ValueError, match="multiple of grad_accum_steps"):
        TrainConfig(global_batch_size=64, grad_accum_steps=3)


def test_configs_are_frozen():
    config = PipelineConfig()
    with pytest.raises(ValueError):
        config.train.epochs = 3  # type: ignore[misc]


@pytest.mark.parametrize(("override", "field"), [
    ("train.lr=inf", "train.lr"), ("train.lr=nan", "train.lr"),
    ("train.model=bogus", "train.model"),
])
def test_infinite_rates_and_unknown_models_are_refused_before_anything_runs(override, field):
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(None, [override])
    assert str(info.value).startswith(f"{field}:")


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.global_batch_size=7", "train.nproc_per_node=2"],
     "train.global_batch_size: must be a multiple of grad_accum_steps (1) x processes (2) = 2, "
     "got 7"),
    (["train.global_batch_size=64", "train.grad_accum_steps=3"],
     "train.global_batch_size: must be a multiple of grad_accum_steps (3), got 64"),
    (["launcher.kind=docker"], "tracking.tracking_uri: launcher.kind=docker logs from containers"),
    (["launcher.kind=kubernetes"],
     "tracking.tracking_uri: launcher.kind=kubernetes logs from containers"),
    (["tracking.tracking_uri=garbage://x"], "tracking.tracking_uri: unsupported scheme 'garbage'"),
    (["tracking.ui_url=ftp://x"], "tracking.ui_url: unsupported scheme 'ftp'"),
    (["train.checkpoint_every_steps=null"], "train.checkpoint_every_steps: set it or"),
])
def test_cross_field_rules_are_checked_at_config_time(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(None, overrides)
    assert str(info.value).startswith(message)
    assert "; " not in str(info.value)  # one error, said once


def test_accepted_tracking_stores():
    for uri in ("http://127.0.0.1:5000", "sqlite:////tmp/m.db", "postgresql+psycopg2://u@h/db",
                "/tmp/mlruns"):
        assert load_pipeline_config(None, [f"tracking.tracking_uri={uri}"])


def test_a_union_field_error_is_said_once():
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(None, ["train.nproc_per_node=0"])
    assert str(info.value) == "train.nproc_per_node: must be > 0 or 'auto', got 0"


def test_show_config_refuses_an_invalid_combination_in_one_line():
    from typer.testing import CliRunner

    from stoker.cli import app

    result = CliRunner().invoke(app, ["show-config", "launcher.kind=docker"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        line for line in result.output.strip().splitlines() if line.startswith("error: ")]
    assert "tracking.tracking_uri" in result.output


@pytest.mark.parametrize("override", ["train.epochs=true", "train.lr=false",
                                      "train.preemption_grace_s=true", "train.profile_steps=true"])
def test_a_boolean_for_a_number_is_refused(override):
    """YAML reads `true` as a boolean; pydantic would have trained `train.epochs=true` 1 epoch."""
    field, value = override.split("=")
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(None, [override])
    assert str(info.value) == f"{field}: expected a number, got {value}"


def test_a_number_for_a_switch_still_reads_as_one():
    assert load_pipeline_config(None, ["train.async_checkpoint=1"]).train.async_checkpoint is True


def test_show_config_names_the_folder_a_relative_work_dir_is(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from stoker.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["show-config", "work_dir=runs/w"])
    assert result.exit_code == 0, result.output
    first, second = result.output.splitlines()[:2]
    assert first == f"# work_dir runs/w is {tmp_path.resolve() / 'runs/w'} from here"
    assert second == "work_dir: runs/w"


def test_work_dir_is_an_option_and_an_override_alike(tmp_path, monkeypatch):
    """QA: `stoker run work_dir=X` but `stoker status --work-dir X`; neither hinted at the other.
    `run` and `show-config` take --work-dir too; a job command given work_dir=X names the
    option (exit 2), and two different folders are refused."""
    from typer.testing import CliRunner

    from stoker.cli import app

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["show-config", "--work-dir", "runs/w"])
    assert result.exit_code == 0, result.output
    assert "work_dir: runs/w" in result.output.splitlines()
    same = runner.invoke(app, ["show-config", "-w", "runs/w", "work_dir=runs/w"])
    assert same.exit_code == 0, same.output
    both = runner.invoke(app, ["show-config", "--work-dir", "a", "work_dir=b"])
    assert both.exit_code == 2
    assert both.output.strip() == ("error: --work-dir a and work_dir=b name different folders; "
                                   "give one")
    for command in (["status", "work_dir=runs/w"], ["logs", "work_dir=runs/w"]):
        wrong = runner.invoke(app, command)
        assert wrong.exit_code == 2, wrong.output
        assert wrong.output.strip() == ("error: 'work_dir=runs/w' is not a job name; this "
                                        "command takes the work folder as --work-dir runs/w")


def test_a_dead_tracking_server_is_named_before_the_pull(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "run", f"work_dir={tmp_path / 'work'}",
         f"tracking.tracking_uri=http://127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"error: tracking.tracking_uri: no MLflow server answers at "
                                     f"http://127.0.0.1:{port} (All connection attempts failed)"
                                     ) or "no MLflow server answers" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "work" / "datasets").exists()  # nothing pulled


def test_a_missing_data_repository_is_named_before_anything_runs(tmp_path):
    """One line, exit 2, nothing made; the relative-path hint only where the value may have
    been relative (trial: an absolute ``file://`` URL got it too)."""
    import subprocess
    import sys

    from stoker.launch.factory import check_before_pull

    missing = tmp_path / "no-such-repo"
    result = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "run", f"work_dir={tmp_path / 'work'}",
         "data.repo_url=no-such-repo"], capture_output=True, text=True, timeout=120,
        cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: data.repo_url: {missing} is not a folder (a relative path is resolved against "
        f"the directory stoker runs in, {tmp_path}: give an absolute path)"]
    assert not (tmp_path / "work").exists()
    # The hint follows how the value was typed, not where it lands (trial: an absolute path
    # under the current directory got it, `../nope` from a subfolder did not).
    sub = tmp_path / "sub"
    sub.mkdir()
    cwd = os.getcwd()
    try:
        for where, value, hinted in [(tmp_path, str(missing), False),
                                     (tmp_path, f"file://{missing}", False),
                                     (sub, str(missing), False),
                                     (sub, "../no-such-repo", True)]:
            os.chdir(where)
            config = load_pipeline_config(None, [f"data.repo_url={value}"])
            with pytest.raises(ConfigError) as error:
                check_before_pull(config)
            hint = (" (a relative path is resolved against the directory stoker runs in, "
                    f"{where}: give an absolute path)" if hinted else "")
            assert str(error.value) == f"data.repo_url: {missing} is not a folder{hint}", value
    finally:
        os.chdir(cwd)
    # A config read back from its dump (Prefect's parameters) knows only the resolved path.
    again = type(config).model_validate(config.model_dump())
    assert not again.data.repo_url_was_relative and config.data.repo_url_was_relative


def test_a_data_repository_git_cannot_clone_is_named_before_anything_runs(tmp_path, monkeypatch):
    """Trial: ``file://nope`` passed the early check and the clone then named the current folder;
    ``file://nope/x`` dropped the host; a folder that is not a git repository started a flow run
    whose error said it "does not exist"; an empty ``data.repo_url`` with the user's own
    ``data.path`` failed on the demo repository, which the user never named."""
    import subprocess

    from typer.testing import CliRunner

    from stoker.cli import app
    from stoker.launch.factory import check_before_pull

    monkeypatch.chdir(tmp_path)
    for value, why in [("file://nope", "a file URL must not name a host (here 'nope')"),
                       ("file://nope/x", "a file URL must not name a host (here 'nope')"),
                       ("file://", "a file URL without a path")]:
        result = CliRunner().invoke(app, ["run", f"data.repo_url={value}"])
        assert result.exit_code == 2, value
        assert result.output.strip().splitlines() == [f"error: data.repo_url: {why}: give "
            f"file:///absolute/path{' or a plain path' if 'host' in why else ''}, got {value!r}"]
    outer = tmp_path / "outer"
    (outer / "plain").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    subprocess.run(["git", "init", "-q", "--bare", str(tmp_path / "bare.git")], check=True)
    for plain in [tmp_path / "outer" / "plain", tmp_path / "plain"]:  # inside a repository or not
        plain.mkdir(exist_ok=True)
        result = CliRunner().invoke(app, ["run", f"data.repo_url={plain}"])
        assert result.exit_code == 2
        assert result.output.strip().splitlines() == [
            f"error: data.repo_url: {plain} is not a git repository (no .git in it, not a bare "
            "repository)"]
    from stoker.data.pull import is_git_repository

    assert is_git_repository(outer) and is_git_repository(tmp_path / "bare.git")
    for given in ([], ["data.repo_url="]):
        config = load_pipeline_config(None, [*given, "data.path=images/fruit"])
        with pytest.raises(ConfigError) as error:
            check_before_pull(config)
        assert str(error.value) == (
            "data.path images/fruit: data.repo_url is empty, so the data is the demo "
            "repository's, which tracks only data/digits; set data.repo_url to your repository")
    assert not (tmp_path / "work").exists()  # nothing started, nothing pulled
    escaped = load_pipeline_config(None, [f"data.repo_url=file://localhost{tmp_path}/my%20repo"])
    assert escaped.data.repo_url == str(tmp_path / "my repo")


def test_a_data_error_inside_the_flow_ends_in_one_line_without_tracebacks(tmp_path):
    """A repository that cannot be cloned (here: nothing answers on its loopback port; a local
    folder is checked before the flow) fails in the pull task: no traceback in the terminal
    (the Prefect task log keeps it), the last line names it, exit 2."""
    import os
    import subprocess
    import sys

    from prefect_server import seed_prefect_home

    unreachable = "http://127.0.0.1:9/none.git"  # port 9 (discard): refused at once
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    mark = {"STOKER_TEST_MARK": str(tmp_path)}  # inherited by every process the command starts
    seed_prefect_home(tmp_path / "prefect")
    result = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "run", f"work_dir={tmp_path / 'work'}",
         f"data.repo_url={unreachable}"], capture_output=True, text=True,
        timeout=300, env={**env, "PREFECT_HOME": str(tmp_path / "prefect"), **mark})
    assert result.returncode == 2, result.stderr[-3000:]
    # The launcher started ahead of the flow (the standby) is ended with the command: nothing
    # trained, nothing left running but the long-lived local Prefect server.
    assert marked_processes(str(tmp_path)) == []
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: data.repo_url {unreachable}: cannot clone: fatal: "), last
    assert len(result.stderr.splitlines()) < 30


def test_one_experiment_per_registered_model_unless_configured(tmp_path):
    assert PipelineConfig().experiment() == "stoker-digits"  # the demo's model
    repo = tmp_path / "flowers"
    repo.mkdir()
    mine = load_pipeline_config(None, [f"data.repo_url={repo}", "data.path=images"])
    assert mine.experiment() == mine.registered_model() == "flowers-images"
    named = load_pipeline_config(None, ["tracking.experiment=shared"])
    assert named.experiment() == "shared"



@pytest.mark.parametrize("override, line", [
    ("train.epoch=3", "train.epoch: unknown field; did you mean 'epochs'?"),
    ("tracking.trackng_uri=x", "tracking.trackng_uri: unknown field; did you mean 'tracking_uri'?"),
    ("bogus=1", "bogus: unknown field"),
    ("data.rev=2024", "data.rev: Input should be a valid string, got 2024 (YAML read it as a "
                      "number: quote it, e.g. data.rev=\"'2024'\")"),
])
def test_a_typo_or_a_number_for_a_string_says_what_to_write(override, line):
    """A new user's `train.epoch=3` said only "unknown field"; `data.rev=2024` gave no hint."""
    with pytest.raises(ConfigError) as error:
        load_pipeline_config(None, [override])
    assert str(error.value) == line


@pytest.mark.parametrize("given", ["data/fruit/", "./data/fruit", "data/fruit.dvc",
                                   " data/fruit "])
def test_data_path_names_the_tracked_directory_however_it_is_typed(given):
    """New-user trial: a trailing slash (tab completion) or the directory's .dvc file gave
    `no data/fruit/.dvc` / `no data/fruit.dvc.dvc`; they name the same dataset."""
    assert load_pipeline_config(None, [f"data.path={given}"]).data.path == "data/fruit"


@pytest.mark.parametrize("given", ["../etc/passwd", "/etc", "data/../../elsewhere", "."])
def test_a_data_path_outside_the_repository_is_refused_in_one_line(given, tmp_path):
    """An external value is untrusted: a path that climbs out of the repository is refused at
    config time, exit 2, one line, nothing created."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "run", f"work_dir={tmp_path / 'work'}",
         f"data.path={given}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: data.path: ") and repr(given) in line, line
    assert not (tmp_path / "work").exists()


def test_show_config_shows_the_tracking_uri_a_run_uses(tmp_path, monkeypatch):
    """New-user trial: `show-config` printed `tracking_uri: null`; it shows what `stoker run`
    uses (PipelineConfig.tracking_uri()): the default store in the work folder, or the one set."""
    import yaml
    from typer.testing import CliRunner

    from stoker.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["show-config", "work_dir=runs/w"])
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.output)["tracking"]["tracking_uri"]
    assert shown == f"sqlite:///{tmp_path.resolve() / 'runs/w/mlflow.db'}"
    assert shown == load_pipeline_config(None, ["work_dir=runs/w"]).tracking_uri()
    assert "# tracking.tracking_uri is not set" in result.output
    given = CliRunner().invoke(app, ["show-config", "tracking.tracking_uri=http://127.0.0.1:5000"])
    assert given.exit_code == 0, given.output
    assert yaml.safe_load(given.output)["tracking"]["tracking_uri"] == "http://127.0.0.1:5000"
    assert "tracking.tracking_uri is not set" not in given.output


@pytest.mark.parametrize(("given", "read"), [("0", "0"), ("2", "2"), ("all", "all"),
                                             ("'0'", "0")])  # the shell's "'0'"
def test_docker_gpus_takes_a_count_as_written(given, read):
    """New-user trial: `launcher.docker.gpus=0`, the field's own documented CPU value, was
    refused ("Input should be a valid string, got 0"): only the quoted `"'0'"` passed."""
    assert load_pipeline_config(None, [f"launcher.docker.gpus={given}"]).launcher.docker.gpus \
        == read


@pytest.mark.parametrize("given", ["two", "-1", "1.5", "true"])
def test_docker_gpus_other_than_all_or_a_count_is_one_line(given):
    with pytest.raises(ConfigError) as error:
        load_pipeline_config(None, [f"launcher.docker.gpus={given}"])
    assert str(error.value).startswith("launcher.docker.gpus: ") and "\n" not in str(error.value)


def test_a_docker_engine_without_a_gpu_runtime_says_to_set_gpus_0():
    """New-user trial on a CPU host: the engine's own error (`could not select device driver ""
    with capabilities: [[gpu]]`) named neither the field nor the fix."""
    from stoker.launch.docker import _gpu_hint

    engine = RuntimeError('500 Server Error: ("could not select device driver "" with '
                          'capabilities: [[gpu]]")')
    assert "launcher.docker.gpus=0" in _gpu_hint(engine, "all")
    assert _gpu_hint(engine, "0") == ""
    assert _gpu_hint(RuntimeError("no such image"), "all") == ""
