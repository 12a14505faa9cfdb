"""Attempt outcomes as named Prefect states, and a stop the cost guard asked for is not retried:
the pipeline flow on a real Prefect server, torchrun signalled like ``docker stop`` would."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from conftest import launcher_of
from mlflow import MlflowClient

from stoker.config import load_pipeline_config
from stoker.jobs.stop_request import request_stop
from stoker.runtime.progress import read_events

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def launcher_of_this_process() -> psutil.Process:
    """The launcher (torchrun's process) of the attempt running below this test process."""
    deadline = time.monotonic() + 60
    while (launcher := launcher_of(psutil.Process(os.getpid()))) is None:
        assert time.monotonic() < deadline, "no attempt's ranks run below this process"
        time.sleep(0.05)
    return launcher


def wait_for_attempt(work, attempt: int, timeout_s: float = 300, run_id: bool = False):
    """The job folder once attempt ``attempt`` has trained a step (and, with ``run_id``, its
    MLflow run is open: rank 0 opens it in the background)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for job in (work / "jobs").glob("*") if (work / "jobs").exists() else []:
            events = read_events(job)
            starts = [i for i, e in enumerate(events) if e["event"] == "start"]
            if len(starts) >= attempt and any(e["event"] == "step"
                                               for e in events[starts[attempt - 1]:]) and (
                    not run_id or (job / "mlflow_run_id").is_file()):
                return job
        time.sleep(0.05)
    raise AssertionError(f"attempt {attempt} never trained")


def test_preempted_attempt_is_named_and_a_guard_stop_is_not_retried(harness, tmp_path):
    from prefect.client.orchestration import get_client

    from flows.pipeline import pipeline
    from stoker.jobs.attempts import AttemptLog
    from stoker.jobs.stop_request import TrainingStopped

    work = tmp_path / "work"
    # 1000 epochs: both stops land mid-training also on a loaded machine (the guard stop waits
    # for rank 0's background MLflow run, which took 12 s to open under a parallel CI run); the
    # job is stopped, so the extra epochs never train. Should the thread fail, it stops the job
    # itself, so that its error, not a training to the end, is what the test reports.
    config = load_pipeline_config(None, [f"work_dir={work}", "train.epochs=1000",
                                         "tracking.system_metrics_interval_s=null"])
    fired: list[str] = []
    failed: list[BaseException] = []

    def preempt_then_guard_stop() -> None:
        try:
            wait_for_attempt(work, 1)
            launcher_of_this_process().send_signal(signal.SIGTERM)  # a preemption
            fired.append("preempt")
            job = wait_for_attempt(work, 2, run_id=True)
            request_stop(job, "cost-guard", "stalled: no progress for 600 s")  # what the guard does
            launcher_of_this_process().send_signal(signal.SIGTERM)  # then docker stop's SIGTERM
            fired.append("guard")
        except BaseException as e:  # noqa: BLE001 (reported by the test below)
            failed.append(e)
            for job in (work / "jobs").glob("*"):
                request_stop(job, "test", f"the signalling thread failed: {e!r}")
            launcher = launcher_of(psutil.Process(os.getpid()))
            if launcher is not None:
                launcher.send_signal(signal.SIGTERM)

    thread = threading.Thread(target=preempt_then_guard_stop, daemon=True)
    thread.start()
    with pytest.raises(TrainingStopped) as stopped:
        pipeline(config)
    thread.join(timeout=30)
    assert not failed, failed
    assert "stopped by cost-guard: stalled" in str(stopped.value)
    assert fired == ["preempt", "guard"]

    job = next((work / "jobs").glob("*"))
    attempts = AttemptLog(job).history()  # started + ended records, folded per attempt
    assert [a["outcome"] for a in attempts] == ["preempted", "stopped"]  # not relaunched
    run_id = (job / "mlflow_run_id").read_text().strip()
    run = MlflowClient(config.tracking_uri()).get_run(run_id)
    assert run.info.status == "KILLED"
    # As attempts.jsonl and stoker status (trial: the ranks' tag said `preempted`).
    assert (run.data.tags["stoker.last_outcome"], run.data.tags["stoker.stopped_by"]) == (
        "stopped", "cost-guard: stalled: no progress for 600 s"), run.data.tags

    with get_client(sync_client=True) as client:
        [flow_run] = client.read_flow_runs()
        tasks = {t.name: t.state for t in client.read_task_runs()}
    assert flow_run.state.type.value == "CANCELLED"
    assert "cost-guard" in flow_run.state.message
    assert (tasks["attempt-1"].type.value, tasks["attempt-1"].name) == ("COMPLETED", "Preempted")
    assert (tasks["attempt-2"].type.value, tasks["attempt-2"].name) == ("CANCELLED",
                                                                      "StoppedByGuard")
    assert "attempt-3" not in tasks
    train = next(state for name, state in tasks.items() if name.startswith("train"))
    assert train.type.value == "CANCELLED"
    # Attempt 1's progress lines all come before attempt 2 starts (a late "step N/M (attempt
    # 1)" line used to follow "attempt 2 on ...": the watcher polls every 5 s).
    # The flow's last lines are still on their way to the server (Prefect sends logs in the
    # background): every line this process logged is sent first.
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30, at_exit=False)
    logs = []
    with get_client(sync_client=True) as client:
        while page := client.read_logs(limit=200, offset=len(logs)):
            logs.extend(page)
    messages = [log.message for log in sorted(logs, key=lambda r: r.timestamp)]
    second = next(i for i, m in enumerate(messages) if m.startswith("attempt 2 on "))
    assert not [m for m in messages[second:] if "(attempt 1)" in m], messages[second:]
    # The ranks' stop lines name who asked: a bare SIGTERM for the preemption, the guard's
    # request for the second stop (they said "stop requested (SIGTERM)" for both).
    first = {m.split("stop requested (", 1)[1].split("): ", 1)[0]
             for m in messages[:second] if "stop requested (" in m}
    assert first and first <= {"SIGTERM", "another rank"}, first
    assert [m for m in messages[second:] if "stop requested (SIGTERM: stopped by cost-guard: "
            "stalled: no progress for 600 s): checkpoint committed at step" in m], messages[second:]
    # A rank's WARNING line is a WARNING in the Prefect log as well (it was INFO there, so the
    # UI's level filter missed it); other lines stay INFO.
    ranks = {log.message: log.level for log in logs if log.message.startswith("[rank")}
    assert {level for m, level in ranks.items() if "stop requested (" in m} == {30}, ranks
    assert {level for m, level in ranks.items() if " INFO " in m} <= {20}, ranks


def test_a_requested_stop_is_not_retried_whatever_the_exit_code():
    from stoker.config import RetryConfig
    from stoker.launch.retry import Outcome, run_with_retries

    for code in (75, 137, 1):
        calls: list[int] = []
        attempts = run_with_retries(lambda n, c=code, log=calls: log.append(n) or c,
                                    RetryConfig(backoff_s=0, max_user_errors=3),
                                    sleep=lambda s: None, stop_requested=lambda: True)
        assert calls == [1] and attempts[-1].outcome is Outcome.STOPPED
    attempts = run_with_retries(lambda n: 0, RetryConfig(), stop_requested=lambda: True)
    assert attempts[-1].outcome is Outcome.COMPLETED  # it finished before the stop landed


def test_stop_request_file_round_trip_and_torn_file(tmp_path):
    from stoker.jobs.stop_request import (
        STOP_FILE,
        clear_stop_request,
        read_stop_request,
        request_stop,
    )

    assert read_stop_request(tmp_path) is None
    # A reason is one line wherever it is quoted (trial: a newline split stoker stop's, stoker
    # run's and stoker status's lines, and the rank's log line lost its [rankN] prefix).
    written = request_stop(tmp_path, "user", 'it\'s "quoted"\nline2\tünïcødé ☃\x1b[31m')
    assert written.reason == 'it\'s "quoted" line2 ünïcødé ☃ [31m'
    (tmp_path / STOP_FILE).write_text(json.dumps({"by": "some\nbody", "reason": "a\r\nb " * 200,
                                                  "time": 1.0}))
    forged = read_stop_request(tmp_path)
    assert forged.by == "some body" and "\n" not in forged.reason and len(forged.reason) == 300
    from stoker.runtime.preemption import stop_sender

    assert stop_sender(tmp_path, 0.0) == "stopped by some body: " + " ".join(["a b"] * 200)
    request_stop(tmp_path, "user", "maintenance")
    assert read_stop_request(tmp_path).describe() == "stopped by user: maintenance"
    (tmp_path / STOP_FILE).write_text('{"by": "cost-gu')  # torn write
    assert read_stop_request(tmp_path).by == "unknown"  # still a stop someone asked for
    clear_stop_request(tmp_path)
    assert read_stop_request(tmp_path) is None


def test_prefect_crash_lines_of_a_stop_read_as_what_happened(monkeypatch):
    """Ctrl-C: the terminal showed Prefect's ERROR "Crash detected! ..." and "Finished in state
    Crashed(...)" although the run is recorded Cancelled; without a stop they stay as they are."""
    import logging

    import stoker.stopping
    from stoker.orchestration.stop_logs import StopLogFilter

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, message, (),
                                 None)

    crash = record("Crash detected! Execution was aborted by an interrupt signal.")
    assert StopLogFilter().filter(crash) and crash.levelno == logging.ERROR  # no stop: kept
    monkeypatch.setattr(stoker.stopping, "_received", [signal.SIGINT])
    line = record("Crash detected! Execution was aborted by an interrupt signal.")
    assert StopLogFilter().filter(line)
    assert line.levelno == logging.INFO
    assert line.getMessage() == "stopped by SIGINT (Ctrl-C): recorded as Cancelled"
    # ... said once per run: Prefect's "Finished in state ..." lines of the stop are dropped.
    for message in ("Finished in state Crashed('Execution was aborted by an interrupt signal.')",
                    "Finished in state Running()"):
        assert not StopLogFilter().filter(record(message))
    # A stop request (stoker stop, the guard): the flow run's last line says Cancelled, as
    # after a Ctrl-C (trial: it had none); a task run's is dropped (its line came before).
    stopped = record("Finished in state Failed('Flow run encountered an exception: "
                     "TrainingStopped: stopped by user: maintenance (disk)')")
    assert StopLogFilter().filter(stopped) and stopped.levelno == logging.INFO
    assert stopped.getMessage() == \
        "Finished in state Cancelled('stopped by user: maintenance (disk)')"
    task = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1,
                             "Finished in state Failed('Task run encountered an exception "
                             "TrainingStopped: stopped by user: maintenance')", (), None)
    assert not StopLogFilter().filter(task)
    # The flow run's exception line is dropped (its Finished line says it); a task run's stays.
    assert not StopLogFilter().filter(record(
        "Encountered exception during execution: TrainingStopped('job x stopped by user')"))
    # A reason with quotes is quoted once (trial: Prefect's line is already a literal, and it
    # was escaped again: it\\\'s).
    quoted = record("Finished in state Failed('Flow run encountered an exception: "
                    "TrainingStopped: stopped by user: it\\'s \"quoted\" ☃')")
    assert StopLogFilter().filter(quoted)
    assert quoted.getMessage() == \
        "Finished in state Cancelled('stopped by user: it\\'s \"quoted\" ☃')"
    other = record("Finished in state Failed('boom')")
    assert StopLogFilter().filter(other) and other.levelno == logging.ERROR
    # An attempt's infrastructure failure is retried: a warning (it was an ERROR line).
    retried = record("Finished in state InfrastructureFailure('exit 137 (SIGKILL): "
                     "infrastructure_failure')")
    assert StopLogFilter().filter(retried)
    assert (retried.levelno, retried.levelname) == (logging.WARNING, "WARNING")
    assert retried.getMessage().startswith("Finished in state InfrastructureFailure('exit 137")
    # ... and Prefect's line before it, with its empty traceback (trial: still an ERROR).
    failed = record("Task run failed with state: InfrastructureFailure(message='exit 137 from "
                    "rank 0 itself, not a kill: infrastructure_failure', type=FAILED)")
    failed.exc_info = (None, None, None)
    assert StopLogFilter().filter(failed)
    assert (failed.levelno, failed.exc_info) == (logging.WARNING, None)
    # One that is not retried (its budget spent) stays an ERROR (trial: a WARNING), untraced.
    spent = record("Task run failed with state: InfrastructureFailure(message='exit 137 "
                   "(SIGKILL): infrastructure_failure, no retry left', type=FAILED)")
    spent.exc_info = (None, None, None)
    assert StopLogFilter().filter(spent)
    assert (spent.levelno, spent.levelname, spent.exc_info) == (logging.ERROR, "ERROR", None)


def test_an_attempt_state_says_when_no_retry_follows():
    """New-user trial: with retry.max_infra_failures=0 the attempt read as one that is retried
    (and a preemption past retry.max_preemptions read "resumed")."""
    from tasks.stopping import attempt_state

    assert attempt_state(137, None, retried=True).message == \
        "exit 137 (SIGKILL): infrastructure_failure"
    spent = attempt_state(137, None, retried=False)
    assert (spent.name, spent.message, spent.is_failed()) == (
        "InfrastructureFailure", "exit 137 (SIGKILL): infrastructure_failure, no retry left",
        True)
    # Said as the attempt ends, before the next one starts (trial: "resumed" read as done).
    assert attempt_state(75, None).message == \
        "exit 75: preempted (checkpoint committed, to be resumed)"
    assert attempt_state(75, None, retried=False).message == \
        "exit 75: preempted (checkpoint committed, no retry left)"


def test_the_spent_retry_budget_is_named():
    from stoker.config import RetryConfig
    from stoker.launch.retry import budget_spent, run_with_retries

    codes = iter([75, 137, 137, 137])
    policy = RetryConfig(backoff_s=0, max_infra_failures=2)
    attempts = run_with_retries(lambda n: next(codes), policy, sleep=lambda s: None)
    assert budget_spent(policy, attempts) == (
        "3 infrastructure_failure attempts, more than retry.max_infra_failures=2")
    once = run_with_retries(lambda n: 137, RetryConfig(max_infra_failures=0))
    assert budget_spent(RetryConfig(max_infra_failures=0), once) == (
        "1 infrastructure_failure attempt, more than retry.max_infra_failures=0")
    assert budget_spent(policy, run_with_retries(lambda n: 0, policy)) is None
    assert budget_spent(policy, run_with_retries(lambda n: 1, policy)) is None  # a bug: its own



def test_an_interrupted_launcher_calls_the_hooks_before_it_stops_the_tree(tmp_path):
    """On a worker a Prefect cancel is Prefect's TerminationSignal raised into the launcher's
    wait, and it reached the ranks as a bare SIGTERM: the launcher now runs the on_interrupt
    hooks (the train task records the sender there) while the tree still runs. A failing hook
    is ignored; outside the context no hook runs."""
    from stoker.launch.local import LocalLauncher
    from stoker.stopping import on_interrupt

    launcher = LocalLauncher(1, shutdown_grace_s=5)
    seen: list[tuple[str, bool]] = []

    def hook(error: BaseException) -> None:
        seen.append((type(error).__name__, launcher.process.poll() is None))

    def failing(_error: BaseException) -> None:
        raise RuntimeError("a hook that fails")

    with on_interrupt(failing), on_interrupt(hook), pytest.raises(subprocess.TimeoutExpired):
        launcher.run(tmp_path / "missing.yaml", on_line=lambda line: None, timeout_s=0.01)
    assert seen == [("TimeoutExpired", True)]  # called while the launcher still ran
    assert launcher.process.poll() is not None  # then stopped
    with pytest.raises(subprocess.TimeoutExpired):
        launcher.run(tmp_path / "missing.yaml", on_line=lambda line: None, timeout_s=0.01)
    assert len(seen) == 1


def test_the_stop_line_starts_a_new_line_only_after_a_terminals_echo():
    """A blank line came before `stoker run: stopping` in a piped log and after a `kill`
    (new-user trial): the newline is there only to end the `^C` a terminal echoes."""
    import pty

    from stoker.terminal import after_echo

    assert after_echo(signal.SIGINT) == ""  # stderr is not a terminal here
    controller, terminal = pty.openpty()
    saved = os.dup(2)
    try:
        os.dup2(terminal, 2)
        assert after_echo(signal.SIGINT) == "\n"
        assert after_echo(signal.SIGTERM) == ""  # nothing echoed for a kill
    finally:
        os.dup2(saved, 2)
        for fd in (saved, controller, terminal):
            os.close(fd)


@pytest.mark.parametrize("outcome", ["stopped", "done"])
def test_the_commands_last_lines_follow_what_prefect_says_as_its_api_context_ends(
        monkeypatch, tmp_path, outcome):
    """Trial: after an early Ctrl-C, `EventsWorker - Still processing items` came after `stoker
    run: stopped by ...`, the line that should end the command. Prefect's workers send what is
    queued as the API context ends; whatever they say then now comes before the command's own
    last lines (the summary on stdout, a stop's line on stderr)."""
    import contextlib
    import sys
    from types import SimpleNamespace

    from typer.testing import CliRunner

    import flows.pipeline
    import stoker.cli
    import stoker.tracking.command_goodput
    from stoker import stopping
    from stoker.jobs.stop_request import TrainingStopped

    @contextlib.contextmanager
    def api(log_path=None):
        yield
        print("WARNING | EventsWorker - Still processing items: 2 items remaining...",
              file=sys.stderr, flush=True)

    def pipeline(config):
        if outcome == "stopped":
            raise TrainingStopped("stopped by a stop request (stoker stop)")
        return {"run_id": "r", "cost": {}}

    def exit_now(code):
        raise SystemExit(code)

    config = SimpleNamespace(work_dir=str(tmp_path), tracking_uri=lambda: "sqlite:///x.db")
    monkeypatch.setattr(stoker.cli, "_before_the_flow", lambda *args: config)
    monkeypatch.setattr(stoker.cli, "prefect_api", api)
    monkeypatch.setattr(flows.pipeline, "pipeline", pipeline)
    monkeypatch.setattr(stoker.tracking.command_goodput, "record_command_goodput",
                        lambda summary, uri: summary)
    monkeypatch.setattr(stopping, "install", lambda: None)
    monkeypatch.setattr(stopping, "exit_now", exit_now)
    result = CliRunner().invoke(stoker.cli.app, ["run"])
    if outcome == "stopped":
        assert result.exit_code == stopping.EXIT_STOPPED, result.output
        assert result.stderr.splitlines()[-1] == (
            "stoker run: stopped by a stop request (stoker stop)"), result.stderr
    else:
        assert result.exit_code == 0, result.output
        # CliRunner's output interleaves stdout and stderr in the order they were written.
        assert result.output.splitlines()[0].startswith("WARNING | EventsWorker"), result.output
        assert json.loads(result.stdout) == {"run_id": "r", "cost": {}}


def test_a_stop_signal_once_the_job_is_done_ends_the_command_as_done(monkeypatch, tmp_path,
                                                                     capfd):
    """Trial: SIGTERM right after `Flow run ... Finished in state Completed()` exited 143 with
    `stoker run: stopped by SIGTERM; run the same command again`, and that rerun trained and
    registered another version. Once the job is done a stop signal is said and the command
    ends as done: exit 0, the summary last."""
    import contextlib
    from types import SimpleNamespace

    from typer.testing import CliRunner

    import flows.pipeline
    import stoker.cli
    import stoker.tracking.command_goodput
    from stoker import stopping

    @contextlib.contextmanager
    def api(log_path=None):
        yield
        os.kill(os.getpid(), signal.SIGTERM)  # while Prefect sends what it queued

    def exit_now(code):
        raise SystemExit(code)

    config = SimpleNamespace(work_dir=str(tmp_path), tracking_uri=lambda: "sqlite:///x.db")
    monkeypatch.setattr(stoker.cli, "_before_the_flow", lambda *args: config)
    monkeypatch.setattr(stoker.cli, "prefect_api", api)
    monkeypatch.setattr(flows.pipeline, "pipeline", lambda config: {"run_id": "r", "cost": {}})
    monkeypatch.setattr(stoker.tracking.command_goodput, "record_command_goodput",
                        lambda summary, uri: summary)
    monkeypatch.setattr(stopping, "exit_now", exit_now)
    handlers = {sig: signal.getsignal(sig) for sig in stopping.STOP_SIGNALS}
    try:
        result = CliRunner().invoke(stoker.cli.app, ["run"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    said = capfd.readouterr().err  # the signal handler writes to fd 2 itself
    assert result.exit_code == 0, result.output + said
    assert said.splitlines()[-1] == (
        "stoker run: SIGTERM after the job was done: nothing to stop and nothing to run again; "
        "ending as done"), said
    assert json.loads(result.stdout) == {"run_id": "r", "cost": {}}


def test_a_second_stop_signal_once_the_job_is_done_exits_0_with_its_summary(tmp_path):
    """A second signal after the job is done ends the process at once, as done: exit 0, the
    summary on stdout unless it was said already."""
    script = (
        "import os, signal, time\n"
        "from stoker import stopping\n"
        "stopping.install()\n"
        "stopping.note_done('{\"run_id\": \"r\"}')\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(0.2)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"run_id": "r"}
    assert done.stderr.splitlines() == [
        "stoker run: SIGINT (Ctrl-C) after the job was done: nothing to stop and nothing to run "
        "again; ending as done"]
    said = subprocess.run([sys.executable, "-c", script.replace(
        "os.kill(os.getpid(), signal.SIGINT)", "stopping.summary_said(); "
        "os.kill(os.getpid(), signal.SIGINT)")], capture_output=True, text=True, timeout=60)
    assert said.returncode == 0 and said.stdout == "", said.stderr


def test_one_signal_delivered_twice_is_one_stop_and_a_later_one_a_second(tmp_path):
    """Trial: `timeout 300 stoker run ...` got one SIGINT as two (GNU timeout sends its signal to
    the command, then to its whole process group) and said "stopped at once (second signal)",
    giving up the stop checkpoint. The same signal again within DUPLICATE_WINDOW_S is the same
    stop; one later is a second signal. (Each delivery runs the handler, as two deliveries do
    when the first one's handler has run in between.)"""
    script = (
        "import signal, time\n"
        "from stoker import stopping\n"
        "stopping.install()\n"
        "try:\n"
        "    stopping._handle(signal.SIGINT, None)\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
        "stopping._handle(signal.SIGINT, None)  # the same delivery again\n"
        "print('one stop', flush=True)\n"
        "time.sleep(stopping.DUPLICATE_WINDOW_S + 0.1)\n"
        "stopping._handle(signal.SIGINT, None)  # a person's second Ctrl-C\n"
        "print('not reached', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout == "one stop\n", done.stdout + done.stderr
    assert done.returncode == 130, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == "stoker run: stopping (SIGINT (Ctrl-C))", done.stderr
    assert lines[-1].startswith("stoker run: stopped at once (second signal)"), done.stderr


def test_a_retried_infrastructure_failure_is_logged_as_a_warning_on_the_server(harness):
    """New-user trial: besides "Finished in state InfrastructureFailure(...)", Prefect logs
    "Task run failed with state: InfrastructureFailure(...)" as an ERROR with an empty
    traceback. Both reach the server as WARNINGs: the attempt is retried."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    from tasks.stopping import attempt_state, install_stop_log_filter

    @task(name="attempt-1")
    def attempt():
        return attempt_state(137, None, 1)

    @task(name="attempt-2")
    def last_attempt():  # not retried: its budget is spent
        return attempt_state(137, None, 1, retried=False)

    @flow
    def one_attempt():
        install_stop_log_filter()
        last_attempt(return_state=True)
        return attempt(return_state=True)

    state = one_attempt(return_state=True)
    APILogWorker.drain_all(timeout=30, at_exit=False)
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[state.state_details.flow_run_id])))
    levels = {log.message.split("(", 1)[0]: log.level for log in logs
              if "InfrastructureFailure" in log.message and "no retry left" not in log.message}
    assert levels == {"Task run failed with state: InfrastructureFailure": logging.WARNING,
                      "Finished in state InfrastructureFailure": logging.WARNING}, levels
    spent = {log.message.split("(", 1)[0]: log.level for log in logs
             if "InfrastructureFailure" in log.message and "no retry left" in log.message}
    assert spent == {"Task run failed with state: InfrastructureFailure": logging.ERROR,
                     "Finished in state InfrastructureFailure": logging.ERROR}, spent
    assert not [log for log in logs if "NoneType: None" in log.message]


def test_stoker_stop_refuses_a_negative_timeout(tmp_path):
    """Trial: ``--timeout -1`` was taken, and the stop then 'failed' at once with exit 1."""
    from typer.testing import CliRunner

    from stoker.cli import app

    result = CliRunner().invoke(app, ["stop", "somejob", "--timeout", "-1",
                                      "--work-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--timeout" in result.output, result.output
