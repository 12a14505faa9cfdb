"""Every way to stop ``stoker run`` on real processes: Ctrl-C, a second Ctrl-C, SIGTERM, SIGKILL.

``stoker run`` runs as a subprocess in the default embedded mode (no PREFECT_API_URL: it starts the
long-lived local Prefect server of its work folder, which outlives it), in its own session so that
``killpg`` reaches it like a terminal's Ctrl-C reaches the foreground process group.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import rank_processes
from local_servers import embedded_env, stop_local_servers
from mlflow import MlflowClient

from stoker.jobs.attempts import AttemptLog
from stoker.jobs.status import job_summary
from stoker.local_server import LocalServer
from stoker.runtime.checkpoint import Checkpointer
from stoker.runtime.progress import read_events

pytestmark = pytest.mark.integration


def start_run(work: Path, *overrides: str) -> subprocess.Popen:
    env = embedded_env(work)
    command = [sys.executable, "-m", "stoker.cli", "run", f"work_dir={work}", "train.epochs=40",
               "tracking.system_metrics_interval_s=null", *overrides]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(work.parent / "stoker-run.log", "w"),  # noqa: SIM115
                            start_new_session=True)


@pytest.fixture(autouse=True)
def _no_leftovers(tmp_path):
    """Whatever a failed test left running is killed (a test must not leak a trainer); the
    local server is stopped."""
    yield
    stop_local_servers(tmp_path)
    for proc in psutil.process_iter():
        try:
            if str(tmp_path) in " ".join(proc.cmdline()) + proc.environ().get("PREFECT_HOME", ""):
                proc.kill()
        except psutil.Error:
            pass


def wait_for_training(work: Path, process: subprocess.Popen, timeout_s: float = 300) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        jobs = list((work / "jobs").glob("*")) if (work / "jobs").exists() else []
        # a step trained and the MLflow run open (it opens in the background: a stop in the
        # first seconds leaves no run until the job resumes)
        if jobs and any(e["event"] == "step" for e in read_events(jobs[0])) and (
                jobs[0] / "mlflow_run_id").is_file():
            return jobs[0]
        time.sleep(0.05)
    log = (work.parent / "stoker-run.log").read_text()[-3000:]
    raise AssertionError(f"training never started (exit {process.poll()}):\n{log}")


def processes_of(work: Path, server_too: bool = False) -> list[str]:
    """Live processes whose command line or environment names this test's work folder (the
    local Prefect server, which outlives ``stoker run``, only with ``server_too``)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
            continue
        try:
            text = " ".join(proc.info["cmdline"] or []) + " " + proc.environ().get(
                "PREFECT_HOME", "")
        except psutil.Error:
            continue
        if str(work) in text and (server_too or "uvicorn" not in text):
            found.append(text[:200])
    return found


def wait_gone(work: Path, timeout_s: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_of(work)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def mlflow_status(work: Path, job_dir: Path) -> str:
    run_id = (job_dir / "mlflow_run_id").read_text().strip()
    return MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_run(run_id).info.status


def prefect_states(work: Path, table: str) -> dict[str, tuple[str, str]]:
    """name -> (state type, state message) read from the embedded server's own database."""
    with sqlite3.connect(work / ".prefect" / "prefect.db") as db:
        rows = db.execute(f"SELECT r.name, s.type, s.message FROM {table} r JOIN "
                          f"{table}_state s ON s.id = r.state_id").fetchall()
    return {name: (kind, message) for name, kind, message in rows}


def state_history(work: Path) -> list[str]:
    """Every state type the flow runs of this work folder went through, oldest first."""
    with sqlite3.connect(work / ".prefect" / "prefect.db") as db:
        return [row[0] for row in db.execute(
            "SELECT type FROM flow_run_state ORDER BY timestamp")]


def test_ctrl_c_commits_a_checkpoint_and_exits_130(tmp_path):
    work = tmp_path / "work"
    process = start_run(work)
    job_dir = wait_for_training(work, process)
    os.killpg(process.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    sent = time.monotonic()
    tree_gone = None
    while process.poll() is None and time.monotonic() - sent < 120:
        if tree_gone is None and not [p for p in processes_of(work) if "stoker.runtime" in p]:
            tree_gone = time.monotonic()
        time.sleep(0.05)
    code = process.wait(timeout=10)
    exited = time.monotonic()
    # Measured, not asserted (a shared machine's load decides these).
    print(f"\nCtrl-C -> training tree gone {(tree_gone or exited) - sent:.1f} s -> exit "
          f"{exited - (tree_gone or exited):.1f} s later")
    log = (tmp_path / "stoker-run.log").read_text()
    assert code == 130, log[-3000:]
    assert "Crash detected" not in log and "state Crashed" not in log  # it was no crash
    assert wait_gone(work) == []  # no rank, no torchrun left
    assert LocalServer(work / ".prefect").running() is not None  # the server lives on
    end = [e for e in read_events(job_dir) if e["event"] == "end"][-1]
    assert end["outcome"] == "preempted"
    assert Checkpointer(str(job_dir / "checkpoints"), 0, 1).committed_steps()[-1] == end["step"]
    assert log.rstrip().endswith(f"its ranks committed a stop checkpoint at step {end['step']}; "
                                 "run the same command to resume"), log[-3000:]
    # Said at once, before the ranks' lines (new-user trial: nothing for 17 s while a stalled
    # rank could not save, so a second Ctrl-C looked necessary).
    said = log.index("stoker run: stopping (SIGINT (Ctrl-C)): the ranks commit a stop "
                     "checkpoint first (up to train.preemption_grace_s); a second Ctrl-C (any "
                     "stop signal) stops at once without it")
    assert said < log.index("stop requested (SIGTERM: stoker run got SIGINT"), log[-3000:]
    # The ranks name the Ctrl-C, not only the SIGTERM the launcher passed on.
    assert "stop requested (SIGTERM: stoker run got SIGINT (Ctrl-C)): checkpoint committed at " \
        f"step {end['step']}" in log, log[-3000:]
    assert mlflow_status(work, job_dir) == "KILLED"
    # The run's tags say what attempts.jsonl and stoker status say (trial: `preempted`).
    tags = MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_run(
        (job_dir / "mlflow_run_id").read_text().strip()).data.tags
    assert (tags["stoker.last_outcome"], tags["stoker.stopped_by"]) == (
        "interrupted", "SIGINT (Ctrl-C)"), tags
    last = max(e["step"] for e in read_events(job_dir) if e["event"] == "step")
    assert last < 40 * 22  # it stopped, it did not train to the end
    [(flow_state, message)] = prefect_states(work, "flow_run").values()
    assert flow_state == "CANCELLED" and "SIGINT" in message
    # Never Crashed on the way (automations and notifications on Crashed would fire).
    assert "CRASHED" not in state_history(work), state_history(work)
    assert prefect_states(work, "task_run")["attempt-1"][0] == "CANCELLED"
    # The stopped attempt is on record at once (not only once a next run closes it) ...
    (attempt,) = AttemptLog(job_dir).history()
    assert attempt["outcome"] == "interrupted" and attempt["runtime_outcome"] == "preempted"
    assert attempt["duration_s"] > 0 and attempt["stopped_by"] == "SIGINT (Ctrl-C)"
    # ... and the job reads as stopped (was: "unfinished", as after a crash; new-user trial),
    # not running, resuming at its stop checkpoint (not "restarting").
    summary = job_summary(job_dir)
    assert summary.state == "stopped" and summary.attempts == 1
    assert summary.progress.describe().startswith("not running: reached step "), summary
    assert summary.progress.describe().endswith(
        f"resumes at step {end['step']} (run the same command)")


def test_second_ctrl_c_stops_at_once(tmp_path):
    work = tmp_path / "work"
    process = start_run(work, "train.preemption_grace_s=60")
    wait_for_training(work, process)
    # A rank that cannot save (stalled): what makes a user press Ctrl-C twice, and what keeps
    # the stop under way at the second one on a fast machine (its ranks committed in 0.3 s).
    ranks = rank_processes(psutil.Process(process.pid))
    assert ranks, "no rank found"
    ranks[max(ranks)].send_signal(signal.SIGSTOP)
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(0.3)
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=30) == 130
    assert wait_gone(work, timeout_s=10) == []
    # Its flow run and task runs are Cancelled at once, not left Running (then marked Crashed
    # by the next command, "its process died": trial).
    why = "stopped at once (a second signal after SIGINT (Ctrl-C))"
    assert list(prefect_states(work, "flow_run").values()) == [("CANCELLED", why)]
    tasks = prefect_states(work, "task_run")
    assert tasks["attempt-1"] == ("CANCELLED", why), tasks
    assert not [name for name, (kind, _) in tasks.items() if kind in ("RUNNING", "PENDING")]
    assert "CRASHED" not in state_history(work), state_history(work)


@pytest.mark.parametrize(("sig", "code", "reason"), [
    (signal.SIGTERM, 143, "SIGTERM"),  # `kill PID`
    (signal.SIGHUP, 129, "SIGHUP (terminal closed)"),  # the terminal window closed
])
def test_sigterm_or_sighup_to_stoker_run_is_the_same_stop(tmp_path, sig, code, reason):
    work = tmp_path / "work"
    process = start_run(work)
    job_dir = wait_for_training(work, process)
    process.send_signal(sig)  # to stoker run alone
    exit_code = process.wait(timeout=120)
    log = (tmp_path / "stoker-run.log").read_text()
    assert exit_code == code, log[-3000:]
    assert wait_gone(work) == []
    ends = [e for e in read_events(job_dir) if e["event"] == "end"]
    assert ends and ends[-1]["outcome"] == "preempted", log[-3000:]
    # The last line says what the stop kept (new-user trial: it said the same after a stop
    # that lost 29 steps).
    assert log.rstrip().endswith(
        f"stoker run: stopped by {reason}; job {job_dir.name}: its ranks committed a stop "
        f"checkpoint at step {ends[-1]['step']}; run the same command to resume"), log[-3000:]
    assert mlflow_status(work, job_dir) == "KILLED"
    # Stoker's stop, not Prefect's SIGTERM bridge: a stop, not a crash or a restart.
    assert "Crash detected" not in log and "restarting" not in log, log[-3000:]
    assert f"stopping ({reason}): checkpoint committed" in log, log[-3000:]
    [(flow_state, message)] = prefect_states(work, "flow_run").values()
    assert flow_state == "CANCELLED" and reason in message, (flow_state, message)
    assert "CRASHED" not in state_history(work), state_history(work)


def test_sigkill_of_stoker_run_leaves_the_server_and_the_next_command_crashes_its_run(tmp_path):
    """The ranks go (parent-death signal); the local server lives on with the flow run Running;
    the next command that uses the server marks that run Crashed (its process is gone)."""
    work = tmp_path / "work"
    process = start_run(work)
    job_dir = wait_for_training(work, process)
    server = LocalServer(work / ".prefect").running()
    assert server is not None  # the local server, recorded in the work folder
    process.kill()
    process.wait(timeout=10)
    assert wait_gone(work, timeout_s=60) == []  # no rank, no torchrun
    assert LocalServer(work / ".prefect").running() == server
    [(flow_state, _)] = prefect_states(work, "flow_run").values()
    assert flow_state == "RUNNING"
    guard = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "cost-guard", f"work_dir={work}",
         "policy.window_s=10", "policy.sample_interval_s=5"], capture_output=True, text=True,
        timeout=300, env=embedded_env(work))
    assert guard.returncode == 0, guard.stderr[-3000:]
    states = prefect_states(work, "flow_run")
    assert sorted(kind for kind, _ in states.values()) == ["COMPLETED", "CRASHED"], states
    [message] = [m for kind, m in states.values() if kind == "CRASHED"]
    assert f"pid {process.pid}" in message
    # Its task runs too: the Prefect UI showed `train` and `attempt-1` Running forever (QA).
    tasks = prefect_states(work, "task_run")
    assert {name.rsplit("-", 1)[0] for name, (kind, _) in tasks.items()
            if kind == "CRASHED"} >= {"train", "attempt"}, tasks
    assert [name for name, (kind, _) in tasks.items() if kind in ("RUNNING", "PENDING")] == []
    assert job_summary(job_dir).state == "unfinished"  # it died: nobody stopped it


def test_a_killed_local_server_is_started_again_and_the_run_finishes(tmp_path):
    """SIGKILL of the local Prefect server mid-training (OOM killer, `kill -9`): it is started
    again on the same port with the same database, and the run ends as if nothing happened
    (it failed after training, with no model registered, 77 s later)."""
    work = tmp_path / "work"
    process = start_run(work, "train.epochs=6")
    job_dir = wait_for_training(work, process)
    server = LocalServer(work / ".prefect").running()
    psutil.Process(server["pid"]).kill()
    code = process.wait(timeout=300)
    log = (tmp_path / "stoker-run.log").read_text()
    assert code == 0, log[-3000:]
    assert "the local Prefect server died: started again at " + \
        server["api_url"].removesuffix("/api") in log
    again = LocalServer(work / ".prefect").running()
    assert again is not None and again["pid"] != server["pid"]
    assert again["port"] == server["port"]
    [(flow_state, _)] = prefect_states(work, "flow_run").values()
    assert flow_state == "COMPLETED"
    assert (job_dir / "pipeline_done.json").is_file()
    versions = MlflowClient(f"sqlite:///{work / 'mlflow.db'}").search_model_versions()
    assert [v.run_id for v in versions] == [(job_dir / "mlflow_run_id").read_text().strip()]


def test_a_second_signal_after_the_stop_committed_says_what_it_kept():
    """Third trial: the second Ctrl-C came 0.3 s after the first, once the ranks had committed
    their stop checkpoint, and the last line said "no stop checkpoint"."""
    from stoker import stopping

    stopping.install()
    try:
        assert "without waiting for the stop checkpoint" in stopping.second_signal_line()
        stopping.note_outcome("job digits-1: its ranks committed a stop checkpoint at step 757")
        # Fifth trial: the stop was complete, and the flow run read "stopped by SIGINT".
        assert stopping.second_signal_line() == stopping.stopped_line() == (
            "stoker run: stopped by an interrupt; job digits-1: its ranks committed a stop "
            "checkpoint at step 757; run the same command to resume")
    finally:  # this test process's own handlers back
        for sig in stopping.STOP_SIGNALS:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)


def test_a_second_signal_between_the_ranks_end_and_its_record_says_what_they_kept(tmp_path):
    """Fourth trial: a second Ctrl-C right after the ranks committed their stop checkpoint, but
    before stoker run had recorded the attempt's end, still said "without waiting for the stop
    checkpoint". The job's progress.jsonl already said what they kept."""
    from stoker import stopping
    from stoker.jobs.attempts import AttemptLog
    from stoker.runtime.progress import ProgressWriter

    log = AttemptLog(tmp_path)
    log.start(1, "on_demand", "flow-run-1")
    progress = ProgressWriter(tmp_path, world_size=2)
    progress.event("start", 700, total_steps=1449, resumed=True)

    def probe() -> str | None:  # as tasks.train's
        what = log.open_attempt_end()
        return f"job digits-1: {what}" if what else None

    stopping.install()
    try:
        with stopping.outcome_probe(probe):
            progress.event("step", 757, epoch=3, loss=0.1, lr=0.01, samples_per_s=900.0)
            # No end yet: the second signal kills ranks that had not saved.
            assert "without waiting for the stop checkpoint" in stopping.second_signal_line()
            progress.event("checkpoint", 757, path=str(tmp_path / "checkpoints"))
            progress.event("end", 757, outcome="preempted")
            assert stopping.second_signal_line() == (
                "stoker run: stopped at once (second signal); job digits-1: its ranks "
                "committed a stop checkpoint at step 757; run the same command to resume")
        progress.close()
        assert "without waiting" in stopping.second_signal_line()  # only while inside
    finally:  # this test process's own handlers back
        for sig in stopping.STOP_SIGNALS:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)


def test_the_last_line_after_a_stop_says_the_steps_it_lost():
    """A stop whose checkpoint did not commit (the grace ran out, a data worker hung): the last
    line names the steps lost instead of implying nothing was (new-user trial: 29 steps)."""
    from stoker import stopping
    from stoker.jobs.attempts import describe_interrupted

    record = {"interrupted": True, "runtime_outcome": "interrupted", "reached_step": 69,
              "committed_step": 40, "steps_lost": 29}
    stopping.install()
    try:
        stopping.note_outcome(f"job digits-1: {describe_interrupted(record)}")
        assert stopping.stopped_line() == (
            "stoker run: stopped by an interrupt; job digits-1: its ranks recorded no end: "
            "reached step 69, last checkpoint at step 40, 29 step(s) lost; run the same command "
            "to resume")
        stopping.install()  # a new run of the command forgets it
        # Nothing trained in this run (a Ctrl-C during the pull): nothing to resume yet.
        assert stopping.stopped_line() == (
            "stoker run: stopped by an interrupt; run the same command again")
    finally:  # this test process's own handlers back
        for sig in stopping.STOP_SIGNALS:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)



def cancel_from_prefect(work: Path, job_dir: Path) -> str:
    """Cancel the flow run training ``job_dir`` as the Prefect UI does (state Cancelling), on
    the work folder's local server; returns the flow run's name."""
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    api_url = LocalServer(work / ".prefect").running()["api_url"]
    flow_run_id = next(r["flow_run_id"] for r in AttemptLog(job_dir).records())
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        client.set_flow_run_state(uuid.UUID(flow_run_id), Cancelling(), force=True)
        return client.read_flow_run(uuid.UUID(flow_run_id)).name


def test_a_prefect_cancel_of_a_stoker_run_flow_run_stops_the_job(tmp_path):
    """Cancel in the Prefect UI of a ``stoker run`` flow run: no worker runs it, so nothing
    carried the cancel out and the job trained on while the run stayed Cancelling. The flow
    stops the job itself (as ``stoker stop`` would): a stop checkpoint, the run Cancelled,
    ``stoker run`` exits 3 with a line naming the cancel; the same command resumes."""
    work = tmp_path / "work"
    process = start_run(work, "train.epochs=300")
    job_dir = wait_for_training(work, process)
    name = cancel_from_prefect(work, job_dir)
    code = process.wait(timeout=120)
    log = (work.parent / "stoker-run.log").read_text()
    assert code == 3, log[-3000:]
    assert f"stopped by a Prefect cancel of flow run {name!r}" in log.splitlines()[-1], log[-2000:]
    end = [e for e in read_events(job_dir) if e["event"] == "end"][-1]
    assert end["outcome"] == "preempted" and end["step"] < 300 * 22, end  # a stop checkpoint
    assert prefect_states(work, "flow_run")[name][0] == "CANCELLED"
    # Cancelling -> Cancelled, never through Failed (automations on Failed would fire; trial)
    assert state_history(work)[-2:] == ["CANCELLING", "CANCELLED"], state_history(work)
    assert mlflow_status(work, job_dir) == "KILLED"
    assert not wait_gone(work)


def test_a_prefect_cancel_after_training_finished_stops_nothing_and_ends_cancelled(tmp_path):
    """A cancel that lands once training is over (registration, the report): there is nothing
    to stop. The run ended "Finished in state Cancelling()" with exit 0, and the next command
    marked it Crashed (trial). It now ends Cancelled saying so, and ``stoker run`` exits 0 with
    its summary: the job is done and its model registered."""
    work = tmp_path / "work"
    process = start_run(work, "train.epochs=2")
    job_dir = wait_for_training(work, process)
    deadline = time.monotonic() + 120
    while not any(e["event"] == "end" for e in read_events(job_dir)):
        assert time.monotonic() < deadline and process.poll() is None, "training never ended"
        time.sleep(0.05)
    name = cancel_from_prefect(work, job_dir)
    code = process.wait(timeout=120)
    log = (work.parent / "stoker-run.log").read_text()
    assert code == 0, log[-3000:]
    assert log.splitlines()[-1] == (f"stoker run: flow run {name!r} was cancelled after "
                                    "training had finished: nothing was left to stop, the run "
                                    "did all its work"), log[-2000:]
    assert prefect_states(work, "flow_run")[name][0] == "CANCELLED"
    assert (job_dir / "pipeline_done.json").is_file()
    assert MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_model_version(
        "stoker-digits", "1") is not None


@pytest.mark.parametrize(("sig", "code", "reason"), [
    (signal.SIGINT, 130, "SIGINT (Ctrl-C)"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_stop_signal_during_the_checks_before_the_flow_says_so(tmp_path, sig, code, reason):
    """Trial: Ctrl-C 2 s or 6 s after `stoker run` started (reading the config, checking the
    job) exited 130 without a word; a SIGTERM then ended it silently. The signal comes here at
    a fixed point of those checks (inside the credential check), to the real process."""
    work = tmp_path / "work"
    script = (
        "import os, signal, sys, time\n"
        "import stoker.cli as cli\n"
        "def signalled(config):\n"
        f"    os.kill(os.getpid(), {int(sig)})\n"
        "    time.sleep(30)\n"
        "cli._check_credentials = signalled\n"
        f"cli.app(['run', 'work_dir={work}'])\n")
    env = {**embedded_env(work), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == code, done.stderr
    assert done.stderr.splitlines()[-1] == \
        f"stoker run: stopped by {reason}; run the same command again", done.stderr
    assert "Traceback" not in done.stderr and not (work / "jobs").exists(), done.stderr


@pytest.mark.parametrize("training, said", [
    (False, ": no rank trains yet, so there is no stop checkpoint to wait for"),
    (True, ": the ranks commit a stop checkpoint first (up to train.preemption_grace_s)")])
def test_the_first_stop_line_promises_a_stop_checkpoint_only_once_ranks_train(tmp_path,
                                                                              training, said):
    """Trial: a Ctrl-C while torchrun was still starting said "the ranks commit a stop
    checkpoint first" before any rank existed. Rank 0's heartbeat since the open attempt's
    start tells them apart."""
    job = tmp_path / "job"
    job.mkdir()
    AttemptLog(job).start(1, "on_demand")
    if training:
        time.sleep(0.05)  # file times are coarser than time.time()
        (job / "heartbeat.json").write_text('{"step": 1}')
    script = f"""
import os, signal, sys, time
from pathlib import Path
from stoker import stopping
from stoker.jobs.attempts import AttemptLog
stopping.install()
log = AttemptLog(Path({str(job)!r}))
with stopping.on_stop(lambda reason: None), stopping.ranks_training(log.ranks_training):
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
    except stopping.Interrupted:
        sys.exit(0)
sys.exit(1)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line == f"stoker run: stopping (SIGINT (Ctrl-C)){said}" + (
        "; a second Ctrl-C (any stop signal) stops at once without it" if training else "")
