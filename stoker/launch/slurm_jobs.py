"""Slurm's client commands as Stoker uses them: run one, read a job's record (``scontrol``,
else ``sacct``), stop a job gracefully, find the jobs of a Stoker job key, and map a job's end to
Stoker's exit codes. Used by the launcher (:mod:`stoker.launch.slurm`) and the cost guard."""

from __future__ import annotations

import subprocess
import time

from stoker.runtime import EXIT_INFRASTRUCTURE, EXIT_PREEMPTED

JOB_PREFIX = "stoker-"
COMMENT_PREFIX = "stoker-job="
# States in which a job still holds (or waits for) nodes.
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
                 "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT",
                 "STOPPED", "PREEMPTED_PENDING"}
INFRASTRUCTURE_STATES = {"NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY", "DEADLINE"}
# SIGTERM to the job's steps only: each node's launcher, which stops its ranks after their stop
# checkpoint. Not to the batch shell (``--full``/``--batch``): it passed SIGTERM on to srun,
# which then ends the step itself ("forcing job termination", SIGKILL after KillWait), before
# the ranks had committed.
STOP_SIGNAL = ("--signal=TERM",)
NOT_STARTED_STATES = {"PENDING", "REQUEUED", "PREEMPTED_PENDING"}  # queued: no step runs yet


class SlurmError(RuntimeError):
    """A Slurm command failed (the command and its message are named)."""


def slurm(*args: str, timeout_s: float = 30.0) -> str:
    """Run a Slurm client command and return its stdout.

    Raises:
        SlurmError: the command is missing, timed out or exited non-zero (its stderr quoted).
    """
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise SlurmError(f"{args[0]}: not found (Slurm's client commands must be on PATH)"
                         ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(args[:2])}: no answer in {timeout_s:g} s") from None
    if done.returncode != 0:
        message = " ".join((done.stderr or done.stdout).split())
        raise SlurmError(f"{' '.join(args[:2])}: {message}")
    return done.stdout


def parse_fields(line: str) -> dict[str, str]:
    """``Key=Value`` pairs of one ``scontrol -o`` line (values never hold spaces we read)."""
    fields = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


def exit_code_for_job(state: str, exit_code: str, cancelled_by_us: bool) -> int:
    """The attempt's exit code (Stoker's contract) from how the Slurm job ended.

    Args:
        state: the job's ``JobState`` (``COMPLETED``, ``FAILED``, ``PREEMPTED``, ...).
        exit_code: the job's ``ExitCode``, ``"<code>:<signal>"`` of its batch script.
        cancelled_by_us: this launcher cancelled the job (the orchestrator was stopped).

    Returns:
        0 completed; 75 preempted (``PREEMPTED``, or the batch script exited 75: a stop
        checkpoint committed, e.g. before the time limit); 137 an infrastructure failure
        (``NODE_FAIL``, ``BOOT_FAIL``, out of memory, a ``TIMEOUT`` without a stop checkpoint,
        a kill, an end neither scontrol nor sacct knows: ``UNKNOWN``, retried from the last
        checkpoint); else the batch script's code (a bug or bad input), 128 + N for signal N.
    """
    code_text, _, signal_text = exit_code.partition(":")
    code = int(code_text) if code_text.isdigit() else 1
    signum = int(signal_text) if signal_text.isdigit() else 0
    if state == "COMPLETED" and code == 0:
        return 0
    if state == "PREEMPTED" or code == EXIT_PREEMPTED:
        return EXIT_PREEMPTED
    if state in INFRASTRUCTURE_STATES or state in ("TIMEOUT", "UNKNOWN") or signum == 9:
        return EXIT_INFRASTRUCTURE
    if state == "CANCELLED":
        return EXIT_PREEMPTED if cancelled_by_us else (code or EXIT_INFRASTRUCTURE)
    return code if code else (128 + signum if signum else 1)


def job_record(job_id: str) -> dict[str, str] | None:
    """The job's ``scontrol -o show job`` fields; None once Slurm forgot it (``MinJobAge``)."""
    try:
        out = slurm("scontrol", "-o", "show", "job", job_id)
    except SlurmError as e:
        if "Invalid job id" in str(e):
            return None
        raise
    return parse_fields(out.splitlines()[0]) if out.strip() else None


def accounting_record(job_id: str) -> dict[str, str]:
    """The job's ``JobState`` and ``ExitCode`` from ``sacct`` (for a job ``scontrol`` forgot);
    ``UNKNOWN``, with the ``Reason``, where the cluster keeps no accounting or no record yet.

    ``sacct -X -n -P -o State,ExitCode`` prints one ``STATE|CODE:SIGNAL`` line per job
    allocation, e.g. ``CANCELLED by 1000|0:15`` (sacct names who cancelled; scontrol does not).
    """
    try:
        out = slurm("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode")
    except SlurmError as e:
        return {"JobState": "UNKNOWN", "ExitCode": "0:0", "Reason": str(e)}
    lines = [line for line in out.splitlines() if line.strip()]
    if not lines:
        return {"JobState": "UNKNOWN", "ExitCode": "0:0", "Reason": "sacct: no record"}
    state, _, code = lines[-1].partition("|")  # the last allocation (after a requeue)
    return {"JobState": state.split()[0] if state.strip() else "UNKNOWN",
            "ExitCode": code.strip() or "0:0", "Reason": "read with sacct"}


def current_record(job_id: str) -> dict[str, str]:
    """The job's record from ``scontrol``, else (Slurm forgot it: ``MinJobAge``, a controller
    restart) from ``sacct`` (:func:`accounting_record`).

    Raises:
        SlurmError: ``scontrol`` failed for another reason than an unknown job.
    """
    return job_record(job_id) or accounting_record(job_id)


def stop_gracefully(job_id: str, grace_s: float, poll_s: float = 1.0) -> str:
    """Stop a Slurm job as a preemption would: SIGTERM to its steps (each node's launcher: the
    ranks commit a stop checkpoint and exit 75), ``scancel`` once ``grace_s`` has passed.

    Args:
        job_id: the Slurm job.
        grace_s: seconds the ranks get for their stop checkpoint.
        poll_s: seconds between two looks at the job.

    Returns:
        The job's state once it left the queue (``CANCELLED`` when the grace ran out).

    A job still queued (``PENDING``: nothing runs, nothing to checkpoint) is cancelled at once,
    and so is one that takes no signal (``scancel --signal`` refused: "Job can not be altered
    now", as a queued job answered in a new-user trial, where the job was left queued and
    later trained with nothing watching it).

    Raises:
        SlurmError: ``scancel`` refused (not the job's owner, an unknown job).
    """
    if current_record(job_id).get("JobState") in NOT_STARTED_STATES:
        slurm("scancel", job_id)
        return "CANCELLED"
    try:
        slurm("scancel", *STOP_SIGNAL, job_id)
    except SlurmError:
        slurm("scancel", job_id)  # no signal taken: cancel it (raises when that fails too)
        return "CANCELLED"
    deadline = time.monotonic() + grace_s
    while True:
        state = current_record(job_id).get("JobState", "UNKNOWN")
        if state not in ACTIVE_STATES:
            return state
        if time.monotonic() >= deadline:
            slurm("scancel", job_id)
            return "CANCELLED"
        time.sleep(poll_s)


def jobs_of(job: str) -> list[str]:
    """Ids of the queued or running Slurm jobs carrying ``job``'s key (any run's)."""
    out = slurm("squeue", "-h", f"--name={JOB_PREFIX}{job}", "-o", "%i|%k|%T")
    ids = []
    for line in out.splitlines():
        job_id, _, rest = line.partition("|")
        comment, _, state = rest.partition("|")
        if comment == f"{COMMENT_PREFIX}{job}" and state in ACTIVE_STATES:
            ids.append(job_id)
    return ids
