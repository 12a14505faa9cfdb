"""Run an attempt as one Slurm batch job: ``srun`` starts Stoker's launcher once per node.

The batch script (:func:`batch_script`) finds the first node's address, and ``srun
--ntasks-per-node=1`` runs ``python -m stoker.runtime.launch`` (torchrun with Stoker's exit-code
contract) on every node with a static rendezvous on that first node. The job is submitted with
``sbatch --parsable`` and followed with ``scontrol -o show job`` (no accounting database is
needed; ``MinJobAge`` keeps a finished job visible); its end maps to Stoker's exit codes
(:func:`exit_code_for_job`).

Stops and preemption: ``--signal=B:TERM@<grace>`` asks the batch shell to stop ``grace`` seconds
before the time limit; it passes SIGTERM to the job's steps (``scancel --signal=TERM``: each
node's launcher, not ``srun``, which would kill them after ``KillWait``); the ranks commit a
stop checkpoint and exit 75. A job preempted by a higher-priority partition
(``PreemptMode=REQUEUE`` with ``GraceTime``) gets SIGTERM the same way. Jobs are submitted
``--no-requeue``: Slurm ends a preempted job (``PREEMPTED``), and Stoker's retry policy submits
the next attempt, which resumes from the stop checkpoint. A job cancelled by someone else
(``scancel``) is a stop: the launcher records a stop request, so the attempt is not retried.
A stop request in the job folder (``stoker stop``, the cost guard) is acted on at the next poll
the same way as a stop of the orchestrator (:func:`stop_gracefully`): SIGTERM to the job's
steps (``scancel --signal=TERM``), ``scancel`` once the grace has passed; the attempt ends
stopped.

Ownership: the job's name is ``stoker-<job key>`` and its comment ``stoker-job=<job key>``.
Before submitting, the launcher looks for jobs of the same key still queued or running (an
orchestrator that was killed left them): it asks them to stop (SIGTERM: they commit and exit 75)
and waits up to ``orphan_wait_s`` for them to leave the queue, then cancels them outright. Such
a job also stops by itself once the job lease is taken over or expires (the runtime's lease
watchdog), so a job nobody follows does not train on.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stoker.config import SlurmLauncherConfig
from stoker.jobs.stop_request import read_stop_request, request_stop
from stoker.launch.slurm_jobs import (  # noqa: F401 - re-exported: the launcher's names
    ACTIVE_STATES,
    COMMENT_PREFIX,
    INFRASTRUCTURE_STATES,
    JOB_PREFIX,
    STOP_SIGNAL,
    SlurmError,
    accounting_record,
    current_record,
    exit_code_for_job,
    job_record,
    jobs_of,
    parse_fields,
    slurm,
    stop_gracefully,
)
from stoker.launch.slurm_queue import record_submitted
from stoker.runtime.spec import RunSpec
from stoker.stopping import interrupted

# How long the controller may not answer before the attempt gives up on following its job (s).
CONTROLLER_PATIENCE_S = 120.0


def batch_script(python: str, spec_path: Path, nnodes: int, rdzv_port: int,
                 shutdown_grace_s: float) -> str:
    """The batch script of one attempt: ``srun`` runs Stoker's launcher once per node, with a
    static rendezvous on the first node of the allocation. SIGTERM to the script (the time
    limit's ``--signal=B:TERM``) is passed on to the step's tasks, every node's launcher
    (``scancel --signal=TERM``), not to ``srun``: srun takes it as "end the step" and kills the
    tasks after ``KillWait``, before the ranks have committed their stop checkpoint."""
    launch = [python, "-u", "-m", "stoker.runtime.launch", f"--nnodes={nnodes}",
              "--nproc-per-node=$STOKER_NPROC", "--rdzv-backend=static",
              '--master-addr="$addr"', f"--master-port={rdzv_port}",
              '--node-rank="$SLURM_NODEID"', "--max-restarts=0",
              f"--shutdown-timeout={int(shutdown_grace_s)}",
              "-m", "stoker.runtime", shlex.quote(str(spec_path))]
    node_command = " ".join(shlex.quote(a) if "$" not in a else a for a in launch)
    return f"""#!/bin/bash
# Stoker attempt: one launcher per node (srun), rendezvous on the first node.
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export addr=$(scontrol -o show node "$head" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')
srun --kill-on-bad-exit=1 --ntasks-per-node=1 --export=ALL \\
  bash -c {shlex.quote("exec " + node_command)} &
step=$!
trap 'scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || kill -TERM $step' TERM INT
while :; do  # a trapped signal ends `wait` early: wait again until srun is gone
  wait $step; code=$?
  kill -0 $step 2>/dev/null || break
done
wait $step 2>/dev/null; last=$?
[ $last -ne 127 ] && code=$last
exit $code
"""


def resource_args(config: SlurmLauncherConfig) -> list[str]:
    """The ``sbatch`` options that ask for resources: nodes, GPUs, time, partition, account,
    QoS."""
    args = [f"--nodes={config.nodes}", "--ntasks-per-node=1"]
    if config.gpus_per_node:
        args.append(f"--gpus-per-node={config.gpus_per_node}")
    for option, value in (("--time", config.time_limit_min), ("--partition", config.partition),
                          ("--account", config.account), ("--qos", config.qos)):
        if value is not None:
            args.append(f"{option}={value}")
    return args


def sbatch_args(config: SlurmLauncherConfig, job: str, job_dir: Path,
                shutdown_grace_s: float, env: dict[str, str]) -> list[str]:
    """``sbatch`` options of one attempt (the script comes on stdin); ``env`` is added to
    this process's environment for the job (values without commas)."""
    return ["sbatch", "--parsable", f"--job-name={JOB_PREFIX}{job}",
            f"--comment={COMMENT_PREFIX}{job}", *resource_args(config), "--no-requeue",
            f"--chdir={job_dir}", f"--output={job_dir}/slurm-%j.out",
            f"--signal=B:TERM@{int(shutdown_grace_s) + 5}",
            "--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in env.items())])]


@dataclass
class SlurmLauncher:
    """Launch one attempt as a Slurm batch job over ``config.nodes`` nodes.

    Attributes:
        config: the ``launcher.slurm`` fields.
        nproc_per_node: ranks per node (torchrun ``--nproc-per-node``).
        shutdown_grace_s: seconds the ranks get to commit a stop checkpoint after SIGTERM.
        python: interpreter on the nodes (a shared filesystem is assumed); default: this one.
        poll_s: seconds between two looks at the job.
        orphan_wait_s: how long an earlier run's job of the same key gets to stop (SIGTERM,
            stop checkpoint) before it is cancelled outright.
    """

    config: SlurmLauncherConfig
    nproc_per_node: int = 1
    shutdown_grace_s: float = 25.0
    python: str = field(default_factory=lambda: sys.executable)
    poll_s: float = 1.0
    orphan_wait_s: float = 60.0
    job_id: str | None = field(default=None, init=False)
    _offset: int = field(default=0, init=False, repr=False)  # bytes of the output streamed

    def stop_orphans(self, job: str, on_line: Callable[[str], None]) -> None:
        """Stop the jobs of ``job`` an earlier (dead) run left queued or running: SIGTERM
        first (they commit a stop checkpoint and exit 75), ``scancel`` after
        ``orphan_wait_s``."""
        orphans = jobs_of(job)
        if not orphans:
            return
        on_line(f"Slurm job(s) {' '.join(orphans)} of job {job} left by an earlier run: "
                "stopping them (stop checkpoint) before this attempt")
        with contextlib.suppress(SlurmError):
            slurm("scancel", *STOP_SIGNAL, *orphans)
        deadline = time.monotonic() + self.orphan_wait_s
        while jobs_of(job) and time.monotonic() < deadline:
            time.sleep(self.poll_s)
        if left := jobs_of(job):
            slurm("scancel", *left)
            while jobs_of(job):
                time.sleep(self.poll_s)

    def submit(self, spec_path: Path) -> str:
        """Submit the attempt's batch job and return its id.

        Raises:
            SlurmError: ``sbatch`` refused the job (its message quoted).
        """
        spec = RunSpec.load(spec_path)
        job_dir = Path(spec_path).parent.resolve()
        script = batch_script(self.python, Path(spec_path).resolve(), self.config.nodes,
                              self.config.rdzv_port, self.shutdown_grace_s)
        # No STOKER_STOP_COMMITTED_FILE: each node's launcher keeps its own marker (a shared
        # one in the job folder was removed by the first node to end, before the others read it).
        env = {"STOKER_NPROC": str(self.nproc_per_node), "PYTHONUNBUFFERED": "1"}
        args = sbatch_args(self.config, Path(spec.job_dir).name, job_dir,
                           self.shutdown_grace_s, env)
        try:
            done = subprocess.run(args, input=script, capture_output=True, text=True,
                                  timeout=60)
        except FileNotFoundError:
            raise SlurmError("sbatch: not found (Slurm's client commands must be on PATH)"
                             ) from None
        if done.returncode != 0:
            raise SlurmError(f"sbatch: {' '.join(done.stderr.split())}")
        return done.stdout.strip().split(";")[0]

    def run(self, spec_path: Path, on_line: Callable[[str], None] = print,
            timeout_s: float | None = None) -> int:
        """Run one attempt to its end and return its exit code (Stoker's contract).

        The job's output streams to ``on_line``. If the wait is interrupted (timeout, a stop
        signal, an exception) the job is cancelled (SIGTERM first: a stop checkpoint) before
        the exception propagates. A job cancelled by someone else is recorded as a user's
        stop request in the job folder.

        Raises:
            SlurmError: a Slurm command failed.
            TimeoutError: the attempt ran longer than ``timeout_s``.
        """
        job_dir = Path(spec_path).parent
        job = Path(RunSpec.load(spec_path).job_dir).name
        self.stop_orphans(job, on_line)
        self.job_id = self.submit(spec_path)
        record_submitted(job_dir, self.job_id)  # `stoker status` asks the queue about it
        on_line(f"submitted Slurm job {self.job_id} ({self.config.nodes} node(s))")
        output = job_dir / f"slurm-{self.job_id}.out"
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._offset = 0
        try:
            record = self._wait_for_end(job_dir, output, on_line, deadline, timeout_s)
        except BaseException as e:
            interrupted(e)  # who stops the ranks is recorded before the job is cancelled
            self.cancel()
            raise
        finally:
            _follow(output, self._offset, on_line)
        state, code = record.get("JobState", "UNKNOWN"), record.get("ExitCode", "1:0")
        on_line(f"Slurm job {self.job_id} ended {state} (exit {code}, reason "
                f"{record.get('Reason', 'None')})")
        if state == "CANCELLED" and read_stop_request(job_dir) is None:  # not by us: we raised
            request_stop(job_dir, "user", f"Slurm job {self.job_id} cancelled (scancel)")
        return exit_code_for_job(state, code, cancelled_by_us=False)

    def _wait_for_end(self, job_dir: Path, output: Path, on_line: Callable[[str], None],
                      deadline: float | None, timeout_s: float | None) -> dict[str, str]:
        """Follow the job (and stream its output) until it leaves the queue; its last record.
        A stop request in ``job_dir`` (``stoker stop``, the cost guard) stops the job
        (:meth:`_act_on_stop_request`).

        Raises:
            SlurmError: the controller did not answer for ``CONTROLLER_PATIENCE_S``.
            TimeoutError: ``deadline`` (monotonic seconds) passed.
        """
        failures, stop_sent = 0, None
        while True:
            stop_sent = self._act_on_stop_request(job_dir, stop_sent, on_line)
            try:
                record = current_record(self.job_id)
                failures = 0
            except SlurmError:  # a controller busy or restarting: look again
                failures += 1
                if failures * self.poll_s > CONTROLLER_PATIENCE_S:
                    raise
                record = {"JobState": "RUNNING"}
            self._offset = _follow(output, self._offset, on_line)
            if record.get("JobState") not in ACTIVE_STATES:
                return record
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"attempt ran over {timeout_s} s")
            time.sleep(self.poll_s)

    def _act_on_stop_request(self, job_dir: Path, stop_sent: float | None,
                             on_line: Callable[[str], None]) -> float | None:
        """SIGTERM the job once a stop request shows up in ``job_dir``; ``scancel`` it once the
        grace has passed.

        Returns:
            When SIGTERM was sent (monotonic seconds; -1 once ``scancel`` followed), or None.
        """
        if stop_sent is None:
            request = read_stop_request(job_dir)
            if request is None:
                return None
            on_line(f"{request.describe()}: Slurm job {self.job_id} gets SIGTERM (stop "
                    f"checkpoint), scancel after {self.shutdown_grace_s + 5:g} s")
            with contextlib.suppress(SlurmError):  # it may have ended meanwhile
                slurm("scancel", *STOP_SIGNAL, self.job_id)
            return time.monotonic()
        if stop_sent >= 0 and time.monotonic() - stop_sent > self.shutdown_grace_s + 5:
            with contextlib.suppress(SlurmError):
                slurm("scancel", self.job_id)
            return -1.0
        return stop_sent

    def cancel(self) -> None:
        """Stop the attempt's job: SIGTERM (stop checkpoint), ``scancel`` after the grace."""
        if self.job_id is None:
            return
        with contextlib.suppress(SlurmError):
            stop_gracefully(self.job_id, self.shutdown_grace_s + 5, self.poll_s)


def _follow(path: Path, offset: int, on_line: Callable[[str], None]) -> int:
    """Pass the whole lines of ``path`` after byte ``offset`` to ``on_line``; the new offset."""
    with contextlib.suppress(FileNotFoundError), path.open("rb") as stream:
        stream.seek(offset)
        data = stream.read()
        end = data.rfind(b"\n") + 1
        for line in data[:end].decode(errors="replace").splitlines():
            on_line(line)
        return offset + end
    return offset
