"""The end of ``stoker run``: seconds from the last training step to the process exit.

Issue 46 saw 12-15 s there. Each run is ``python -m stoker.cli run work_dir=<fresh>
train.epochs=N data.repo_url=<demo> tracking.tracking_uri=<sqlite>`` on the long-lived local
Prefect server (started once, untimed) and a warm MLflow store; the tail is cut into parts by
the marks the run leaves:

* ``checkpoint``, ``data``, ``mlflow``, ``model``, ``process group``: rank 0's ``end:`` line
  (the wait for the last checkpoint, the data workers' end, closing the MLflow run, logging the
  model to it, the process-group teardown), after its last ``step``/``eval``/``checkpoint``
  event in ``progress.jsonl``;
* ``last step to end event``: what the runtime does between the last step and its ``end``
  event (final evaluation, final checkpoint, ``result.json``, the wait for MLflow to open);
* ``ranks exit``: the ``end:`` line to torchrun's exit (the attempt's end in ``attempts.jsonl``);
* ``train wrap up``, ``register``, ``report and flow end``, ``shutdown``: Prefect's log lines
  and the process exit.

Target: the whole tail <= 5 s (median) on an idle machine.

    python benchmarks/bench_end_of_run.py [--quick] [--repeats N] [--epochs N]
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import PYTHON, Target, Workdir, emit, log, options, run_timed  # noqa: E402
from benchmarks.jobs import demo_dataset  # noqa: E402
from benchmarks.stats import check  # noqa: E402
from stoker.local_server import LocalServer  # noqa: E402
from stoker.runtime.progress import read_events  # noqa: E402
from stoker.runtime.records import read_jsonl  # noqa: E402

TARGET = Target("<=", 5.0)
TIMEOUT_S = 900
_STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d{3}) \| ")
_END = re.compile(r"end: checkpoint ([\d.]+) s, data ([\d.]+) s, mlflow ([\d.]+) s, "
                  r"model ([\d.]+) s, process group ([\d.]+) s")
MARKS = (("train wrap up", r"Task run 'train-[^']*' - Finished"),
         ("register", r"Task run 'register-model-[^']*' - Finished"),
         ("report and flow end", r"Flow run '[^']*' - Finished"))


def _at(line: str, started: float) -> float | None:
    """The Unix time of a Prefect log line (stamped with local wall-clock time), or None."""
    stamp = _STAMP.match(line)
    if stamp is None:
        return None
    day = time.localtime(started)
    midnight = started - (day.tm_hour * 3600 + day.tm_min * 60 + day.tm_sec + started % 1)
    h, m, sec = stamp.groups()
    at = midnight + int(h) * 3600 + int(m) * 60 + float(sec)
    return at + (86400 if at < started - 1 else 0)


def tail(job_dir: Path, log_text: str, started: float, ended: float) -> dict[str, float]:
    """Seconds per part of one run's end, from its job folder and its output.

    Args:
        job_dir: the run's job folder (``progress.jsonl``, ``attempts.jsonl``).
        log_text: the run's output.
        started, ended: Unix times of the process start and exit.

    Returns:
        part -> seconds, plus ``total`` (last step to exit); {} when a mark is missing.
    """
    events = read_events(job_dir)
    last_step = max(e["time"] for e in events if e.get("event") == "step")
    end_event = max(e["time"] for e in events if e.get("event") == "end")
    ended_attempt = [a for a in read_jsonl(job_dir / "attempts.jsonl") if a.get("state") == "ended"]
    parts = _END.search(log_text)
    if not ended_attempt or parts is None:
        return {}
    out = {"last step to end event": end_event - last_step}
    out |= dict(zip(("checkpoint", "data", "mlflow", "model", "process group"),
                    map(float, parts.groups()), strict=True))
    ranks_exit = ended_attempt[-1]["started"] + ended_attempt[-1]["duration_s"]
    out["ranks exit"] = ranks_exit - end_event - sum(map(float, parts.groups()[2:]))
    previous, lines = ranks_exit, iter(log_text.splitlines())
    for name, pattern in MARKS:
        at = next((_at(line, started) for line in lines if re.search(pattern, line)), None)
        if at is None:
            return {}
        out[name], previous = at - previous, at
    out["shutdown"] = ended - previous
    out["total"] = ended - last_step
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    args = options(__doc__, 3, extra=lambda p: p.add_argument(
        "--epochs", type=int, default=None, help="epochs per run (3; 1 with --quick)"))
    epochs = args.epochs or (1 if args.quick else 3)
    with Workdir(args.workdir, "bench-end") as work:
        dataset = demo_dataset(args.data_dir or work, quick=args.quick)
        tracking = f"sqlite:///{work / 'mlflow.db'}"
        server = LocalServer(work / "prefect", startup_timeout_s=300)
        log("the local Prefect server: started once, untimed (the runs reuse it)")
        server.ensure()
        tails = []
        try:
            for i in range(args.repeats + 1):  # run 0: warms the MLflow store, not counted
                run_dir = work / f"run-{i}"
                run_dir.mkdir()
                started = time.time()
                run_timed([PYTHON, "-m", "stoker.cli", "run", f"work_dir={run_dir}",
                           f"train.epochs={epochs}", f"data.repo_url={dataset.repo_url}",
                           f"tracking.tracking_uri={tracking}"], work / f"run-{i}.log",
                          TIMEOUT_S, extra_env={"PREFECT_HOME": str(work / "prefect")},
                          cwd=run_dir)
                (job,) = (run_dir / "jobs").iterdir()
                parts = tail(job, (work / f"run-{i}.log").read_text(), started, time.time())
                log(f"run {i}: {json.dumps(parts)}")
                if i and parts:
                    tails.append(parts)
        finally:
            server.stop()
    if not tails:
        raise SystemExit("no run left every mark (another log format?)")
    medians = {k: round(statistics.median(t[k] for t in tails), 3) for k in tails[0]}
    emit("end_of_run", metric="seconds from the last training step to the exit of stoker run",
         quick=args.quick, target="the tail <= 5 s (median)",
         checks=[check("last step to exit", [t["total"] for t in tails], "s", TARGET)],
         notes=["parts (median s): " + ", ".join(f"{k} {v}" for k, v in medians.items())],
         details={"parts_per_run": tails, "parts_median_s": medians, "epochs": epochs})


if __name__ == "__main__":
    main()
