"""The processes of a job on this host: who holds its lease, its launcher and its ranks.

Every process Stoker starts for a job names the job in its command line (``ps -eo args``):
the launcher ``stoker-launch job <JOB>: python -m stoker.runtime.launch ...``, each rank
``stoker-rank<R> job <JOB>: python -m stoker.runtime <SPEC>`` (its process name, ``ps -o comm``,
stays ``stoker-rank<R>``), a standby launcher once it is handed an attempt. So ``pgrep -f 'job
<JOB>:'`` finds one job's processes, and ``stoker status`` prints their PIDs.
"""

from __future__ import annotations

import contextlib
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import psutil

from stoker.runtime.lease import read_lease
from stoker.runtime.records import integer, real_number

RANK_NAME = re.compile(r"^stoker-rank\d+$")  # what a rank names itself (stoker.runtime)


def launcher_below(holder: psutil.Process) -> psutil.Process | None:
    """The launcher (torchrun's process) of the attempt running below ``holder`` (the process
    that holds the job's lease): the parent of the processes named ``stoker-rank<N>``. None
    while no rank runs there (an attempt starting, a retry's back-off, ranks in a container)."""
    try:
        below = holder.children(recursive=True)
    except psutil.Error:
        return None
    for proc in below:
        with contextlib.suppress(psutil.Error):
            if RANK_NAME.match(proc.name()):
                return proc.parent()
    return None


@dataclass(frozen=True)
class JobProcesses:
    """PIDs of one job's processes on this host: ``holder`` (the ``stoker run`` or flow
    process that holds the lease), ``launcher`` (torchrun's), ``ranks`` (sorted); None / ()
    where there is none (ranks in containers or on other nodes are not listed)."""

    holder: int | None = None
    launcher: int | None = None
    ranks: tuple[int, ...] = ()

    def describe(self) -> str:
        """``holder 4242, launcher 4250, ranks 4261 4262`` (what is there)."""
        parts = [f"holder {self.holder}"] if self.holder else []
        if self.launcher:
            parts.append(f"launcher {self.launcher}")
        if self.ranks:
            parts.append("ranks " + " ".join(map(str, self.ranks)))
        return ", ".join(parts) or "none on this host"


def job_processes(job_dir: Path) -> JobProcesses:
    """The processes of the job in ``job_dir`` on this host, from its lease (the holder's PID,
    checked against this host's name: a PID from a record is untrusted) and the process tree
    below the holder. Never raises."""
    lease = read_lease(job_dir) or {}
    pid = integer(lease.get("pid"))
    if lease.get("host") != socket.gethostname() or pid is None or not 0 < pid < 2**31:
        return JobProcesses()
    acquired = real_number(lease.get("acquired"))
    try:
        holder = psutil.Process(pid)
        if acquired is not None and holder.create_time() > acquired + 1.0:
            return JobProcesses()  # the PID was reused: its process began after the lease
        below = holder.children(recursive=True)
    except psutil.Error:
        return JobProcesses()
    ranks = []
    for proc in below:
        with contextlib.suppress(psutil.Error):
            if RANK_NAME.match(proc.name()):
                ranks.append(proc)
    launcher = None
    with contextlib.suppress(psutil.Error):
        launcher = ranks[0].parent().pid if ranks else None
    return JobProcesses(pid, launcher, tuple(sorted(p.pid for p in ranks)))
