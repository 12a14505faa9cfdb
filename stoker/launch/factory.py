"""Pick the launcher the config asks for; every one is a :class:`stoker.launch.base.Launcher`
(``run(spec_path, on_line, timeout_s) -> exit code`` with the runtime's exit-code contract)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from stoker.config import ConfigError, PipelineConfig, check_batch, is_local
from stoker.launch.base import Launcher


class KubernetesAdapter:
    """Runs a spec file as a Kubernetes job named after the job folder."""

    def __init__(self, launcher):
        self.launcher = launcher

    def run(self, spec_path: Path, on_line: Callable[[str], None] = print,
            timeout_s: float | None = None) -> int:
        from stoker.jobs.stop_request import read_stop_request
        from stoker.launch.kubeflow import kubernetes_name
        from stoker.runtime.spec import RunSpec

        spec = RunSpec.load(spec_path)
        name = kubernetes_name(Path(spec.job_dir).name)
        job_dir = Path(spec_path).parent  # this machine's job folder (stoker stop writes here)
        on_line(f"submitting Kubernetes job {name}")
        return self.launcher.run(spec, name, timeout_s=timeout_s,
                                 stop_requested=lambda: read_stop_request(job_dir) is not None)


def needs_image(config: PipelineConfig) -> bool:
    """Whether training runs in containers without an image given explicitly."""
    launcher = config.launcher
    if launcher.kind == "docker":
        return not launcher.docker.image
    if launcher.kind == "kubernetes":
        return not launcher.kubernetes.get("image")
    return False


def make_launcher(config: PipelineConfig, world_size: int, image: str | None = None) -> Launcher:
    """The launcher for ``config.launcher.kind``.

    Args:
        world_size: processes per node (local, docker) or per pod (kubernetes).
        image: training image reference for docker/kubernetes (overrides the config's).

    Raises:
        ConfigError: docker/kubernetes without an image, or invalid kubernetes fields (named).
    """
    kind = config.launcher.kind
    grace = config.train.preemption_grace_s
    if kind == "local":
        from stoker.launch.local import LocalLauncher

        return LocalLauncher(world_size, shutdown_grace_s=grace)
    if kind == "docker":
        from stoker.launch.docker import DockerLauncher

        docker = config.launcher.docker
        image = image or docker.image
        if not image:
            raise ConfigError("launcher.docker.image: empty, and no image was built")
        return DockerLauncher(
            image=image, nproc_per_node=world_size, nnodes=docker.nnodes, gpus=docker.gpus,
            shm_size=docker.shm_size, user=docker.user, shutdown_grace_s=grace,
            rdzv_endpoint=f"127.0.0.1:{docker.rdzv_port}", docker_host=docker.docker_host,
            extra_mounts=[str(config.work_dir.resolve())]
            + ([config.checkpoint_dir] if config.checkpoint_dir
               and "://" not in config.checkpoint_dir else []),
            environment={**store_environment(config), **tracking_environment(config)},
        )
    if kind == "slurm":
        from stoker.launch.slurm import SlurmLauncher

        slurm = config.launcher.slurm
        return SlurmLauncher(slurm, nproc_per_node=world_size, shutdown_grace_s=grace,
                             **({"python": slurm.python} if slurm.python else {}))
    from stoker.config import validate
    from stoker.launch.kubeflow import KubernetesLaunchConfig
    from stoker.launch.kubernetes import KubernetesLauncher, api_client

    fields = dict(config.launcher.kubernetes)
    if config.checkpoint_dir and fields.get("checkpoint_dir"):
        # The job store decides where each job's checkpoints live (and is fenced there).
        raise ConfigError("launcher.kubernetes.checkpoint_dir: leave it empty when the "
                          f"top-level checkpoint_dir ({config.checkpoint_dir}) is set")
    if image:
        fields["image"] = image
    fields.setdefault("nproc_per_node", world_size)
    k8s = validate(KubernetesLaunchConfig, fields, prefix="launcher.kubernetes.")
    return KubernetesAdapter(KubernetesLauncher(k8s, api_client()))


# What a container needs to reach an object store: passed through by name, never logged.
STORE_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
             "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION")


def store_environment(config: PipelineConfig) -> dict[str, str]:
    """The object-store credentials of this process's environment, for the training containers
    (only with a ``checkpoint_dir`` URL; {} otherwise)."""
    if not config.checkpoint_dir or "://" not in config.checkpoint_dir:
        return {}
    return {k: os.environ[k] for k in STORE_ENV if k in os.environ}


# What a container's rank 0 needs to log to a tracking server that asks who it is: passed
# through by name, never logged.
TRACKING_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def tracking_environment(config: PipelineConfig) -> dict[str, str]:
    """The MLflow tracking server's credentials of this process's environment, for the
    training containers (only with an http(s) ``tracking.tracking_uri``; {} otherwise)."""
    if not config.tracking_uri().startswith(("http://", "https://")):
        return {}
    return {k: os.environ[k] for k in TRACKING_ENV if k in os.environ}


def _check_batch_fits_files(config: PipelineConfig, repo: str, files: object) -> None:
    """A global batch larger than the training split even if every file the dataset's ``.dvc``
    lists were an image: refused before the pull and before the flow starts (trial: batch 128
    on 90 images was refused only after the pull, behind 30 s of Prefect lines). The check
    after the pull (:mod:`stoker.orchestration.batch_fit`) counts the images themselves.

    ``files``: the ``nfiles`` of the ``.dvc`` file (read as data: anything but a count > 0
    checks nothing).

    Raises:
        ConfigError: the line of :func:`stoker.runtime.split.batch_exceeds_split`.
    """
    from stoker.launch.supervisor import nodes, nproc
    from stoker.runtime.split import batch_exceeds_split, split_sizes

    if not isinstance(files, int) or isinstance(files, bool) or files <= 0:
        return
    data, train = config.data, config.train
    n_train, n_val = split_sizes(files, train.val_fraction)
    problem = batch_exceeds_split(
        train.global_batch_size, train.grad_accum_steps, n_train, nproc(config) * nodes(config),
        f"{data.path}@{data.rev} of {repo} (its {files} files, each counted as an image; "
        f"train.val_fraction={train.val_fraction:g} holds out {n_val})")
    if problem is not None:
        raise ConfigError(problem)


def check_before_pull(config: PipelineConfig) -> None:
    """Checks that need this machine, run before the dataset is pulled: a local data repository
    exists and is a git repository (a working tree or a bare one), the global batch splits over
    the processes this node will start (``nproc_per_node=auto``: one per GPU, or 2) and, in a
    repository on this machine, fits the training split of the files its ``.dvc`` counts, a
    ``resnet*`` model has torchvision here (local launcher: training runs on this machine), an
    http(s) tracking server answers, and the ``checkpoint_dir`` store takes a write; in a
    repository on this machine, ``data.rev`` and ``data.path`` exist; for the local launcher,
    ``STOKER_WORKER_START`` is a known value.

    Raises:
        DatasetError: naming ``data.rev`` or ``data.path`` (a local repository).
        ConfigError: naming ``data.repo_url``, ``data.path`` (of the demo repository, with no
            ``data.repo_url``), ``train.global_batch_size``, ``train.model`` (and
            the ``vision`` extra), ``tracking.tracking_uri`` or ``STOKER_WORKER_START``;
            ``BucketError`` (a ConfigError)
            naming ``checkpoint_dir``.
    """
    from stoker.data.demo import DEMO_PATH
    from stoker.launch.supervisor import nproc
    from stoker.runtime.vision import vision_problem
    from stoker.tracking.server import check_tracking_server

    repo = config.data.repo_url
    if not repo and config.data.path != DEMO_PATH:  # e.g. `data.repo_url=` left empty by mistake
        raise ConfigError(f"data.path {config.data.path}: data.repo_url is empty, so the data "
                          f"is the demo repository's, which tracks only {DEMO_PATH}; set "
                          "data.repo_url to your repository")
    if repo and is_local(repo) and not Path(repo).is_dir():
        # Only for a value given relative (not for /abs/path or file:///abs/path).
        hint = (" (a relative path is resolved against the directory stoker runs in, "
                f"{Path.cwd()}: give an absolute path)" if config.data.repo_url_was_relative
                else "")
        raise ConfigError(f"data.repo_url: {repo} is not a folder{hint}")
    out: dict = {}  # the .dvc file's entry, for a repository on this machine
    if repo and is_local(repo):  # a revision or path that is not there: named before the pull
        from stoker.data.pull import is_git_repository, local_dvc_out

        if not is_git_repository(Path(repo)):
            raise ConfigError(f"data.repo_url: {repo} is not a git repository (no .git in it, "
                              "not a bare repository)")

        out = local_dvc_out(repo, config.data.rev, config.data.path) or {}
    train = config.train
    try:
        check_batch(train.global_batch_size, train.grad_accum_steps, nproc(config))
    except ValueError as e:
        raise ConfigError(f"train.{e}") from None
    if out and train.dataset == "image_folder":
        _check_batch_fits_files(config, repo, out.get("nfiles"))
    if config.launcher.kind == "local":  # the ranks start here, as this variable says
        from stoker.runtime.launch import worker_start

        try:
            worker_start()
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if config.launcher.kind == "slurm":  # a partition or node count the cluster lacks
        from stoker.launch.slurm_checks import check_slurm_config

        check_slurm_config(config.launcher.slurm)
    problem = vision_problem(train.model) if config.launcher.kind == "local" else None
    if problem:  # containers: the training image must hold torchvision (not checkable here)
        raise ConfigError(problem)
    check_tracking_server(config.tracking_uri())
    if config.checkpoint_dir:  # wrong credentials or no bucket: named before anything runs
        from stoker.jobs.store import JobStore

        JobStore(config.checkpoint_dir).check()
