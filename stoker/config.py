"""Typed, validated configuration for the pipeline and the training runtime.

Every model is frozen; defaults run on a laptop CPU. A config comes from defaults, then an optional
YAML file, then dotted command-line overrides (``train.epochs=3``), merged by OmegaConf and
validated by pydantic. Errors name the field: ``train.lr: must be > 0, got -1``.

This module imports no Prefect: the training runtime uses it inside the training container.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from pydantic import (
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from stoker.config_base import (  # noqa: F401 - re-exported: stoker.config is the config's face
    ConfigError,
    _Frozen,
    format_validation_error,
    load_config,
    refuse_option_like,
    refuse_option_like_host,
    refuse_url_credentials,
    validate,
)
from stoker.config_runs import (  # noqa: F401 - re-exported
    CostConfig,
    DockerLauncherConfig,
    LauncherConfig,
    RetryConfig,
    SlurmLauncherConfig,
)
from stoker.config_train import (  # noqa: F401
    HangConfig,
    StragglerConfig,
    TrainConfig,
    check_batch,
)
from stoker.runtime.listing import control_characters

_SCP_LIKE = re.compile(r"^[\w.-]+@[\w.-]+:")  # git@github.com:owner/repo.git


def is_local(url: str) -> bool:
    """Whether ``url`` names a local path (not ``scheme://`` nor ``user@host:path``)."""
    return "://" not in url and not _SCP_LIKE.match(url)


def resolve_repo_url(url: str, cwd: Path | None = None) -> str:
    """An absolute path for a local repository path (``src``, ``./src``, ``~/repo``,
    ``file:///abs``, ``file://localhost/abs``; percent-escapes decoded), resolved against ``cwd``
    (default: the current directory); URLs unchanged.

    Raises:
        ValueError: a ``file://`` URL that names another host (``file://nope/x``) or no path.
    """
    if url.startswith("file://"):
        parts = urlparse(url)
        if parts.netloc not in ("", "localhost"):  # git would read file://nope as the cwd
            raise ValueError(f"a file URL must not name a host (here {parts.netloc!r}): give "
                             "file:///absolute/path or a plain path")
        if not parts.path:
            raise ValueError("a file URL without a path: give file:///absolute/path")
        return str(Path(unquote(parts.path)).resolve())
    if not is_local(url):
        return url
    return str((Path(cwd or os.getcwd()) / Path(url).expanduser()).resolve())


DEMO_MODEL = "stoker-digits"


def dataset_model_name(repo_url: str, path: str) -> str:
    """``<repository name>-<path>`` with characters other than letters, digits, ``._-`` as ``-``:
    ``/home/me/flowers.git`` + ``data/images`` -> ``flowers-data-images``."""
    repo = repo_url.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1].removesuffix(".git")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{repo}-{path}").strip("-.") or DEMO_MODEL


class DataConfig(_Frozen):
    """Where the dataset lives: a git repository with DVC-tracked data, pinned to a revision."""

    repo_url: str | None = Field(
        None,
        description="Git URL or path of the data repository; a relative path is resolved "
        "against the directory the config is loaded in. Empty: the demo digits repository "
        "that Stoker creates (once) inside the work directory. A value starting with '-' is "
        "refused (git would read it as an option): a local folder named -x is written ./-x.",
    )
    rev: str = Field("v1", description="Git revision (tag, branch or commit) to pull.")
    path: str = Field("data/digits", description="DVC-tracked directory inside the repository.")
    remote: str | None = Field(None, description="DVC remote name; empty: the repository default.")

    @field_validator("rev", "path")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("path")
    @classmethod
    def _inside_the_repository(cls, value: str) -> str:
        """``data/fruit/``, ``./data/fruit`` and ``data/fruit.dvc`` (its DVC file) all name
        ``data/fruit``; an absolute path or one that climbs out with ``..`` is refused."""
        raw = value.strip()
        path = PurePosixPath(raw)
        if path.is_absolute() or ".." in path.parts:
            raise ValueError("not inside the repository: give the DVC-tracked directory "
                             "relative to the repository's root (e.g. data/images)")
        text = str(path)  # drops a trailing slash and ./ segments
        if path.suffix == ".dvc" and path.name != ".dvc":
            text = text.removesuffix(".dvc")  # the tracked directory's DVC file: the same data
        if text in ("", "."):
            raise ValueError("must name a DVC-tracked directory, not the repository's root")
        return text

    @field_validator("repo_url")
    @classmethod
    def _absolute_repo(cls, value: str | None) -> str | None:
        # Resolved here, in the user's process: Prefect may run the pull in another directory.
        if value is None or not value.strip():
            return None
        refuse_url_credentials(value, "to git: a credential helper (git config --global "
                               "credential.helper store), GIT_ASKPASS, or an SSH key")
        refuse_option_like(value, "git", "a local folder whose name starts with '-' is "
                           f"written ./{value.strip()}")
        refuse_option_like_host(value, "ssh")
        return resolve_repo_url(value.strip())

    @field_validator("rev", "path", "remote")
    @classmethod
    def _not_an_option(cls, value: str | None, info) -> str | None:
        # Refused here, not first in the flow: git and DVC get these on their command lines.
        instead = {"rev": "no branch or tag name starts with '-': give another name or the "
                          "commit's hash",
                   "path": "a tracked directory at the repository's root whose name starts "
                           "with '-' cannot be pulled: move it into a folder (data/-name)",
                   "remote": "name a DVC remote whose name does not start with '-'"}
        return refuse_option_like(value, "git or DVC", instead[info.field_name])

    # The value as given, before _absolute_repo resolved it: whether it was a relative path
    # (for the hint of a missing folder). Not a field: not dumped, not in the forms.
    _repo_url_given: str | None = PrivateAttr(None)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_the_given_repo_url(cls, data: Any, handler):
        model = handler(data)
        given = data.get("repo_url") if isinstance(data, dict) else None
        if isinstance(given, str):
            model._repo_url_given = given.strip()
        return model

    @property
    def repo_url_was_relative(self) -> bool:
        """Whether ``repo_url`` was given as a relative local path (``src``, ``../repo``), in
        this process; False for an absolute path, ``~/…``, a URL, or a value only known
        resolved (a config read back from Prefect's parameters)."""
        given = self._repo_url_given
        return bool(given) and is_local(given) and not given.startswith("~") \
            and not Path(given).is_absolute()


class TrackingConfig(_Frozen):
    """MLflow tracking and model registry settings."""

    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; empty: MLFLOW_TRACKING_URI when that variable "
        "is set, else sqlite:///<work_dir>/mlflow.db."
    )
    experiment: str | None = Field(
        None, description="MLflow experiment name; empty: one experiment per registered model, "
        "named after it.")
    registered_model: str | None = Field(
        None, description="Registered model name; empty: derived from the dataset "
        "(<repository>-<path>, e.g. flowers-data-images), stoker-digits for the demo data.")
    promote_metric: str = Field("val_accuracy", description="Metric the promotion gate compares.")
    promote_direction: Literal["max", "min"] = Field(
        "max", description="Whether larger or smaller values of promote_metric are better."
    )
    ui_url: str | None = Field(
        None, description="MLflow UI base URL for links in reports; empty: the tracking URI when "
        "it is http(s)."
    )
    system_metrics_interval_s: float | None = Field(
        10.0, gt=0, description="MLflow system metrics sampling period; empty: off."
    )
    plot_curves: bool = Field(
        False, description="Also log the training curves as a PNG (plots/curves.png: train "
        "loss per step, validation loss and accuracy per epoch) when the run ends. Off by "
        "default: the MLflow UI charts the same metrics, and drawing them costs matplotlib's "
        "import and a figure, about 0.6 CPU-s at the end of every run on 2 cores."
    )

    @field_validator("experiment", "registered_model", "promote_metric")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        if value is not None and (char := control_characters(value)) is not None:
            raise ValueError(f"contains the control character {char}")
        return value

    @field_validator("tracking_uri", "ui_url")
    @classmethod
    def _known_scheme(cls, value: str | None, info) -> str | None:
        if value is None:
            return value
        refuse_url_credentials(value, "in the environment: MLFLOW_TRACKING_USERNAME and "
                               "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) for a "
                               "server, PGPASSWORD or ~/.pgpass for a database")
        scheme = value.partition("://")[0].split("+")[0].lower() if "://" in value else ""
        allowed = TRACKING_SCHEMES if info.field_name == "tracking_uri" else ("http", "https")
        if scheme not in allowed and not (scheme == "" and info.field_name == "tracking_uri"):
            raise ValueError(f"unsupported scheme {scheme or 'none'!r} (use "
                             f"{', '.join(s + '://' for s in allowed)})")
        return value


# Stores MLflow's client opens by URI scheme (``postgresql+psycopg2://`` counts as postgresql);
# a plain path is a local file store.
TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "file",
                    "databricks")


SLURM_SIGNAL_SLACK_S = 60  # Slurm's --signal may come up to this much before the asked time


class PipelineConfig(_Frozen):
    """The whole main job: data, training, tracking. The deployments' forms (stoker/forms.py)
    hold a grouped subset of it and build it."""

    work_dir: Path = Field(
        Path("work"), description="Where datasets, checkpoints and the embedded stores live."
    )
    job_id: str | None = Field(
        None, description="Name of the job (a folder under work_dir/jobs): resumed if it "
        "exists (with its own dataset and trajectory), else a new job of that name; empty: "
        "resume the unfinished job of the same config, or start a new one.",
    )
    checkpoint_dir: str | None = Field(
        None, description="Durable home of every job (path or fsspec URL, e.g. "
        "s3://bucket/jobs; credentials from the environment): committed checkpoints, the "
        "attempt record, the MLflow run id and the run spec, per job. The job folders in "
        "work_dir become a cache, so a job resumes on another machine. Empty: "
        "<work_dir>/jobs.")
    job_lease_s: float = Field(
        60.0, ge=3, description="Seconds a job stays owned by a flow run that stopped renewing "
        "its lease (the run died): after that another run may take the job over, and the "
        "job's training processes and containers stop (checkpoint, exit 75).")
    train_timeout_s: float | None = Field(
        None, gt=0, description="Fail the train task after this many seconds (all attempts); "
        "the whole torchrun process tree is terminated."
    )
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    tracking: TrackingConfig = TrackingConfig()
    retry: RetryConfig = RetryConfig()
    cost: CostConfig = CostConfig()
    launcher: LauncherConfig = LauncherConfig()

    @model_validator(mode="after")
    def _containers_need_a_server(self) -> PipelineConfig:
        kind = self.launcher.kind
        if kind != "local" and not self.tracking_uri().startswith(("http://", "https://")):
            raise ValueError(
                f"tracking.tracking_uri: launcher.kind={kind} logs from containers or nodes to "
                "an MLflow tracking server over HTTP (they cannot reach a sqlite file): start one "
                "(`mlflow server --host 127.0.0.1`) and set tracking.tracking_uri=http://…")
        limit = self.launcher.slurm.time_limit_min
        # The stop signal is asked for grace + 5 s before the limit, and Slurm may send it up to
        # 60 s earlier: a shorter limit stops the job before it trains (trial: 1 minute, the
        # signal 10 s in, the attempt a user error).
        least_s = self.train.preemption_grace_s + 5 + SLURM_SIGNAL_SLACK_S
        if kind == "slurm" and limit is not None and limit * 60 <= least_s:
            raise ValueError(
                f"launcher.slurm.time_limit_min: {limit} minute(s) leaves no time to train: the "
                f"stop signal comes train.preemption_grace_s + 5 s before the limit, and Slurm "
                f"may send it up to {SLURM_SIGNAL_SLACK_S} s earlier ({least_s:g} s in all); "
                f"give more than {least_s / 60:.1f} minutes")
        return self

    def registered_model(self) -> str:
        """The registered model name: the configured one, else one derived from the dataset
        (repository + path) so that a user's model never lands in the demo's entry."""
        if self.tracking.registered_model:
            return self.tracking.registered_model
        if self.data.repo_url is None:
            return DEMO_MODEL
        return dataset_model_name(self.data.repo_url, self.data.path)

    def experiment(self) -> str:
        """The MLflow experiment: the configured one, else the registered model's name (one
        experiment per model lineage, so its runs are compared side by side)."""
        return self.tracking.experiment or self.registered_model()

    @field_validator("job_id")
    @classmethod
    def _job_folder_name(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", value):
            raise ValueError("not a folder name: use letters, digits, '.', '_' or '-' (at most "
                             "128, starting with a letter or digit)")
        return value

    @field_validator("checkpoint_dir")
    @classmethod
    def _store_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        refuse_url_credentials(value, "in the environment (AWS_ACCESS_KEY_ID, "
                               "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN)")
        value = value.strip()
        if "://" not in value:  # a path: absolute, so that every process reads the same one
            return str(Path(value).expanduser().resolve())
        scheme = value.split("://", 1)[0]
        if not re.match(r"^[a-z][a-z0-9+.-]*$", scheme):
            raise ValueError(f"not a path or URL: {value!r}")
        return value.rstrip("/")

    def job_store_url(self) -> str | None:
        """``checkpoint_dir`` when set (None: job state lives in ``<work_dir>/jobs`` only)."""
        return self.checkpoint_dir

    def tracking_uri(self) -> str:
        """The MLflow tracking URI, defaulting to a sqlite store in the work directory."""
        if self.tracking.tracking_uri:
            return self.tracking.tracking_uri
        return f"sqlite:///{self.work_dir.resolve() / 'mlflow.db'}"


# MLflow's own variable: when set, the default of tracking.tracking_uri (as MLflow users expect).
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"


def tracking_uri_from_env(environ=None) -> str | None:
    """``MLFLOW_TRACKING_URI`` of ``environ`` (default ``os.environ``), or None when unset or
    blank."""
    value = (os.environ if environ is None else environ).get(TRACKING_URI_ENV, "").strip()
    return value or None


def load_pipeline_config(
    config_file: Path | None = None, overrides: list[str] | None = None, environ=None
) -> PipelineConfig:
    """Merge defaults, ``MLFLOW_TRACKING_URI``, a YAML file and ``a.b=value`` overrides into a
    validated PipelineConfig.

    Args:
        config_file: a YAML file of fields, or None.
        overrides: ``a.b=value`` items.
        environ: the environment whose ``MLFLOW_TRACKING_URI`` is the default of
            ``tracking.tracking_uri`` (default ``os.environ``; ``{}`` for none). The file and
            the overrides win over it.

    Raises:
        ConfigError: the file is missing or not a mapping, an override is malformed, or a value
            fails validation (the message names the field, and ``MLFLOW_TRACKING_URI`` when it
            is set).
    """
    from_env = tracking_uri_from_env(environ)
    defaults = {"tracking": {"tracking_uri": from_env}} if from_env else None
    try:
        return load_config(PipelineConfig, config_file, overrides, defaults)
    except ConfigError as e:
        if from_env and "tracking.tracking_uri" in str(e):
            raise ConfigError(f"{e} ({TRACKING_URI_ENV} is set: it is the default of "
                              "tracking.tracking_uri)") from None
        raise
