"""Every process Stoker starts for a job names the job (``ps -eo args``), and ``stoker status``
lists their PIDs (issue 42: every rank read ``python -m stoker.runtime.launch --standby``, so
``ps`` could not tell which job a rank belongs to)."""

from __future__ import annotations

import os
import socket
import threading
import time

import psutil
import pytest
from conftest import rank_processes
from typer.testing import CliRunner

from stoker.cli import app
from stoker.jobs.lease import JobLease
from stoker.jobs.processes import job_processes
from stoker.launch.local import LocalLauncher, discard_standby, prestart


@pytest.fixture(autouse=True)
def no_standby_left():
    yield
    discard_standby()


def _args(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


@pytest.mark.integration
@pytest.mark.parametrize("warm", [True, False], ids=["standby", "cold"])
def test_the_launcher_and_every_rank_name_their_job(make_spec, warm):
    spec = make_spec("jobs/titled-job-20261205T074200Z", tracking=False, epochs=3)
    job_dir = spec.parent
    lease = JobLease(job_dir, 60.0).acquire()  # this process holds the job, as stoker run does
    standby = prestart(2) if warm else None
    if standby is not None:
        assert "--standby" in _args(psutil.Process(standby.process.pid))  # no job known yet
    launcher = LocalLauncher(2)
    codes: list[int] = []
    output: list[str] = []
    thread = threading.Thread(target=lambda: codes.append(
        launcher.run(spec, on_line=output.append, timeout_s=600)))
    thread.start()
    seen: dict[str, str] = {}
    seen_last: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not codes:
            ranks = rank_processes(psutil.Process())
            lines = {f"rank{r}": _args(p) for r, p in ranks.items()}
            parents = {p.parent() for p in ranks.values()}
            lines.update(("launcher", _args(p)) for p in parents if p is not None)
            # A forked rank shows its launcher's line until it names itself.
            named = {who: line.startswith(f"stoker-{'launch' if who == 'launcher' else who} job "
                                          f"{job_dir.name}: ") for who, line in lines.items()}
            if len(named) == 3 and all(named.values()):
                seen = lines
                found = job_processes(job_dir)
                comms = {f"rank{r}": p.name() for r, p in ranks.items()}
                comms.update(("launcher", p.name()) for p in parents if p is not None)
                status = CliRunner().invoke(app, ["status", job_dir.name, "-w",
                                                  str(job_dir.parent.parent)]).output
                break
            seen_last = lines
            time.sleep(0.05)
    finally:
        thread.join(600)
        lease.release()
    assert codes == [0], output[-20:]
    assert seen, f"the launcher and both ranks never all named the job: {seen_last}"
    assert seen["launcher"].startswith(f"stoker-launch job {job_dir.name}: ")
    for rank in (0, 1):
        assert seen[f"rank{rank}"].startswith(f"stoker-rank{rank} job {job_dir.name}: ")
    # stoker status's PIDs: the lease's holder, the ranks' parent and the ranks.
    assert found.holder == psutil.Process().pid and len(found.ranks) == 2
    assert found.launcher is not None and found.describe().startswith("holder ")
    if standby is not None:
        assert found.launcher == standby.process.pid
    # Each keeps its process name (ps -o comm, pgrep, top): a trial saw the launcher's cut
    # to its interpreter's path ('/work/trial42/s').
    assert comms["launcher"] == "python" and comms["rank0"] == "stoker-rank0"
    assert f"processes  holder {found.holder}, launcher {found.launcher}, ranks " in status


def test_no_processes_for_a_job_held_elsewhere_or_not_held(tmp_path):
    assert job_processes(tmp_path) == job_processes(tmp_path / "none")
    assert job_processes(tmp_path).describe() == "none on this host"
    (tmp_path / "lease.json").write_text('{"token": "t", "expires": 1e12, "host": "other", '
                                         '"pid": 1}')
    assert job_processes(tmp_path).holder is None  # a PID of another host is not ours
    host = socket.gethostname()
    (tmp_path / "lease.json").write_text(
        f'{{"token": "t", "expires": 1e12, "host": "{host}", "pid": 4294967295}}')
    assert job_processes(tmp_path).holder is None  # a garbled PID is untrusted input
    # A PID reused by a process that began after the lease was taken is not its holder.
    (tmp_path / "lease.json").write_text(
        f'{{"token": "t", "expires": 1e12, "host": "{host}", "pid": {os.getpid()}, '
        f'"acquired": 1000.0}}')
    assert job_processes(tmp_path).holder is None
