"""The benchmarks: their pure helpers, and one smoke run of them all at a tiny size.

The smoke run checks that every script runs and reports a numeric ratio, not that any target is
met (speed targets are the benchmarks' business, never a test's).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # plain `pytest` (not `python -m pytest`) leaves it off the path
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_pipeline_overhead import phases  # noqa: E402
from benchmarks.common import Target, alternate, check, emit, ratio_range, stats  # noqa: E402
from benchmarks.jobs import steady_window  # noqa: E402
from benchmarks.run_all import MEASURES, parse_result, supports, unstructured  # noqa: E402

OURS = ("bench_pipeline_overhead", "bench_trainer_throughput", "bench_checkpoint",
        "bench_recovery", "bench_dataset", "bench_tracking", "bench_gpu_resnet")


def write_events(job_dir: Path, events: list[dict]) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "progress.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_steady_window_takes_evaluation_out_and_keeps_checkpoints(tmp_path):
    t = 1000.0
    write_events(tmp_path, [
        {"event": "start", "time": t, "step": 0},
        *({"event": "step", "time": t + s * 0.1, "step": s} for s in range(1, 4)),
        {"event": "eval", "time": t + 0.3 + 0.5, "step": 3},        # evaluation: 0.5 s
        {"event": "checkpoint", "time": t + 0.3 + 0.7, "step": 3},  # save: 0.2 s, kept
        *({"event": "step", "time": t + 0.7 + s * 0.1, "step": s} for s in range(4, 7)),
        {"event": "end", "time": t + 1.4, "step": 6},
    ])
    window = steady_window(tmp_path, first_step=2)
    assert window.steps == 4
    assert window.eval_s == pytest.approx(0.5)
    assert window.train_s == pytest.approx(1.3 - 0.2 - 0.5)  # step 2 -> 6, minus evaluation
    assert window.samples_per_s(64) == pytest.approx(4 * 64 / 0.6)
    assert window.median_step_s == pytest.approx(0.1)


def test_steady_window_needs_steps_after_the_first(tmp_path):
    write_events(tmp_path, [{"event": "step", "time": 1.0, "step": 1}])
    with pytest.raises(RuntimeError, match="no step events after step 1"):
        steady_window(tmp_path, first_step=1)


def test_alternate_flips_the_order_every_pair():
    calls = []
    base, cand = alternate(lambda i: calls.append(f"A{i}") or float(i),
                           lambda i: calls.append(f"B{i}") or 10.0 + i, 3)
    assert calls == ["A0", "B0", "B1", "A1", "A2", "B2"]
    assert base == [0.0, 1.0, 2.0] and cand == [10.0, 11.0, 12.0]


def test_result_line_is_last_and_ends_with_the_verdict(capsys):
    side = {"name": "x", "unit": "s", "median": 2.0, "min": 1.0, "max": 3.0, "n": 3,
            "values": [1.0, 2.0, 3.0]}
    emit("demo", metric="a / b", baseline=side, candidate=side, ratio=1.0,
         target=Target("<=", 1.05), checks=[check("warm", 0.7, "s", Target("<=", 0.5))])
    last = capsys.readouterr().out.splitlines()[-1]
    result = json.loads(last)
    assert list(result)[-3:] == ["ratio", "target", "target_met"]
    assert result["ratio"] == 1.0 and result["target"] == "<= 1.05"
    assert result["target_met"] is False  # the ratio is met, the check is not
    assert result["checks"][0]["met"] is False


def test_informative_ratio_takes_its_verdict_from_the_checks(capsys):
    emit("demo", metric="a / b", baseline=None, candidate=None, ratio=1.2,
         target="recovery <= 10 s", checks=[check("recovery", 8.0, "s", Target("<=", 10))])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["target_met"] is True


def test_a_verdict_that_the_spread_could_flip_is_marked_undecided(capsys):
    base, cand = stats([8.0, 10.0, 12.0], "s", "a"), stats([9.0, 10.2, 11.0], "s", "b")
    spread = ratio_range(lambda b, c: c / b, base, cand)
    assert spread == pytest.approx((9 / 12, 11 / 8))
    emit("demo", metric="b / a", baseline=base, candidate=cand, ratio=1.02,
         target=Target("<=", 1.05), spread=spread,
         checks=[check("warm", 0.1, "s", Target("<=", 0.5), spread=(0.05, 0.2))])
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["target_met"] is True and result["decided"] is False
    assert result["checks"][0]["decided"] is True and result["ratio_range"] == [0.75, 1.375]


def test_pipeline_phases_from_prefect_log_lines():
    started = dt.datetime(2026, 1, 2, 7, 37, 0).timestamp()
    log = "\n".join([
        "07:37:06.000 | INFO    | prefect - Starting temporary server on http://127.0.0.1:8494",
        "07:37:16.000 | INFO    | Flow run 'x' - Beginning flow run 'x' for flow 'pipeline'",
        "noise without a time stamp",
        "07:37:17.000 | INFO    | Task run 'pull-dataset-5c1' - Finished in state Completed()",
        "07:37:18.000 | INFO    | Task run 'attempt-1' - attempt 1 on on_demand capacity",
        "07:37:38.000 | INFO    | Task run 'attempt-1' - Finished in state Completed()",
        "07:37:38.500 | INFO    | Task run 'train-fc3' - Finished in state Completed()",
        "07:37:42.500 | INFO    | Task run 'register-model-61c' - Finished in state Completed()",
        "07:37:43.000 | INFO    | Flow run 'x' - Finished in state Completed()",
    ])
    got = phases(log, started, started + 50)
    assert got == {"python_and_prefect_import": 6.0, "prefect_server_start": 10.0, "pull": 1.0,
                   "train_setup": 1.0, "train_attempt": 20.0, "train_wrap_up": 0.5,
                   "register": 4.0, "report_and_flow_end": 0.5, "shutdown": 7.0}
    assert phases("no prefect lines", started, started + 1) == {}


def test_run_all_reads_json_results_and_plain_text_ones():
    out = 'text\n{"benchmark": "x", "ratio": 0.5}\nnote: after\n{"not": "a result"}\n'
    assert parse_result(out) == {"benchmark": "x", "ratio": 0.5}
    text = unstructured("cached docker build: median 2.1 s\nratio decision / cached build: "
                        "0.0123\n")
    assert text["ratio"] == pytest.approx(0.0123) and text["target_met"] is None
    assert unstructured("no figure here")["status"] == "no result"


def test_our_scripts_take_the_common_options(tmp_path):
    for stem in OURS:
        assert supports(ROOT / "benchmarks" / f"{stem}.py", "--quick"), stem
    plain = tmp_path / "bench_plain.py"
    plain.write_text('import argparse\np = argparse.ArgumentParser()\np.add_argument("--n")\n')
    assert not supports(plain, "--quick")


@pytest.mark.integration
def test_every_benchmark_runs_at_a_tiny_size_and_reports_a_ratio(tmp_path):
    import torch

    output = tmp_path / "RESULTS.md"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick",
         "--output", str(output), "--logs", str(tmp_path / "logs")],
        capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"run_all --quick: {time.monotonic() - started:.0f} s")
    results = json.loads(output.with_suffix(".json").read_text())["results"]
    assert set(results) >= {stem for stem, _, _ in MEASURES}

    def log(stem: str) -> str:
        path = tmp_path / "logs" / f"{stem}.log"
        return path.read_text()[-3000:] if path.exists() else "(no log)"

    for stem in OURS:
        result = results[stem]
        if stem == "bench_gpu_resnet" and not torch.cuda.is_available():
            assert result["status"] == "skipped" and "CUDA" in result["reason"], result
            continue
        assert result["status"] == "ok", (stem, result, log(stem))
        assert isinstance(result["ratio"], float) and math.isfinite(result["ratio"]), stem
        assert result["target_met"] in (True, False), stem
        for side in (result["baseline"], result["candidate"]):
            assert side["n"] == 1 and side["median"] > 0 and side["unit"], (stem, side)
        assert result["quick"] is True

    image = results["bench_image_decision"]
    if not (ROOT / "benchmarks" / "bench_image_decision.py").exists():
        assert image["status"] == "not present"
    elif image["status"] != "skipped":  # a script without --quick is skipped in a quick run
        assert image["status"] == "ok" and isinstance(image["ratio"], float), image

    table = output.read_text()
    assert "## Machine" in table and "| CPU |" in table and "Quick smoke run" in table
    for _, title, _ in MEASURES:
        assert title in table
