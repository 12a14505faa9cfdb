import pytest

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
