"""The ``stoker`` command line.

``stoker run [--config FILE] [field=value ...]`` runs the pipeline flow with the embedded defaults:
Prefect on a long-lived local server under ``<work_dir>/.prefect`` that the first run starts and
later runs reuse (unless PREFECT_API_URL is set; ``stoker server stop`` ends it), MLflow in
``<work_dir>/mlflow.db``, DVC with a local remote.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer

from stoker import stopping
from stoker.config import ConfigError, PipelineConfig, load_pipeline_config
from stoker.cost_cli import cost
from stoker.environment import TELEMETRY_OFF, quiet_telemetry, sqlite_path  # noqa: F401
from stoker.jobs_cli import WORK_DIR_OPTION, jobs, logs, status, stop
from stoker.predict_cli import predict
from stoker.server_cli import prefect_api, server_app
from stoker.ui_cli import ui

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode="markdown",
                  help="Stoker: resumable GPU training pipelines on Prefect, DVC, PyTorch, MLflow.")


RUN_WORK_DIR_OPTION = typer.Option(
    "--work-dir", "-w", help="The work folder: the same as the override work_dir=PATH")


def _config(config_file: Path | None, overrides: list[str] | None) -> PipelineConfig:
    try:
        return load_pipeline_config(config_file, overrides)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _with_work_dir(overrides: list[str] | None, work_dir: Path | None) -> list[str]:
    """``--work-dir X`` of ``run`` / ``show-config`` as the override ``work_dir=X`` (the jobs
    commands take ``--work-dir``; both forms work everywhere a config is read). Exit 2 when an
    override names another folder."""
    overrides = list(overrides or [])
    if work_dir is None:
        return overrides
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("work_dir=")]
    if any(Path(g) != work_dir for g in given):
        typer.echo(f"error: --work-dir {work_dir} and work_dir={given[-1]} name different "
                   "folders; give one", err=True)
        raise typer.Exit(2)
    return [*overrides, f"work_dir={work_dir}"]


def _check_before_pull(config: PipelineConfig) -> None:
    """World size and a dead tracking server are named here, not after the pull inside a rank."""
    from stoker.data.pull import DatasetError
    from stoker.launch.factory import check_before_pull

    try:
        check_before_pull(config)
    except (ConfigError, DatasetError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _check_credentials(config: PipelineConfig) -> None:
    """A Prefect API or MLflow server that refuses this user's credential: one line, exit 2."""
    from stoker.server_auth import CredentialError, check_servers

    try:
        check_servers(config.tracking_uri())
    except CredentialError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@app.command()
def run(
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Dotted overrides, e.g. train.epochs=3 data.rev=v1")] = None,
    config_file: Annotated[Path | None, typer.Option(
        "--config", "-c", help="YAML file with PipelineConfig fields")] = None,
    debug: Annotated[bool, typer.Option(
        "--debug", help="Print tracebacks in the terminal (the Prefect task log always has "
        "them)")] = False,
    resume_stalled: Annotated[bool, typer.Option(
        "--resume-stalled", help="Resume a job the cost guard stopped for a stall (same as "
        "retry.resume_stalled=true)")] = False,
    work_dir: Annotated[Path | None, RUN_WORK_DIR_OPTION] = None,
) -> None:
    """Run the main job: pull the dataset, train with torchrun, register the model in MLflow.

    Exit codes: 0 done, 1 failed, 2 bad input, 3 stopped on request, 4 the job is owned by
    another live run, 5 stopped by its budget, 129/130/143 SIGHUP/Ctrl-C/SIGTERM (docs:
    reference/exit-codes.md)."""
    from stoker.runtime import startup_gc
    from stoker.runtime.tracking import quiet_run_links

    quiet_run_links()  # stdout is the JSON summary alone; the report task logs the run's link
    # No cyclic collections while MLflow, Prefect (and, in the forked standby launcher, torch)
    # are imported; resumed as the flow starts (and in the launcher, before its ranks fork).
    startup_gc.pause()
    # A stop signal from here on ends in one line (trial: a Ctrl-C in the first seconds, the
    # config read and the job checks, exited 130 without a word).
    previous = stopping.install()
    try:
        config = _before_the_flow(overrides, config_file, resume_stalled, work_dir)
    except (typer.Exit, SystemExit):  # bad input, a busy or stalled job: one line said
        stopping.uninstall(previous)
        raise
    except KeyboardInterrupt:
        from stoker.launch.local import discard_standby

        discard_standby()
        _say_stopped()
        stopping.exit_now(stopping.stop_exit_code())
    if config is None:  # the job is done: its summary is printed
        stopping.uninstall(previous)
        return
    code = 0
    # The command's last lines (the summary, why it stopped) are said once the Prefect API
    # context has ended: its exit sends Prefect's queued events and logs, and their workers'
    # own lines ("EventsWorker - Still processing items") came after them (trial).
    last_lines: list[tuple[str, bool]] = []

    def say(text: str, err: bool = True) -> None:
        last_lines.append((text, err))

    try:
        try:
            with prefect_api(Path(config.work_dir) / "logs" / "output.log"):
                code = _run_flow(config, debug, say)
        finally:
            for text, err in last_lines:
                typer.echo(text, err=err)
            stopping.summary_said()
    except KeyboardInterrupt:
        _say_stopped()
        code = stopping.stop_exit_code()
    except Exception as e:
        code = _report_failure(e, debug)
    from stoker.launch.local import discard_standby

    discard_standby()  # not taken: nothing trained (a done job, a refused dataset, a failure)
    # Everything is recorded and the training tree is gone: skip the interpreter's finalizers
    # (Prefect's exit hooks, torch), which held the exit back for seconds.
    stopping.exit_now(code)


def _run_flow(config: PipelineConfig, debug: bool, say) -> int:
    """Run the pipeline flow of ``stoker run`` (inside its Prefect API context) and return the
    command's exit code; the summary and a stop's line go to ``say(text, err=True)``, said by
    the caller after that context ends."""
    from prefect.exceptions import CancelledRun

    from flows.pipeline import pipeline
    from stoker.jobs.lease import JobBusy
    from stoker.jobs.stop_request import TrainingStopped
    from stoker.runtime import startup_gc
    from stoker.tracking.command_goodput import record_command_goodput

    startup_gc.settle()  # the imports are done: collect cycles again (see run)

    if not debug:
        quiet_console_tracebacks()
    try:
        summary = pipeline(config)
        stopping.note_done(json.dumps(summary, indent=2, default=str))
        summary = record_command_goodput(summary, config.tracking_uri())
        say(text := json.dumps(summary, indent=2, default=str), err=False)
        stopping.note_done(text)
    except CancelledRun:  # the flow recorded a stop signal as its Cancelled end
        from stoker.orchestration.flow_runs import prefect_cancel

        if stopping.stop_reason() is not None:
            say(stopping.stopped_line())
            return stopping.stop_exit_code()
        if (cancel := prefect_cancel()) is not None:  # from the Prefect UI or API
            if cancel.get("summary") is not None:
                say(json.dumps(cancel["summary"], indent=2, default=str), err=False)
            say(f"stoker run: {cancel['message']}")
            return stopping.EXIT_STOPPED if cancel["stopped"] else 0
        raise
    except TrainingStopped as e:  # the cost guard or a user stopped the job
        say(f"stoker run: {e}")
        return stopping.stopped_exit_code(e)
    except JobBusy as e:  # found after the pull (no job_id): still one line
        say(f"error: {e}")
        return EXIT_BUSY
    return 0


def _before_the_flow(overrides: list[str] | None, config_file: Path | None,
                     resume_stalled: bool, work_dir: Path | None) -> PipelineConfig | None:
    """``stoker run``'s checks before its flow starts (bad input, a busy, done or stalled job:
    one line and its exit code, ``typer.Exit``), then the output guard and the prestarted
    launcher. Returns the config, or None for a job already done (its summary printed)."""
    overrides = _with_work_dir(overrides, work_dir)
    if resume_stalled:
        overrides = [*overrides, "retry.resume_stalled=true"]
    config = _config(config_file, overrides)
    _check_credentials(config)  # before anything is read, created, pulled or started
    from stoker.jobs.job import check_job_early, new_job_notice
    from stoker.jobs.lease import JobBusy
    from stoker.jobs.stop_request import TrainingStopped

    try:
        notice = new_job_notice(config)  # a shortened job_id: refused, naming the job
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    try:
        done = check_job_early(config)  # a busy, done or stalled job_id: before the flow starts
    except JobBusy as e:  # one line, no traceback: another run owns the job
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(EXIT_BUSY) from None
    except TrainingStopped as e:  # the guard stopped it for a stall: not resumed by default
        typer.echo(f"stoker run: {e}", err=True)
        raise typer.Exit(stopping.stopped_exit_code(e)) from None
    if done is not None:
        typer.echo(f"job {config.job_id} is already done; nothing to do", err=True)
        typer.echo(json.dumps(done, indent=2, default=str))
        return None
    _check_before_pull(config)
    if notice:  # said once the input passed: bad input is one line
        typer.echo(notice, err=True)
    quiet_telemetry(config.work_dir)
    from stoker.stdio import guard_stdio

    # A reader that goes away (a killed worker, a closed pipe) fails nothing: the output,
    # Prefect's log lines and the final summary included, goes on in the work folder's log.
    guard_stdio(Path(config.work_dir) / "logs" / "output.log")
    _prestart_launcher(config)
    return config


def _prestart_launcher(config: PipelineConfig) -> None:
    """Start the first attempt's launcher now, so that its imports (torch, torchrun, the
    runtime: 3-4 s on 2 cores) run on another core while Prefect starts the flow and the
    dataset is pulled (``stoker.launch.local.Standby``). Only for the local launcher, and
    only where the world size is known without importing torch (no GPU device, or
    ``train.nproc_per_node`` set)."""
    if config.launcher.kind != "local":
        return
    from stoker.launch.local import prestart
    from stoker.launch.supervisor import nproc
    from stoker.runtime.launch import gpu_device_present

    if config.train.nproc_per_node != "auto" or not gpu_device_present():
        prestart(nproc(config))


def _say_stopped() -> None:
    typer.echo(stopping.stopped_line(), err=True)


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that name bad input (a field, the data, an image, the host): one line, exit 2."""
    from stoker.data.pull import DatasetError
    from stoker.images.build import ImageError
    from stoker.images.preflight import PreflightError
    from stoker.launch.docker import DockerLaunchError
    from stoker.runtime import CheckpointError
    from stoker.tracking.registry import LineageError

    return (ConfigError, DatasetError, LineageError, ImageError, PreflightError,
            DockerLaunchError, CheckpointError)


def _report_failure(error: Exception, debug: bool) -> int:
    """One line for a user error (exit 2) or a failed job (exit 1, with where to look); the
    traceback only for a bug, or with ``--debug``."""
    from stoker.launch.supervisor import TrainingFailed
    from stoker.local_server import ServerError

    if debug:
        traceback.print_exc()
    if isinstance(error, ServerError):
        typer.echo(f"error: {error}", err=True)
        return 1
    if isinstance(error, _user_errors()):
        typer.echo(f"error: {error}", err=True)
        return 2
    if isinstance(error, TrainingFailed):
        job = str(error).split()[1] if str(error).startswith("job ") else ""
        typer.echo(f"error: {error}" + (f" (its output: stoker logs {job})" if job else ""),
                   err=True)
        return 1
    if not debug:
        traceback.print_exc()
    return 1


class _TracebackFree(logging.Formatter):
    """Formats a record as ``inner`` does, without its traceback (other handlers keep it)."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


class _UserErrorOnce(logging.Filter):
    """On the terminal, a user error (``_user_errors``) or a job's failure (``TrainingFailed``)
    raised in a flow is said once, by the command's last line (``error: ...``): Prefect's lines
    that repeat it (the task's exception and end, the flow's exception) are dropped, the flow's
    end reads ``Finished in state Failed (DatasetError: see the error line)``, and the lines of
    Stoker's own state hook go. The Prefect UI's logs (the API handler) keep every line."""

    HOOK = "cancel_stopped_flow_run"

    def __init__(self, names: tuple[str, ...]):
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(("prefect.flow_runs", "prefect.task_runs")):
            return True
        message = record.getMessage()
        if f"hook '{self.HOOK}'" in message.lower():
            return False
        named = next((n for n in self.names if f"{n}(" in message or f"{n}: " in message), None)
        if named is None:
            return True
        if message.startswith("Finished in state Failed"):
            if record.name.startswith("prefect.task_runs"):
                return False
            record.msg, record.args = f"Finished in state Failed ({named}: see the error line)", ()
            return True
        return record.levelno < logging.ERROR  # the exception's own lines


def _with_subclasses(classes: tuple[type, ...]) -> list[str]:
    """The names of ``classes`` and of all their subclasses (Prefect's lines name the raised
    class: ``RegistryUnreachableError(...)``, an ``ImageError``), longest first."""
    names: set[str] = set()
    todo = list(classes)
    while todo:
        cls = todo.pop()
        if cls.__name__ not in names:
            names.add(cls.__name__)
            todo.extend(cls.__subclasses__())
    return sorted(names, key=len, reverse=True)


def quiet_console_tracebacks() -> None:
    """Prefect's terminal lines keep their message but not the traceback: a failed task repeats
    it several times. A user error, or a job that did not complete (``TrainingFailed``), is said
    once (:class:`_UserErrorOnce`). The Prefect UI's task log (the API handler) keeps every
    traceback and line."""
    from stoker.launch.supervisor import TrainingFailed

    names = tuple(_with_subclasses((*_user_errors(), TrainingFailed)))
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) \
                    and not isinstance(handler.formatter, _TracebackFree):
                handler.setFormatter(_TracebackFree(handler.formatter or logging.Formatter()))
                handler.addFilter(_UserErrorOnce(names))


EXIT_BUSY = 4  # `stoker run`: the job is owned by another live run (nothing was changed)


@app.command("cost-guard")
def cost_guard(
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Dotted overrides, e.g. dry_run=false policy.window_s=120")] = None,
    config_file: Annotated[Path | None, typer.Option(
        "--config", "-c", help="YAML file with CostGuardConfig fields")] = None,
    plain: Annotated[bool, typer.Option(
        "--plain", help="Sweep without Prefect: print the Markdown report; no flow run, "
        "artifact or events, and local jobs' flow runs are not cancelled")] = False,
) -> None:
    """Run one cost-guard sweep: find idle GPUs and stalled jobs (dry run unless dry_run=false)."""
    from stoker.config import load_config
    from stoker.costguard.config import CostGuardConfig

    try:
        config = load_config(CostGuardConfig, config_file, overrides)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    quiet_telemetry(config.work_dir)
    if plain:
        from stoker.costguard.host import sweep_host
        from stoker.costguard.report import render_markdown

        typer.echo(render_markdown(sweep_host(config)), nl=False)
        return
    if not config.prefect.enabled:  # no flow run to record nor to cancel: no server either
        from stoker.costguard.host import sweep_host
        from stoker.costguard.summary import summary

        typer.echo(json.dumps(summary(sweep_host(config)), indent=2, default=str))
        return
    try:
        with prefect_api():  # the local server (or PREFECT_API_URL), not a temporary one
            from flows.cost_guard import cost_guard as cost_guard_flow

            typer.echo(json.dumps(cost_guard_flow(config), indent=2, default=str))
    except ConfigError as e:  # PREFECT_API_URL refuses this user's credential
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    stopping.exit_now(0)  # recorded and drained: Prefect's exit hooks would add seconds


@app.command("build-image")
def build_image(
    overrides: Annotated[list[str] | None, typer.Argument(
        help="ImageRequest fields, e.g. matrix_entry=cu128-py312 registry=127.0.0.1:5000")
    ] = None,
    config_file: Annotated[Path | None, typer.Option(
        "--config", "-c", help="YAML file with ImageRequest fields")] = None,
    work_dir: Annotated[Path, WORK_DIR_OPTION] = Path("work"),
    debug: Annotated[bool, typer.Option("--debug", help="Tracebacks on the terminal")] = False,
) -> None:
    """Build the training image of a matrix entry and push it, unless the registry already holds
    its content-hash tag; prints image, digest and whether it was built (the ``build-image``
    flow, on the local Prefect server of ``--work-dir``).

    Exit codes: 0 done, 1 failed, 2 bad input (a field, Docker, the base image or the registry,
    named in one line), 130 Ctrl-C."""
    from stoker.config import load_config
    from stoker.images.spec import ImageRequest

    try:
        request = load_config(ImageRequest, config_file, overrides)
        request.spec()  # an unknown matrix entry: named before Prefect starts
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    quiet_telemetry(work_dir)
    code = 0
    try:
        with prefect_api():  # the local server (or PREFECT_API_URL), not a temporary one
            from flows.build_image import build_image_flow

            if not debug:
                quiet_console_tracebacks()
            typer.echo(json.dumps(build_image_flow(request), indent=2, default=str))
    except KeyboardInterrupt:
        typer.echo("stoker build-image: interrupted", err=True)
        code = stopping.EXIT_SIGINT
    except Exception as e:
        code = _report_failure(e, debug)
    stopping.exit_now(code)


@app.command("show-config")
def show_config(
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides")] = None,
    config_file: Annotated[Path | None, typer.Option("--config", "-c")] = None,
    work_dir: Annotated[Path | None, RUN_WORK_DIR_OPTION] = None,
) -> None:
    """Print the resolved, validated configuration as YAML (usable as a ``--config`` file); a
    relative ``work_dir`` is shown with the folder it names from here as a comment, and
    ``tracking.tracking_uri`` as the URI a run uses (``PipelineConfig.tracking_uri()``: an
    empty one is the default store in the work folder, said in a comment)."""
    import yaml

    config = _config(config_file, _with_work_dir(overrides, work_dir))
    values = config.model_dump(mode="json")
    values["tracking"]["tracking_uri"] = config.tracking_uri()
    text = yaml.safe_dump(values, sort_keys=False)
    if not config.tracking.tracking_uri:  # said where the field is
        text = text.replace("\ntracking:\n", "\n# tracking.tracking_uri is not set: a run uses "
                            "the default shown, mlflow.db in work_dir\ntracking:\n", 1)
    elif load_pipeline_config(config_file, _with_work_dir(overrides, work_dir),
                              environ={}).tracking.tracking_uri is None:  # from the variable
        text = text.replace("\ntracking:\n", "\n# tracking.tracking_uri is not set: a run uses "
                            "MLFLOW_TRACKING_URI of the environment\ntracking:\n", 1)
    work_dir = Path(config.work_dir)
    if not work_dir.is_absolute():
        text = f"# work_dir {work_dir} is {work_dir.resolve()} from here\n{text}"
    typer.echo(text)


for command in (jobs, status, stop, logs):  # stoker.jobs_cli
    app.command()(command)
app.command()(predict)  # `stoker predict` (stoker.predict_cli)
app.command()(cost)  # `stoker cost` (stoker.cost_cli)
app.command()(ui)  # `stoker ui` (stoker.ui_cli)
app.add_typer(server_app, name="server")  # `stoker server start|status|stop`

if __name__ == "__main__":
    sys.exit(app())
