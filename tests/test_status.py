"""Job progress as users see it: no ETA from start-up noise, a moving-average ETA, restarts."""

from __future__ import annotations

import time

import pytest

from stoker.jobs.status import MIN_STEPS_FOR_ETA, job_progress


def steps(first: int, last: int, t0: float, step_s: float) -> list[dict]:
    return [{"event": "step", "step": s, "time": t0 + (s - first + 1) * step_s,
             "samples_per_s": 64 / step_s} for s in range(first, last + 1)]


def test_no_eta_at_the_first_steps_of_an_attempt():
    events = [{"event": "start", "step": 0, "time": 0.0, "total_steps": 100},
              *steps(1, MIN_STEPS_FOR_ETA - 1, 0.0, 0.5)]
    progress = job_progress(events)
    assert progress.state == "starting" and progress.eta_s is None
    assert progress.describe() == "step 4/100 (attempt 1, from step 0)"
    assert job_progress(events[:1]).describe() == "attempt 1 starting at step 0/100"


def test_eta_follows_recent_step_time_not_the_start_up():
    # A slow first step (compilation, warm-up) then 0.1 s steps: the ETA uses the recent ones.
    events = [{"event": "start", "step": 0, "time": 0.0, "total_steps": 1000},
              {"event": "step", "step": 1, "time": 30.0, "samples_per_s": 2.0},
              *steps(2, 100, 30.0, 0.1)]
    progress = job_progress(events)
    assert progress.state == "training"
    assert progress.eta_s == pytest.approx(900 * 0.1)
    assert progress.describe() == "step 100/1000 (attempt 1), 640 samples/s, ETA 90 s"


def test_the_warm_up_steps_of_an_attempt_are_left_out_of_the_eta():
    """Trial: `step 15/3000 (attempt 1), 174 samples/s, ETA 4 min 59 s` when 75 s were left:
    the first steps of an attempt (data workers starting, the first all-reduce) are slow."""
    events = [{"event": "start", "step": 0, "time": 0.0, "total_steps": 1000},
              *steps(1, MIN_STEPS_FOR_ETA - 1, 0.0, 1.0),
              *steps(MIN_STEPS_FOR_ETA, 15, MIN_STEPS_FOR_ETA - 1.0, 0.1)]
    progress = job_progress(events)
    assert progress.state == "training"
    assert progress.eta_s == pytest.approx((1000 - 15) * 0.1)
    assert progress.samples_per_s == pytest.approx(640)
    # up to MIN_STEPS_FOR_ETA step events: still starting, no figure from the warm-up alone
    assert job_progress(events[:1 + MIN_STEPS_FOR_ETA]).state == "starting"


def test_throughput_is_the_windows_not_the_last_steps():
    """One step's samples/s swung by 2x between status lines (2285, 4221, 3512 samples/s at
    15 ms steps): the line shows the window's, all its samples over all its step time."""
    events = [{"event": "start", "step": 0, "time": 0.0, "total_steps": 1000},
              *steps(1, 40, 0.0, 0.1)]
    for e in events[-20:]:  # the window: every other step took 0.3 s instead of 0.1
        if e["step"] % 2:
            e["samples_per_s"] = 64 / 0.3
    events[-1]["samples_per_s"] = 64 / 0.05  # and the last one was fast
    progress = job_progress(events)
    expected = 20 * 64 / (9 * 0.1 + 10 * 0.3 + 0.05)
    assert progress.samples_per_s == pytest.approx(expected)
    assert f"{expected:.0f} samples/s" in progress.describe()
    # an untrusted record: values that are not positive numbers are left out
    bad = [None, "fast", True, -1.0, float("nan"), float("inf"), 0]
    for e, value in zip(events[-len(bad):], bad, strict=True):
        e["samples_per_s"] = value
    assert job_progress(events).samples_per_s > 0
    for e in events[-20:]:
        e.pop("samples_per_s")
    assert job_progress(events).samples_per_s is None
    assert "samples/s" not in job_progress(events).describe()


def test_a_preempted_attempt_reads_restarting_from_its_last_checkpoint():
    events = [{"event": "start", "step": 0, "time": 0.0, "total_steps": 66},
              *steps(1, 16, 0.0, 0.2),
              {"event": "checkpoint", "step": 16, "time": 3.5},
              {"event": "end", "step": 16, "time": 3.6, "outcome": "preempted"}]
    progress = job_progress(events)
    assert progress.describe() == "restarting (attempt 2, resuming at step 16/66)"
    events += [{"event": "start", "step": 16, "time": 10.0, "total_steps": 66,
                "resumed": True}]
    assert job_progress(events).describe() == "attempt 2 starting at step 16/66"
    # QA: "attempt 2 starting at step 19" after "resumed from step 16" read as a second restart
    events += steps(17, 19, 10.0, 0.2)
    assert job_progress(events).describe() == "step 19/66 (attempt 2, from step 16)"


def test_completed_is_100_percent_and_nothing_before_start():
    assert job_progress([]) is None
    done = job_progress([{"event": "start", "step": 0, "time": 0.0, "total_steps": 10},
                         *steps(1, 10, 0.0, 0.1),
                         {"event": "end", "step": 10, "time": 1.1, "outcome": "completed"}])
    assert done.percent == 100.0 and done.state == "completed"


def test_long_etas_read_in_minutes_and_hours():
    events = [{"event": "start", "step": 0, "time": 0.0, "total_steps": 100_000},
              *steps(1, 10, 0.0, 1.0)]
    assert job_progress(events).describe().endswith("ETA 27 h 46 min")


def test_a_completed_rank_0_whose_attempt_is_retried_reads_restarting(tmp_path):
    """kill -9 of rank 1 after rank 0 had completed: the attempt ended as an infrastructure
    failure and was retried, but the last line said "step 66/66 (attempt 1): completed"."""
    from stoker.launch.supervisor import ProgressWatcher
    from stoker.runtime.records import append_jsonl

    def last_line(job, retrying: bool) -> str:
        job.mkdir()
        seen: list[tuple[float, str]] = []
        watcher = ProgressWatcher(job, lambda p, m: seen.append((p, m)))
        for event in [{"event": "start", "step": 0, "time": 0.0, "total_steps": 66},
                      *steps(1, 66, 0.0, 0.2),
                      {"event": "checkpoint", "step": 66, "time": 13.5},
                      {"event": "end", "step": 66, "time": 13.6, "outcome": "completed"}]:
            append_jsonl(job / "progress.jsonl", event)
        watcher.report_now(1, retrying=retrying, resume_step=66)
        return seen[-1][1]

    assert last_line(tmp_path / "retried", True) == "restarting (attempt 2, resuming at step 66/66)"
    # the usual end: no retry follows a completed attempt
    assert last_line(tmp_path / "done", False) == "step 66/66 (attempt 1): completed"


def test_a_requested_stop_reads_stopping_not_restarting(tmp_path):
    from stoker.jobs.stop_request import request_stop
    from stoker.launch.supervisor import ProgressWatcher
    from stoker.runtime.records import append_jsonl

    seen: list[tuple[float, str]] = []
    watcher = ProgressWatcher(tmp_path, lambda p, m: seen.append((p, m)))
    for event in [{"event": "start", "step": 0, "time": 0.0, "total_steps": 66},
                  *steps(1, 16, 0.0, 0.2),
                  {"event": "checkpoint", "step": 16, "time": 3.5},
                  {"event": "end", "step": 16, "time": 3.6, "outcome": "preempted"}]:
        append_jsonl(tmp_path / "progress.jsonl", event)
    watcher.report_now(1, retrying=True)
    assert seen[-1][1] == "restarting (attempt 2, resuming at step 16/66)"
    request_stop(tmp_path, "cost-guard", "stalled")
    watcher.poll()
    watcher.poll()  # unchanged: not repeated
    assert len(seen) == 2 and seen[-1][1].startswith("stopping (")
    assert "cost-guard" in seen[-1][1] and seen[-1][1].endswith("at step 16/66")


def test_a_prefect_cancel_reads_stopping_not_restarting(tmp_path):
    """New-user trial: a cancel on a worker logged `restarting (attempt 2, resuming at step
    80/270)`, though nothing restarts. The train task records the cancel as the stop's sender
    (stop-sender.json); an older record is not this run's."""
    from stoker.launch.supervisor import ProgressWatcher
    from stoker.runtime.preemption import STOP_SENDER_FILE, record_stop_sender
    from stoker.runtime.records import append_jsonl, write_json

    write_json(tmp_path / STOP_SENDER_FILE, {"sender": "an old stop", "time": 1.0})
    seen: list[str] = []
    watcher = ProgressWatcher(tmp_path, lambda p, m: seen.append(m))
    for event in [{"event": "start", "step": 0, "time": 0.0, "total_steps": 66},
                  *steps(1, 16, 0.0, 0.2),
                  {"event": "checkpoint", "step": 16, "time": 3.5},
                  {"event": "end", "step": 16, "time": 3.6, "outcome": "preempted"}]:
        append_jsonl(tmp_path / "progress.jsonl", event)
    watcher.report_now(1, retrying=True)
    assert seen[-1] == "restarting (attempt 2, resuming at step 16/66)"  # a preemption
    record_stop_sender(tmp_path, "a Prefect cancel of flow run 'just-coati'")
    watcher.poll()
    assert seen[-1] == ("stopping (a Prefect cancel of flow run 'just-coati'): checkpoint "
                        "committed at step 16/66")


def test_no_step_line_after_stoker_run_said_stopping(tmp_path, monkeypatch):
    """New-user trial: a `step 56/270 ..., ETA 87 s` line came after `stoker run: stopping
    (SIGINT (Ctrl-C))`; once the stop signal is in, only the stop's own line follows."""
    import signal

    import stoker.stopping
    from stoker.launch.supervisor import ProgressWatcher
    from stoker.runtime.records import append_jsonl

    seen: list[str] = []
    watcher = ProgressWatcher(tmp_path, lambda p, m: seen.append(m))
    for event in [{"event": "start", "step": 0, "time": 0.0, "total_steps": 66},
                  *steps(1, 10, 0.0, 0.2)]:
        append_jsonl(tmp_path / "progress.jsonl", event)
    watcher.poll()
    assert seen[-1].startswith("step 10/66 (attempt 1)"), seen
    monkeypatch.setattr(stoker.stopping, "_received", [signal.SIGINT])
    for event in steps(11, 16, 2.0, 0.2):  # the ranks train on until the stop's step
        append_jsonl(tmp_path / "progress.jsonl", event)
    watcher.poll()
    assert len(seen) == 1, seen  # no "step 16/66 ..." after "stopping"
    for event in [{"event": "checkpoint", "step": 16, "time": 3.5},
                  {"event": "end", "step": 16, "time": 3.6, "outcome": "preempted"}]:
        append_jsonl(tmp_path / "progress.jsonl", event)
    watcher.poll()
    assert len(seen) == 2 and seen[-1] == ("stopping (SIGINT (Ctrl-C)): checkpoint committed at "
                                           "step 16/66"), seen


def test_restarting_is_said_only_when_a_retry_follows(tmp_path):
    """New-user trial: with retry.max_infra_failures=0, a lost data worker printed `restarting
    (attempt 2, resuming at step …)` and `no retry left` 40 ms later. The watcher's own polls
    leave the line out until the train task has decided (report_now)."""
    from stoker.launch.supervisor import ProgressWatcher
    from stoker.runtime.records import append_jsonl

    def attempt(job, end: str) -> tuple[ProgressWatcher, list[str]]:
        seen: list[str] = []
        watcher = ProgressWatcher(job, lambda p, m: seen.append(m))
        for event in [{"event": "start", "step": 0, "time": 0.0, "total_steps": 66},
                      *steps(1, 12, 0.0, 0.2),
                      {"event": "checkpoint", "step": 10, "time": 2.1},
                      {"event": "end", "step": 12, "time": 2.6, "outcome": end}]:
            append_jsonl(job / "progress.jsonl", event)
        watcher.poll()
        assert seen == [], seen  # ended, not decided yet: nothing said
        return watcher, seen

    (spent := tmp_path / "spent").mkdir()
    watcher, seen = attempt(spent, "infrastructure")
    watcher.report_now(1, retrying=False)
    watcher.poll()
    assert seen == ["step 12/66 (attempt 1): infrastructure_failure, no retry left"], seen
    (retried := tmp_path / "retried").mkdir()
    watcher, seen = attempt(retried, "preempted")
    watcher.report_now(1, retrying=True)
    assert seen == ["restarting (attempt 2, resuming at step 10/66)"], seen


def test_attempts_are_numbered_by_their_records_not_by_start_events(tmp_path):
    """New-user trial: attempt 1 died before its ranks' start event (a data worker killed at
    step 0); attempt 2 finished, and the progress line and `stoker status` said `step 45/45
    (attempt 1): completed`. The attempt records (attempts.jsonl) number the attempts."""
    from stoker.jobs.attempts import AttemptLog
    from stoker.jobs.status import attempt_at, job_summary
    from stoker.launch.supervisor import ProgressWatcher
    from stoker.runtime.records import append_jsonl

    log = AttemptLog(tmp_path)
    log.start(1, "on_demand", "flow-run", "local")
    log.end(1, {"number": 1, "exit_code": 137, "outcome": "infrastructure_failure",
                "started": 0.0, "duration_s": 1.0})
    log.start(2, "on_demand", "flow-run", "local")
    started_2 = log.records()[-1]["started"]
    seen: list[str] = []
    watcher = ProgressWatcher(tmp_path, lambda p, m: seen.append(m))
    for event in [{"event": "start", "step": 0, "time": started_2 + 1, "total_steps": 45},
                  *steps(1, 45, started_2 + 1, 0.01),
                  {"event": "end", "step": 45, "time": started_2 + 2, "outcome": "completed"}]:
        append_jsonl(tmp_path / "progress.jsonl", event)
    watcher.poll()
    assert seen == ["step 45/45 (attempt 2): completed"], seen
    assert job_summary(tmp_path).progress.attempt == 2
    # untrusted records: no number, a flag for a time, a time after the start
    assert attempt_at([{"number": True, "started": 0}, {"number": 3, "started": "0"},
                       {"number": 4, "started": 9.0}], 5.0) is None
    assert attempt_at([{"number": 1, "started": 0.0}], True) is None
    assert job_progress([{"event": "start", "step": 0, "time": 5.0, "total_steps": 9}],
                        [{"number": 4, "started": 9.0}]).attempt == 1  # counted, as before


def test_the_progress_thread_outlives_a_report_that_raises_system_exit(tmp_path):
    """rich, which prints Prefect's console log lines, raises ``SystemExit(1)`` on a broken
    pipe; in the watcher's thread that ended the thread silently and the progress lines
    stopped (trial: after the worker was killed). A failed report is skipped, the next one is
    made."""
    from stoker.launch.supervisor import ProgressWatcher
    from stoker.runtime.records import append_jsonl

    seen: list[str] = []

    def report(percent: float, message: str) -> None:
        seen.append(message)
        if len(seen) == 1:
            raise SystemExit(1)

    watcher = ProgressWatcher(tmp_path, report, every_s=0.05)
    append_jsonl(tmp_path / "progress.jsonl", {"event": "start", "step": 0, "time": 0.0,
                                               "total_steps": 66})
    for event in steps(1, 8, 0.0, 0.2):
        append_jsonl(tmp_path / "progress.jsonl", event)
    watcher.start()
    try:
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.is_alive()
    finally:
        watcher.stopped.set()
    assert len(seen) >= 2 and seen[1] == seen[0], seen  # said again once it could be said


def _ended_attempt(job, number: int, record: dict) -> None:
    from stoker.jobs.attempts import AttemptLog

    log = AttemptLog(job)
    log.start(number, "on_demand")
    log.end(number, {"exit_code": 75, "duration_s": 3.0, "capacity_type": "on_demand",
                     "started": time.time() - 3, **record})


def _committed(checkpoints, step: int) -> None:
    folder = checkpoints / f"step-{step:09d}"
    folder.mkdir(parents=True)
    (folder / "COMMITTED").write_text("{}")


def test_a_resumed_job_says_in_words_that_it_resumes_and_from_where(tmp_path):
    """Trial: a resumed stopped job said only its id and `attempt 2`. The line names the
    last attempt's end (who stopped it, at which step) and the checkpoint it goes on from."""
    from stoker.jobs.status import resuming_line
    from stoker.runtime.records import append_jsonl

    job, checkpoints = tmp_path / "fruit", tmp_path / "fruit" / "checkpoints"
    job.mkdir()
    assert resuming_line(job, str(checkpoints)) is None  # a new job: nothing to resume
    append_jsonl(job / "progress.jsonl", {"event": "start", "step": 0, "time": time.time(),
                                          "total_steps": 120})
    _ended_attempt(job, 1, {"outcome": "stopped", "reached_step": 52,
                            "stopped_by": "budget: max_cost_usd $0.15\nreached"})
    _committed(checkpoints, 40)
    assert resuming_line(job, str(checkpoints)) == (
        "job fruit: resuming a stopped job as attempt 2 from its checkpoint of step 40/120 "
        "(attempt 1 was stopped at step 52/120 by budget: max_cost_usd $0.15 reached)")

    _ended_attempt(job, 2, {"outcome": "interrupted", "reached_step": 61,
                            "stopped_by": "SIGINT (Ctrl-C)"})
    assert resuming_line(job, str(checkpoints)).endswith(
        "as attempt 3 from its checkpoint of step 40/120 (attempt 2 was interrupted at step "
        "61/120 by SIGINT (Ctrl-C))")

    # Its run killed (kill -9): closed by the next run, no one stopped it. `stoker jobs` says
    # unfinished; so does this line (trial: it said "a stopped job").
    _ended_attempt(job, 3, {"outcome": "interrupted", "reached_step": 70, "left_open": True})
    assert resuming_line(job, str(checkpoints)) == (
        "job fruit: resuming an unfinished job as attempt 4 from its checkpoint of step 40/120 "
        "(attempt 3 ended when its run died at step 70/120)")

    # Untrusted records: values of the wrong type are left out, never raised on.
    _ended_attempt(job, 4, {"outcome": ["x"], "reached_step": "many", "stopped_by": 7})
    line = resuming_line(job, str(tmp_path / "none"))
    assert line.startswith("job fruit: resuming the job as attempt 5 from step 0 (no checkpoint "
                           "was committed) (attempt 4 ended without a recorded outcome"), line


def test_the_restart_line_names_the_committed_step_and_comes_when_rank_0_died(tmp_path):
    """Trial: a rank killed in the save of step 165 printed `restarting (attempt 2, resuming
    at step 165/1200)`, the retry resumed at 160 (the checkpoint event comes before the
    commit); with rank 0 killed (no end event) no restart line came at all."""
    from stoker.launch.supervisor import ProgressWatcher
    from stoker.runtime.records import append_jsonl

    for ended in (True, False):  # the ranks wrote their end event, or rank 0 died first
        job = tmp_path / f"ended-{ended}"
        job.mkdir()
        seen: list[str] = []
        watcher = ProgressWatcher(job, lambda p, m, seen=seen: seen.append(m))
        for event in [{"event": "start", "step": 0, "time": 0.0, "total_steps": 1200},
                      *steps(1, 166, 0.0, 0.01),
                      {"event": "checkpoint", "step": 160, "time": 1.61},
                      {"event": "checkpoint", "step": 165, "time": 1.66},
                      *([{"event": "end", "step": 166, "time": 1.7, "outcome": "infrastructure"}]
                        if ended else [])]:
            append_jsonl(job / "progress.jsonl", event)
        watcher.report_now(1, retrying=True, resume_step=160)
        assert seen[-1] == "restarting (attempt 2, resuming at step 160/1200)", seen


def test_status_resumes_at_the_committed_step_not_the_last_checkpoint_event(tmp_path):
    """Trial: `stoker status` said `resumes at step 120` and `steps lost 5` of a job whose
    rank was killed in the save of step 120; the rerun resumed at 115 (its COMMITTED)."""
    from stoker.jobs.attempts import AttemptLog
    from stoker.jobs.status import job_summary
    from stoker.runtime.records import append_jsonl

    started = time.time() - 10
    for event in [{"event": "start", "step": 0, "time": started, "total_steps": 600},
                  *steps(1, 121, started, 0.01),
                  {"event": "checkpoint", "step": 115, "time": started + 1.16},
                  {"event": "checkpoint", "step": 120, "time": started + 1.21},
                  {"event": "end", "step": 121, "time": started + 1.3,
                   "outcome": "infrastructure"}]:
        append_jsonl(tmp_path / "progress.jsonl", event)
    log = AttemptLog(tmp_path)
    log.start(1, "on_demand")
    log.end(1, {"exit_code": 137, "outcome": "infrastructure_failure", "started": started,
                "duration_s": 2.0, "reached_step": 121, "committed_step": 115,
                "steps_lost": 6})
    _committed(tmp_path / "checkpoints", 115)
    (tmp_path / "checkpoints" / "step-000000120").mkdir()  # its save began, never committed
    summary = job_summary(tmp_path)
    assert summary.state == "unfinished"
    assert summary.progress.resume_step == 115, summary.progress
    assert "resumes at step 115 " in summary.progress.describe()
