"""Where the seconds after the last step go (issue 46: 12-15 s from the last step to the exit of
`stoker run`): rank 0 says, in one line, what each part of its end took. The figures are the
benchmark's (benchmarks/bench_end_of_run.py); this test checks the line's structure only."""

from __future__ import annotations

import re

import pytest
from test_runtime import launch

from stoker.launch.retry import Outcome

pytestmark = pytest.mark.integration

END_LINE = re.compile(r"\[rank0\].* end: checkpoint (\d+\.\d\d) s, data (\d+\.\d\d) s, "
                      r"mlflow (\d+\.\d\d) s, model (\d+\.\d\d) s, process group (\d+\.\d\d) s$",
                      re.M)


def test_rank_0_names_the_seconds_of_each_part_of_its_end(make_spec):
    spec = make_spec(epochs=1)
    attempts, output, _ = launch(spec)
    assert [a.outcome for a in attempts] == [Outcome.COMPLETED], output
    lines = END_LINE.findall(output)
    assert len(lines) == 1, output[-3000:]  # rank 0 only, once
    assert all(float(seconds) >= 0 for seconds in lines[0])
    assert "end: " not in output.replace(END_LINE.search(output).group(0), "")
