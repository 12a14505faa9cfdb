"""The attempt history of a job, across every flow run that trained it.

``<job_dir>/attempts.jsonl`` holds two records per attempt: ``{"state": "started", ...}``
appended before the launch and ``{"state": "ended", ...}`` after it. A flow run that dies
between the two (Ctrl-C, SIGKILL, a lost node) leaves an open attempt; the next run closes it as
``interrupted`` (or with the outcome the runtime wrote, e.g. preempted when it checkpointed on
the way out), billed from its start to the last heartbeat. Numbers continue over the job, so
attempts, preemptions, billed time and cost add up over all of them.

An ended record also has ``steps_lost`` (:func:`lost_steps`): the steps the attempt trained
past its job's last committed checkpoint, which the next attempt must run again (0 when the
attempt completed or its stop checkpoint committed). An interrupted one also says what its ranks
recorded in ``progress.jsonl`` (``runtime_end_step``, ``checkpoint_step``, ``reached_step``) and,
with ``left_open``, that no one recorded its end (its run's process died; a later run closed
it): :func:`describe_interrupted` puts that in words for ``stoker status`` and ``train.log``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import fsspec

from stoker.jobs.store import write_through
from stoker.runtime.records import append_jsonl, integer, read_json, read_jsonl, real_number

ATTEMPTS_FILE = "attempts.jsonl"
# What the runtime's last `end` event says, as an attempt outcome (stoker.launch.retry.Outcome).
END_OUTCOME = {"completed": "completed", "preempted": "preempted", "failed": "user_error",
                "infrastructure": "infrastructure_failure", "storage": "storage_error"}
# The checkpointer's layout (stoker.runtime.checkpoint, which imports torch): a step counts once
# its folder holds the commit marker.
_STEP_DIR = re.compile(r"^step-(\d{9})$")
_MARKER = "COMMITTED"


def committed_step(location: str, unlisted: int | None = 0) -> int | None:
    """The highest committed checkpoint step under ``location`` (folder or fsspec URL); 0 when
    there is none, ``unlisted`` when the store cannot be listed (default 0: every step since the
    start is then lost). A step counts once its ``COMMITTED`` marker is there: the ranks'
    ``checkpoint`` progress event comes when their files are serialized, before the commit."""
    try:
        fs, root = fsspec.core.url_to_fs(location)
        fs.invalidate_cache(root)
        markers = fs.glob(f"{root.rstrip('/')}/step-*/{_MARKER}")
    except (OSError, ValueError):
        return unlisted
    steps = [int(m.group(1)) for path in markers
             if (m := _STEP_DIR.match(str(path).rstrip("/").rsplit("/", 2)[-2]))]
    return max(steps, default=0)


def reached_step(job_dir: Path, since: float,
                 events: list[dict[str, Any]] | None = None) -> int | None:
    """The highest step rank 0 reported (progress events and heartbeat) at or after ``since``
    (Unix seconds); None when it reported none. ``events``: the job's progress events when the
    caller has read them already (else read from ``progress.jsonl``)."""
    job_dir = Path(job_dir)
    if events is None:
        events = read_jsonl(job_dir / "progress.jsonl")
    steps = [e["step"] for e in events if integer(e.get("step")) is not None
             and (at := real_number(e.get("time"))) is not None and at >= since]
    beat = read_json(job_dir / "heartbeat.json", default={}, warn=lambda *_: None)
    if isinstance(beat, dict) and integer(beat.get("step")) is not None \
            and (at := real_number(beat.get("time"))) is not None and at >= since:
        steps.append(beat["step"])
    return max(steps, default=None)


def lost_steps(job_dir: Path, since: float, checkpoint_location: str) -> tuple[int, int, int]:
    """``(steps_lost, reached, committed)`` of an attempt that started at ``since``: the last
    step it reached minus the job's last committed checkpoint step (never negative)."""
    committed = committed_step(checkpoint_location)
    reached = reached_step(job_dir, since)
    if reached is None:
        return 0, committed, committed
    return max(0, reached - committed), reached, committed


def is_closed(record: dict[str, Any]) -> bool:
    """Whether an attempt record (:meth:`AttemptLog.records`) is closed (``state`` ``ended``,
    or no state: older files)."""
    return record.get("state", "ended") == "ended"


def closed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The closed attempts among ``records`` (:meth:`AttemptLog.records`), in their order."""
    return [r for r in records if is_closed(r)]


class AttemptLog:
    """Reads and appends the attempt records of one job folder."""

    def __init__(self, job_dir: Path):
        self.job_dir = Path(job_dir)
        self.path = self.job_dir / ATTEMPTS_FILE

    def _latest(self) -> dict[int, dict[str, Any]]:
        """The newest record per attempt number (records without a number are skipped)."""
        latest: dict[int, dict[str, Any]] = {}
        for record in read_jsonl(self.path):
            number = record.get("number")
            if isinstance(number, int):
                latest[number] = {**latest.get(number, {}), **record}
        return latest

    def records(self) -> list[dict[str, Any]]:
        """Every attempt of the job, oldest first: the newest record of each, closed
        (``state`` ``ended``, or no state: older files) or open (``started``). One read of
        the file for what :meth:`history`, :meth:`open_attempts` and :meth:`count` give."""
        return [r for _, r in sorted(self._latest().items())]

    def next_number(self) -> int:
        return max(self._latest(), default=0) + 1

    def history(self) -> list[dict[str, Any]]:
        """Every closed attempt of the job, oldest first (dicts with ``number``, ``outcome``,
        ``exit_code``, ``started``, ``duration_s`` in seconds, ``capacity_type``)."""
        return closed(self.records())

    def open_attempts(self) -> list[dict[str, Any]]:
        """Attempts started and not (yet) closed, oldest first: the one training now, or one a
        dead run left open (closed as ``interrupted`` when the job resumes)."""
        return [r for r in self.records() if r.get("state") == "started"]

    def count(self) -> int:
        """Attempts of the job so far, open ones included (an attempt a dead run left open
        counts: it was billed)."""
        return len(self._latest())

    def start(self, number: int, capacity_type: str, flow_run_id: str | None = None,
              launcher: str | None = None) -> None:
        """Record attempt ``number`` as started (before it is launched); ``launcher`` is the
        launcher's kind (``local``, ``docker``, ``kubernetes``: where ``stoker stop`` finds
        the ranks)."""
        append_jsonl(self.path, {"number": number, "state": "started", "started": time.time(),
                                 "capacity_type": capacity_type, "flow_run_id": flow_run_id,
                                 **({"launcher": launcher} if launcher else {})})
        write_through(self.job_dir, ATTEMPTS_FILE)  # a lost node's attempt still counts

    def end(self, number: int, record: dict[str, Any]) -> None:
        """Close attempt ``number`` with its outcome record (``Attempt.to_dict()`` fields)."""
        append_jsonl(self.path, {**record, **self._failed_saves(number), "number": number,
                                 "state": "ended"})
        write_through(self.job_dir, ATTEMPTS_FILE)

    def close_interrupted(self, stopped_by: str | None = None, left_open: bool = False,
                          checkpoint_location: str | None = None) -> list[dict[str, Any]]:
        """Close the attempts a dead flow run left open; returns the records written.

        ``stopped_by``: who stopped the run that closes them itself (``"SIGINT (Ctrl-C)"``, a
        Prefect cancel), recorded as the records' ``stopped_by``; None when a later run closes
        what a dead one left, unless that run recorded its stop signal before it died (a second
        Ctrl-C: ``stop-sender.json``). ``left_open``: a later run closes them (their run's
        process died before recording an end), recorded as ``left_open``.
        ``checkpoint_location``: the job's checkpoints (folder or fsspec URL), for
        ``steps_lost``; without it the last ``checkpoint`` event of ``progress.jsonl`` stands
        for the last committed step."""
        closed = []
        for number, record in sorted(self._latest().items()):
            if record.get("state") != "started":
                continue
            started = float(record.get("started") or 0.0)
            ranks, last_seen = self._runtime_end(started, checkpoint_location)
            # The orchestrator died or was stopped (Ctrl-C, kill -9, a lost worker): whatever
            # the ranks did then (often a committed stop checkpoint), it is not a preemption.
            # The run that stopped it held the machine until now (a hung attempt writes no
            # heartbeat: its last one would under-bill it); a dead run's end is its last trace.
            ended = last_seen if left_open else max(last_seen, time.time())
            by = stopped_by
            if left_open and by is None:  # did its run die while stopping (a second Ctrl-C)?
                from stoker.runtime.preemption import stop_signal_reason

                by = stop_signal_reason(self.job_dir, started)
            entry = {"exit_code": -1, "outcome": "interrupted", "started": started, **ranks,
                     "duration_s": round(max(0.0, ended - started), 3),
                     "capacity_type": record.get("capacity_type", "on_demand"),
                     "interrupted": True, **({"stopped_by": by} if by else {}),
                     **({"left_open": True} if left_open else {})}
            self.end(number, entry)
            closed.append({**entry, "number": number})
        return closed

    def open_since(self) -> float | None:
        """When the open attempt (the newest one started and not ended) started, Unix
        seconds; None when none is open."""
        open_ = [r for _, r in sorted(self._latest().items()) if r.get("state") == "started"]
        return real_number(open_[-1].get("started")) if open_ else None

    def ranks_training(self) -> bool:
        """Whether the open attempt's ranks train: rank 0 has written ``heartbeat.json`` since
        the attempt started (it does from its first step on)."""
        since = self.open_since()
        try:
            return since is not None and (self.job_dir / "heartbeat.json").stat().st_mtime >= since
        except OSError:
            return False

    def open_attempt_end(self, checkpoint_location: str | None = None) -> str | None:
        """What the ranks of the open attempt recorded as their end in ``progress.jsonl``, in
        words (``its ranks committed a stop checkpoint at step 757``); None when no attempt is
        open or its ranks recorded no end. For ``stoker run``'s last line after a second
        signal that came once the ranks had ended (:func:`stoker.stopping.outcome_probe`)."""
        started = self.open_since()
        if started is None:
            return None
        ranks = self._runtime_end(started, checkpoint_location)[0]
        return None if ranks.get("runtime_outcome") == "interrupted" else _ranks_did(ranks)

    def steps_lost_if_closed(self, record: dict[str, Any]) -> int:
        """The ``steps_lost`` an open attempt ``record`` (:meth:`records`) will get when the next
        run closes it (:meth:`close_interrupted`): the step its ranks reached minus the last
        checkpoint of ``progress.jsonl``; 0 for a closed record. For a job whose run died or
        was stopped at once (a second Ctrl-C), so that ``stoker status`` counts them before
        the next run does."""
        started = real_number(record.get("started"))
        if is_closed(record) or started is None:
            return 0
        return integer(self._runtime_end(started)[0].get("steps_lost", 0)) or 0

    def _failed_saves(self, number: int) -> dict[str, Any]:
        """``{"failed_saves": [steps]}`` for the saves attempt ``number`` gave up after their
        upload tries (the runtime's ``checkpoint_failed`` events since it started; {} if none)."""
        started = real_number(self._latest().get(number, {}).get("started"))
        if started is None:
            return {}
        steps = [e.get("step") for e in read_jsonl(self.job_dir / "progress.jsonl")
                 if e.get("event") == "checkpoint_failed"
                 and (at := real_number(e.get("time"))) is not None and at >= started]
        return {"failed_saves": steps} if steps else {}

    def _runtime_end(self, started: float, checkpoint_location: str | None = None
                     ) -> tuple[dict[str, Any], float]:
        """What the ranks of an attempt started at ``started`` recorded (``runtime_outcome``,
        ``runtime_end_step``, ``checkpoint_step``, ``reached_step``, ``steps_lost``) and the
        last time the runtime was seen (Unix seconds)."""
        every = read_jsonl(self.job_dir / "progress.jsonl")  # a torn last line is skipped
        events = [e for e in every
                  if (at := real_number(e.get("time"))) is not None and at >= started]
        ends = [e for e in events if e.get("event") == "end"]
        ranks: dict[str, Any] = {"runtime_outcome": END_OUTCOME.get(
            ends[-1].get("outcome"), "interrupted") if ends else "interrupted"}
        if ends and isinstance(ends[-1].get("step"), int):
            ranks["runtime_end_step"] = ends[-1]["step"]
        saved = [e["step"] for e in events
                 if e.get("event") == "checkpoint" and isinstance(e.get("step"), int)]
        if saved:
            ranks["checkpoint_step"] = saved[-1]
        reached = reached_step(self.job_dir, started, every)
        if reached is not None:
            committed = committed_step(checkpoint_location) if checkpoint_location is not None \
                else max((e["step"] for e in every if e.get("event") == "checkpoint"
                          and isinstance(e.get("step"), int)), default=0)
            ranks.update(reached_step=reached, committed_step=committed,
                         steps_lost=max(0, reached - committed))
        beat = read_json(self.job_dir / "heartbeat.json", default={})
        times = [e["time"] for e in events]
        if isinstance(beat, dict) and (at := real_number(beat.get("time"))) is not None:
            times.append(at)
        return ranks, max([t for t in times if t >= started], default=started)


def describe_interrupted(record: dict[str, Any]) -> str | None:
    """Why an interrupted attempt (a :meth:`AttemptLog.close_interrupted` record) was closed and
    what its ranks did, in words, e.g. ``its run's process died (no one recorded the attempt's
    end; the next run closed it); its ranks committed a stop checkpoint at step 6372``; None for
    any other record, or an older one without what its ranks did."""
    if not record.get("interrupted") or "runtime_outcome" not in record:
        return None
    parts = []
    if record.get("left_open") and record.get("stopped_by"):  # a second Ctrl-C: not a death
        parts.append("its run was stopped at once, without waiting to record the attempt's end "
                     "(the next run closed it)")
    elif record.get("left_open"):
        parts.append("its run's process died (no one recorded the attempt's end; the next run "
                     "closed it)")
    parts.append(_ranks_did(record))
    return "; ".join(parts)


def _ranks_did(record: dict[str, Any]) -> str:
    """What the ranks of an interrupted attempt recorded in ``progress.jsonl``, in words."""
    outcome, end = record.get("runtime_outcome"), record.get("runtime_end_step")
    if outcome == "preempted" and end is not None and record.get("checkpoint_step") == end:
        return f"its ranks committed a stop checkpoint at step {end}"
    if outcome == "preempted":
        return f"its ranks stopped at step {end}"
    if outcome == "completed":
        return f"its ranks completed training at step {end}"
    if outcome == "user_error":
        return f"its ranks failed at step {end}"
    if outcome == "storage_error":
        return f"its ranks could not write a checkpoint (the storage refused it) at step {end}"
    if outcome == "infrastructure_failure":  # a data worker or a peer rank lost: no stop
        committed = record.get("committed_step") or 0
        last = f"last checkpoint at step {committed}" if committed else "no checkpoint committed"
        return (f"its ranks ended at step {end} without a stop checkpoint (a data worker or a "
                f"peer rank was lost), {last}, {record.get('steps_lost', 0)} step(s) lost")
    reached = record.get("reached_step")
    if reached is None:
        return "its ranks recorded no step and no end"
    committed = record.get("committed_step") or 0
    if isinstance(committed, int) and isinstance(reached, int) and committed > reached:
        # The progress a bucket carries lags the checkpoints (its copy is synced every few
        # seconds): a trial read "reached step 200, last checkpoint at step 222".
        return (f"its ranks recorded no end: their last progress record says step {reached}, "
                f"and a checkpoint of step {committed} committed after it (the last one), "
                "no step lost")
    last = f"last checkpoint at step {committed}" if committed else "no checkpoint committed"
    return (f"its ranks recorded no end: reached step {reached}, {last}, "
            f"{record.get('steps_lost', 0)} step(s) lost")


def left_open_note(record: dict[str, Any]) -> str:
    """The line ``train.log`` gets when a run closes an attempt its own run left open: that run
    died (``kill -9``, a lost node) or was stopped at once (a second Ctrl-C: the record's
    ``stopped_by``), so its output after that was not captured (no one read it); and what the
    ranks recorded in ``progress.jsonl``. It does not name the ranks' own outcome word
    (``preempted`` for a stop checkpoint): beside a cost line of 0 preemptions it read as a
    contradiction (new-user trial); the attempt is interrupted, not a preemption."""
    billed = float(record.get("duration_s") or 0)
    by = record.get("stopped_by")
    cause = f"was stopped at once (a second signal after {by})" if by else "died"
    return (f"attempt {record.get('number')} closed as interrupted by this run: the run that "
            f"started it {cause}, so no one recorded its end and its output after that is not "
            f"in this log; in progress.jsonl, {_ranks_did(record)} (billed {billed:.1f} s)")
