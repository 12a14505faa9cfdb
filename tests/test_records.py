"""Stoker's record files after a crash: torn lines skipped with a warning, new lines whole."""

from __future__ import annotations

import json

import pytest

from stoker.runtime.records import JsonlAppender, append_jsonl, read_json, read_jsonl


def test_a_record_appended_after_a_torn_line_stays_whole(tmp_path):
    path = tmp_path / "attempts.jsonl"
    path.write_text(json.dumps({"number": 1}) + '\n{"number": 2, "sta')  # power loss
    append_jsonl(path, {"number": 3})
    appender = JsonlAppender(path)
    appender.append({"number": 4})
    appender.close()
    warnings: list[str] = []
    assert read_jsonl(path, warn=warnings.append) == [{"number": 1}, {"number": 3},
                                                       {"number": 4}]
    assert len(warnings) == 1 and "line 2" in warnings[0] and str(path) in warnings[0]


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "progress.jsonl"
    path.write_text('{"event": "start", "step": 0}\n{"event": "st')
    warnings: list[str] = []
    assert read_jsonl(path, warn=warnings.append) == [{"event": "start", "step": 0}]
    assert "last line" in warnings[0]


def test_a_truncated_json_file_reads_as_the_default_with_a_warning(tmp_path):
    path = tmp_path / "heartbeat.json"
    path.write_text('{"time": 17')
    warnings: list[str] = []
    assert read_json(path, default={}, warn=warnings.append) == {}
    assert "not valid JSON" in warnings[0]
    assert read_json(tmp_path / "missing.json", default=None) is None


def test_the_tests_own_poller_leaves_a_line_being_written_for_the_next_poll(tmp_path):
    """CI once failed a stop test because the poller parsed a progress line mid-append; the
    polling helper must take only whole lines (and still fail on a bad whole one)."""
    from conftest import events

    (tmp_path / "progress.jsonl").write_text('{"event": "step", "step": 1}\n{"event": "ev')
    assert events(tmp_path) == [{"event": "step", "step": 1}]
    (tmp_path / "progress.jsonl").write_text('{"event": "step", "step": 1}\nnot json\n')
    with pytest.raises(json.JSONDecodeError):  # a bad whole line must not pass silently
        events(tmp_path)


def test_a_record_push_that_fails_names_the_error_not_only_its_type(tmp_path, caplog):
    """Trial input: the store's disk full gave `records not pushed to … (OSError)`, no cause."""
    import errno

    from stoker.jobs.store import RecordSync

    class FullStore:  # JobStore's interface as RecordSync uses it
        url = str(tmp_path / "store")

        def push(self, job_dir):
            raise OSError(errno.ENOSPC, "No space left on device\nsecond line")

    with caplog.at_level("WARNING", logger="stoker.jobs.store"):
        assert not RecordSync(FullStore(), tmp_path / "job-1").sync()
    [line] = [r.getMessage() for r in caplog.records if "records not pushed" in r.getMessage()]
    assert "(OSError: [Errno 28] No space left on device second line)" in line, line


@pytest.mark.parametrize("value, expected", [
    (3, 3.0), (2.5, 2.5), (True, None), (float("nan"), None), (float("inf"), None),
    (-float("inf"), None), ("7", None), (None, None), (10**400, None)])
def test_a_record_field_reads_as_a_number_only_when_it_is_a_finite_real_one(value, expected):
    from stoker.runtime.records import real_number

    assert real_number(value) == expected


@pytest.mark.parametrize("time_field", ["NaN", "Infinity", "true"])
def test_a_heartbeat_without_a_finite_time_is_no_heartbeat_for_the_cost_guard(tmp_path,
                                                                             time_field):
    """A heartbeat at ``Infinity`` read as fresh for ever (a job never stopped as idle); at
    ``NaN`` every age comparison was false."""
    from stoker.costguard.signals import read_heartbeat

    (tmp_path / "heartbeat.json").write_text(f'{{"time": {time_field}, "step": 3}}')
    with pytest.raises(ValueError, match="no numeric 'time' field"):
        read_heartbeat(tmp_path)
