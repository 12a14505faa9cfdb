"""Prefect cancel of a deployment run on a process worker: how fast it reaches the ranks, and how
fast the flow run shows Cancelled.

Each trial runs the ``pipeline`` deployment (2 gloo ranks, the demo digits, MLflow sqlite) on a
real ``prefect server`` with a real process worker (``prefect worker start --run-once``), waits
until training passes a step, then asks for the cancel the way the UI and ``prefect flow-run
cancel`` do (the flow run goes to Cancelling), and times:

* cancel -> ranks stopped: until rank 0's ``end`` event (its stop checkpoint committed; the
  SIGTERM reached the ranks before that). Target: median <= 2 s.
* cancel -> Cancelled: until the flow run's state is Cancelled on the server. Target: median
  <= 5 s.

There is no baseline run (Prefect alone has no training tree to stop): the figures are absolute.

    python benchmarks/bench_cancel.py [--quick] [--repeats N]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the Prefect server helper the tests use

from benchmarks.common import Target, check, emit, log, options, summary  # noqa: E402
from stoker.launch.local import terminate_tree  # noqa: E402
from stoker.runtime.progress import read_events  # noqa: E402

POOL = "stoker-process"


def deploy(server) -> None:
    """The process work pool and the ``pipeline`` deployment from this checkout."""
    server.prefect("work-pool", "create", POOL, "--type", "process", "--base-job-template",
                   str(ROOT / "infra/work-pools/process.json"))
    server.prefect("--no-prompt", "deploy", "--name", "pipeline", cwd=ROOT)


@dataclass
class CancelTrial:
    """One cancel: times in seconds from the cancel request (None: never seen)."""

    flow_run_id: str
    job_dir: Path | None
    to_ranks_stopped_s: float | None
    to_cancelled_s: float | None
    final_state: str
    worker_output: str


def _wait_for_step(work: Path, worker: subprocess.Popen, min_step: int, timeout_s: float
                   ) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise RuntimeError("the worker exited before training: "
                               + (worker.stdout.read() if worker.stdout else ""))
        for job in (work / "jobs").glob("*") if (work / "jobs").is_dir() else []:
            if any(e.get("event") == "step" and e.get("step", 0) >= min_step
                   for e in read_events(job)) and (job / "mlflow_run_id").is_file():
                return job  # training, with its MLflow run open (it opens in the background)
        time.sleep(0.05)
    raise RuntimeError(f"training never reached step {min_step}")


def cancel_trial(server, work: Path, epochs: int = 30, min_step: int = 3,
                 timeout_s: float = 300) -> CancelTrial:
    """Run the pipeline deployment on a process worker, cancel it mid-training, time it."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    params = {"config": {"work_dir": str(work), "train": {"epochs": epochs},
                         "overrides": ["tracking.system_metrics_interval_s=null"]}}
    out = server.prefect("deployment", "run", "pipeline/pipeline", "--params",
                         json.dumps(params)).stdout
    flow_run_id = next(line.split("UUID:")[1].strip() for line in out.splitlines()
                       if "UUID:" in line)
    worker = subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--run-once"],
        env={**server.env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        job = _wait_for_step(work, worker, min_step, timeout_s)
        with temporary_settings({PREFECT_API_URL: server.api_url}), \
                get_client(sync_client=True) as client:
            asked = time.time()
            client.set_flow_run_state(uuid.UUID(flow_run_id), Cancelling(), force=True)
            cancelled_at, state = None, "UNKNOWN"
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                state = client.read_flow_run(uuid.UUID(flow_run_id)).state.type.value
                if state == "CANCELLED":
                    cancelled_at = time.time()
                    break
                if state in ("COMPLETED", "FAILED", "CRASHED"):
                    break
                time.sleep(0.1)
        output, _ = worker.communicate(timeout=timeout_s)
    finally:
        if worker.poll() is None:
            terminate_tree(worker.pid, grace_s=10)
    ends = [e for e in read_events(job) if e.get("event") == "end" and e["time"] >= asked]
    return CancelTrial(flow_run_id, job, round(ends[0]["time"] - asked, 3) if ends else None,
                       round(cancelled_at - asked, 3) if cancelled_at else None, state,
                       output or "")


def main() -> int:
    from prefect_server import PrefectServer

    args = options(__doc__, repeats=3)
    ranks, cancelled = [], []
    tmp = Path(tempfile.mkdtemp(prefix="bench-cancel-")) if args.workdir is None \
        else args.workdir
    with PrefectServer(tmp / "server") as server:
        deploy(server)
        for i in range(args.repeats):
            trial = cancel_trial(server, tmp / f"work-{i}")
            (tmp / f"worker-{i}.log").write_text(trial.worker_output)
            log(f"trial {i + 1}: cancel -> ranks stopped {trial.to_ranks_stopped_s} s, "
                f"-> {trial.final_state} {trial.to_cancelled_s} s")
            if trial.to_ranks_stopped_s is None or trial.to_cancelled_s is None:
                log(trial.worker_output[-3000:])
                return 1
            ranks.append(trial.to_ranks_stopped_s)
            cancelled.append(trial.to_cancelled_s)
    emit("cancel", metric="seconds from a Prefect cancel",
         candidate=summary(cancelled, "s", "cancel -> Cancelled"),
         checks=[check("cancel -> ranks stopped", ranks, "s", Target("<=", 2.0)),
                 check("cancel -> Cancelled", cancelled, "s", Target("<=", 5.0))],
         target="ranks stopped <= 2 s, Cancelled <= 5 s", quick=args.quick,
         details={"ranks_stopped": summary(ranks, "s", "cancel -> ranks stopped")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
