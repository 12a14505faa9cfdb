"""How the Slurm launcher reads the end of a job that ``scontrol`` no longer knows (``MinJobAge``
passed, a controller restart): from ``sacct``. The cluster of .ci/start-slurm.sh keeps no
accounting database, so its real ``sacct`` answers "accounting storage is disabled"; a ``sacct``
put first on PATH stands in for one with a database, printing what the real one prints for
``sacct -j ID -X -n -P -o State,ExitCode`` (Slurm's documented ``--parsable2`` format: one
``STATE|CODE:SIGNAL`` line per allocation, no header; ``CANCELLED by <uid>``)."""

# ruff: noqa: F811 - the fixture imported from test_slurm is a parameter here
from __future__ import annotations

import os
import shutil
import textwrap

import pytest
from test_slurm import cluster  # noqa: F401 - fixture

from stoker.launch.slurm import current_record, exit_code_for_job

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("slurm")]
# Ids the real controller does not know (its ids count up from 1 in this cluster).
SACCT_LINES = {
    "66000001": ("COMPLETED|0:0", 0),
    "66000002": ("FAILED|75:0", 75),  # every rank committed its stop checkpoint
    "66000003": ("PREEMPTED|0:15", 75),
    "66000004": ("NODE_FAIL|1:0", 137),
    "66000005": ("FAILED|2:0", 2),  # a user error
    "66000006": ("TIMEOUT|0:15", 137),
    "66000007": ("OUT_OF_MEMORY|0:125", 137),
}


@pytest.fixture
def sacct_with_a_database(tmp_path, monkeypatch):
    """A ``sacct`` first on PATH that answers the launcher's exact query like a real one with
    an accounting database, and refuses any other arguments."""
    cases = "\n".join(f'  {job_id}) echo "{line}" ;;' for job_id, (line, _) in
                      SACCT_LINES.items())
    script = tmp_path / "bin" / "sacct"
    script.parent.mkdir()
    script.write_text(textwrap.dedent("""\
        #!/bin/bash
        [ "$1 $3 $4 $5 $6 $7" = "-j -X -n -P -o State,ExitCode" ] && [ $# -eq 7 ] || {
          echo "sacct: unexpected arguments: $*" >&2; exit 2; }
        case "$2" in
        """) + cases + "\n  *) ;;\nesac\n")  # an unknown job: no line, exit 0
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return script


def test_a_job_scontrol_forgot_ends_as_sacct_says(cluster, sacct_with_a_database):
    for job_id, (line, expected) in SACCT_LINES.items():
        record = current_record(job_id)
        assert record["Reason"] == "read with sacct", (job_id, record)
        assert exit_code_for_job(record["JobState"], record["ExitCode"], False) == expected, line


def test_sacct_names_who_cancelled_and_scontrol_does_not(cluster, tmp_path, monkeypatch):
    script = tmp_path / "sacct"
    script.write_text('#!/bin/bash\necho "CANCELLED by 1000|0:15"\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    record = current_record("66000010")
    assert (record["JobState"], record["ExitCode"]) == ("CANCELLED", "0:15")


def test_an_end_nobody_knows_is_retried_not_a_user_error(cluster, sacct_with_a_database):
    """No record anywhere (the real sacct of a cluster without accounting, or a database that
    has no line yet): the attempt's end is unknown. It was exit 1, a user error that is never
    retried; it is an infrastructure failure, retried from the last checkpoint."""
    unrecorded = current_record("66000099")  # the fake: no line
    os.environ["PATH"] = os.environ["PATH"].split(os.pathsep, 1)[1]  # the real sacct again
    assert shutil.which("sacct") != str(sacct_with_a_database)
    disabled = current_record("66000099")
    assert unrecorded["JobState"] == disabled["JobState"] == "UNKNOWN"
    assert "accounting storage is disabled" in disabled["Reason"]
    for record in (unrecorded, disabled):
        assert exit_code_for_job(record["JobState"], record["ExitCode"], False) == 137
