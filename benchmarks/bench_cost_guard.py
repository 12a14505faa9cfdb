"""Benchmark: the cost guard's own overhead per sweep, excluding the sampling window.

A busy host stand-in: 8 GPUs behind the NVML stand-in (tests/fake_nvml.py), 4 Stoker-owned
containers on the real Docker Engine (one idle, so the sweep re-checks and stops it), and 40 job
folders (2 running, logging to an MLflow sqlite store, the rest finished). One sweep samples a
2 s window; its overhead is the wall time minus the window. Measured two ways, alternately:

- ``run_sweep``: the sweep itself, in process (discovery, decisions, re-check, one stop);
- ``cli --plain`` (the baseline side): ``stoker cost-guard --plain`` in a new process (imports,
  the sweep, the report printed), as an operator runs it by hand;
- ``cli`` (flow, details only, not with --quick): ``stoker cost-guard`` through the Prefect flow
  with its artifact and events; without PREFECT_API_URL that includes Prefect's temporary local
  server (reference only).

Targets: ``run_sweep`` and ``cli --plain`` overhead <= 3 s each (issue 16, input 8).

    python benchmarks/bench_cost_guard.py [--quick] [--repeats N]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from benchmarks.common import (  # noqa: E402
    ROOT,
    Target,
    alternate,
    check,
    compared,
    emit,
    env,
    log,
    options,
    summary,
)
from stoker.local_server import LocalServer  # noqa: E402

WINDOW_S, INTERVAL_S = 2.0, 1.0
GPUS, CONTAINERS, JOBS, RUNNING = 8, 4, 40, 2


def busybox_image(client) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(f"{tmp}/rootfs.tar", "w") as tar:
            tar.add("/bin/busybox", arcname="bin/busybox")
            for applet in ("sh", "sleep"):
                link = tarfile.TarInfo(f"bin/{applet}")
                link.type, link.linkname = tarfile.SYMTYPE, "busybox"
                tar.addfile(link)
        tag = uuid.uuid4().hex[:12]
        client.api.import_image_from_file(f"{tmp}/rootfs.tar", repository="stoker-bench-cg",
                                          tag=tag)
    return f"stoker-bench-cg:{tag}"


def make_jobs(work: Path) -> None:
    """40 job folders: 2 running (fresh heartbeat, MLflow run with metrics), 38 finished."""
    import mlflow

    from stoker.config import TrainConfig
    from stoker.runtime.spec import RunSpec

    uri = f"sqlite:///{work / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("bench", artifact_location=(work / "art").as_uri())
    for i in range(JOBS):
        job = work / "jobs" / f"job-{i:03d}"
        job.mkdir(parents=True)
        RunSpec(train=TrainConfig(), data_dir=str(work), job_dir=str(job),
                tracking_uri=uri).dump(job / "spec.yaml")
        running = i < RUNNING
        if running:
            run = client.create_run(experiment)
            client.log_metric(run.info.run_id, "loss", 1.0, step=1)
            (job / "mlflow_run_id").write_text(run.info.run_id)
        (job / "heartbeat.json").write_text(json.dumps(
            {"time": time.time() - (10 if running else 90_000), "step": 5, "pid": 1,
             "world_size": 1, "outcome": None if running else "completed"}))


def start_containers(client, image: str, label: str, work: Path) -> list:
    """4 owned containers; the first one's job has a stale heartbeat (it will be stopped)."""
    from stoker.ownership import DOCKER_JOB_LABEL, DOCKER_OWNER_LABEL

    made = []
    for i in range(CONTAINERS):
        job = f"{label}-{i}"
        made.append(client.containers.run(
            image, ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.1; done"],
            name=job, detach=True, network_mode="none",
            labels={DOCKER_OWNER_LABEL: "true", DOCKER_JOB_LABEL: job, "bench": label}))
        (work / "jobs" / job).mkdir(parents=True, exist_ok=True)
        (work / "jobs" / job / "heartbeat.json").write_text(json.dumps(
            {"time": time.time() - (7200 if i == 0 else 5), "step": 5, "pid": 1,
             "world_size": 1, "outcome": None}))
    for c in made:
        c.reload()
    return made


def fake_frames(containers: list) -> list:
    from fake_nvml import Gpu

    gpus = []
    for i in range(GPUS):
        if i < len(containers):
            pid = containers[i].attrs["State"]["Pid"]
            util = 0 if i == 0 else 90
            gpus.append(Gpu(index=i, utilization=util, memory_used_mib=300 if i == 0 else 40_000,
                            processes=[(pid, 300 if i == 0 else 40_000)]))
        else:
            gpus.append(Gpu(index=i))
    return [gpus]


def config_for(work: Path, label: str, module: str = "pynvml"):
    from stoker.costguard.config import CostGuardConfig

    return CostGuardConfig(
        work_dir=work, dry_run=False, nvml_module=module, prefect={"enabled": False},
        docker={"label_filters": [f"bench={label}"], "stop_timeout_s": 5},
        policy={"window_s": WINDOW_S, "sample_interval_s": INTERVAL_S, "min_samples": 2,
                "min_idle_s": 0, "warmup_grace_s": 0})


def sweep_in_process(client, image: str, root: Path, index: int) -> float:
    """Overhead (s) of one ``run_sweep`` on a fresh host stand-in."""
    from fake_nvml import FakeNvml

    from stoker.costguard.host import discover_all, standard_actors
    from stoker.costguard.nvml import NvmlReader
    from stoker.costguard.sweep import run_sweep

    work, label = root / f"sweep-{index}", f"bench-{uuid.uuid4().hex[:8]}"
    make_jobs(work)
    containers = start_containers(client, image, label, work)
    try:
        config = config_for(work, label)
        with NvmlReader(FakeNvml(fake_frames(containers))) as reader:
            started = time.perf_counter()
            report = run_sweep(config, reader, discover_all(config, client),
                               standard_actors(config, client))
            elapsed = time.perf_counter() - started
        stopped = [r for r in report.resources if r.action_status == "stopped"]
        assert len(stopped) == 1, [(r.key, r.decision.verdict, r.action) for r in
                                   report.resources]
        return elapsed - WINDOW_S
    finally:
        for c in containers:
            c.remove(force=True)


CLI_DRIVER = """
import sys
sys.path.insert(0, {tests!r})
from fake_nvml import FakeNvml, Gpu
import json
frames = [[Gpu(index=i, **g) for i, g in enumerate(json.loads({frames!r}))]]
for g in frames[0]:
    g.processes = [tuple(p) for p in g.processes]
sys.modules["bench_nvml"] = FakeNvml(frames)
from stoker.cli import app
app(sys.argv[1:])
"""


def cli_run(client, image: str, root: Path, index: int, *extra: str) -> float:
    """Overhead (s) of ``stoker cost-guard [extra]`` in a new process, start to exit."""
    work = root / f"cli{''.join(extra).replace('-', '_')}-{index}"
    label = f"bench-{uuid.uuid4().hex[:8]}"
    make_jobs(work)
    containers = start_containers(client, image, label, work)
    try:
        gpus = [{"utilization": g.utilization, "memory_used_mib": g.memory_used_mib,
                 "processes": [list(p) for p in g.processes]}
                for g in fake_frames(containers)[0]]
        driver = CLI_DRIVER.format(tests=str(ROOT / "tests"), frames=json.dumps(gpus))
        config = config_for(work, label, "bench_nvml")
        (work / "guard.yaml").write_text(config.model_dump_json())
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", driver, "cost-guard", *extra, "-c",
                               str(work / "guard.yaml")], env=env({"PREFECT_HOME": str(
                                   root / "prefect-home")}),
                              cwd=work, capture_output=True, text=True, timeout=600)
        elapsed = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"stoker cost-guard failed: {done.stderr[-3000:]}")
        return elapsed - WINDOW_S
    finally:
        for c in containers:
            c.remove(force=True)


def main() -> None:
    args = options(__doc__, 3)
    metric = "run_sweep overhead / stoker cost-guard --plain overhead (excluding the window)"
    target = "run_sweep and stoker cost-guard --plain overhead <= 3 s each"
    try:
        import docker

        client = docker.from_env()
        client.ping()
    except Exception as e:  # any failure to reach the engine: the benchmark cannot run here
        emit("cost_guard", metric=metric, target=target, status="skipped",
             reason=f"no Docker Engine: {e}", quick=args.quick)
        return
    image = busybox_image(client)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-cost-guard-"))
    flow: list[float] = []
    try:
        log(f"host stand-in: {GPUS} GPUs, {CONTAINERS} containers, {JOBS} job folders")
        pairs = alternate(lambda i: cli_run(client, image, root, i, "--plain"),
                          lambda i: sweep_in_process(client, image, root, i),
                          args.repeats, args.warmups)
        if not args.quick:  # Prefect's temporary server: tens of seconds, reference only
            flow = [cli_run(client, image, root, i) for i in range(args.repeats)]
    finally:
        client.images.remove(image, force=True)
        # The flow CLI started a local Prefect server in this home: it must not outlive us.
        LocalServer(root / "prefect-home").stop()
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    result = compared(pairs, lambda b, c: c / b, target,
                      "stoker cost-guard --plain overhead (new process, excl. window)",
                      "run_sweep overhead (in process, excl. window)", "s")
    details = {"flow": summary(flow, "s", "stoker cost-guard (flow) overhead")} if flow else {}
    emit("cost_guard", metric=metric, quick=args.quick, **result,
         checks=[check("run_sweep overhead", pairs.values("candidate"), "s", Target("<=", 3.0)),
                 check("stoker cost-guard --plain overhead", pairs.values("baseline"), "s",
                       Target("<=", 3.0))],
         notes=[f"window {WINDOW_S:g} s excluded from both; the CLI through the Prefect flow "
                "(its artifact and events) is in details, for reference (not in --quick)"],
         details=details)


if __name__ == "__main__":
    main()
