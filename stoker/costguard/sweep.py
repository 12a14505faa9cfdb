"""One cost-guard sweep: sample every GPU over the window, judge each resource, re-check right
before acting, act (or, in dry-run, only say what would be done) and report.

``run_sweep`` takes its NVML reader, resource discovery and actors as arguments, so tests pass
a fake NVML and real or recording actors; :mod:`stoker.costguard.host` builds the real ones
from a :class:`CostGuardConfig` (``discover_all``, ``standard_actors``, ``sweep_host``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from stoker.costguard.actions import Actor
from stoker.costguard.config import CostGuardConfig, Policy
from stoker.costguard.decide import (
    Decision,
    Evidence,
    Verdict,
    decide,
    evidence_for,
    gpu_problems,
    gpu_windows,
    starting_jobs,
)
from stoker.costguard.inventory import (
    Resource,
    pid_problem,
    process_name,
)
from stoker.costguard.nvml import GpuReading, NvmlReader, Snapshot
from stoker.jobs.stop_request import request_stop
from stoker.tracking.pricing import CapacityType, PriceTable

log = logging.getLogger(__name__)

Discover = Callable[[], tuple[list[Resource], list[str]]]
_VERB = {"container": "stop container", "job": "cancel flow run", "instance": "stop instance",
         "slurm": "stop Slurm job"}
_RELEASED = {"stopped", "cancelled"}


@dataclass(frozen=True)
class Row:
    """One line of the report: a GPU or a resource, its verdict and what was done.

    ``action_status``: none (nothing to do), waiting, dry_run, skipped (the re-check changed the
    verdict), or an :data:`ActionStatus`. ``idle_gpu_hours``: GPUs x hours idle or stalled as
    observed. ``usd_per_hour``: what stopping it frees, from the price table.
    """

    key: str
    kind: str
    id: str
    name: str
    gpus: tuple[str, ...]
    gpu_names: tuple[str, ...]
    decision: Decision
    action_status: str = "none"
    action: str = ""
    idle_gpu_hours: float = 0.0
    usd_per_hour: float = 0.0
    flow_run_id: str | None = None


@dataclass(frozen=True)
class SweepReport:
    """The result of one sweep. Times are Unix seconds."""

    started: float
    finished: float
    dry_run: bool
    window_s: float
    samples: int
    gpus: tuple[Row, ...]
    resources: tuple[Row, ...]
    notes: tuple[str, ...] = ()
    capacity_type: str = "on_demand"

    @property
    def idle_gpu_hours(self) -> float:
        """Idle, stalled or leaked GPU-hours over all GPUs (each GPU counted once)."""
        return sum(r.idle_gpu_hours for r in self.gpus)

    @property
    def usd_per_hour(self) -> float:
        """What the idle, stalled or leaking GPUs cost per hour."""
        return sum(r.usd_per_hour for r in self.gpus)


@dataclass
class _Judgement:
    resources: dict[str, Resource]
    rows: dict[str, Row]
    gpu_rows: list[Row] = field(default_factory=list)


def sample_window(reader: NvmlReader, policy: Policy,
                  sleep: Callable[[float], None] = time.sleep) -> list[Snapshot]:
    """``policy.samples_per_window`` snapshots, ``sample_interval_s`` apart; one when NVML
    cannot be read at all (``reader.unusable``: no driver, no library), which waiting for the
    window would not change."""
    snapshots = []
    for i in range(policy.samples_per_window):
        if i:
            sleep(policy.sample_interval_s)
        snapshots.append(reader.snapshot())
        if getattr(reader, "unusable", None):
            break
    return snapshots


def judge(snapshots: list[Snapshot], resources: list[Resource], policy: Policy, now: float,
          state: Mapping[str, dict], prices: PriceTable, capacity: CapacityType,
          released_pids: frozenset[int] = frozenset()) -> _Judgement:
    """Decide every resource and every GPU over ``snapshots`` (no actions).

    Args:
        snapshots: the window, oldest first; resources: what may be acted on.
        policy: thresholds; now: Unix time of the decision (s).
        state: idle streaks of earlier sweeps (see :func:`load_state`).
        prices, capacity: for the $ per hour of idle or stalled GPUs.
        released_pids: host PIDs of resources this sweep stopped: their processes are
            accounted for (left out of the readings), not unresolvable.

    Returns:
        Rows by resource key, one row per GPU, and the resources by key.
    """
    windows, nvml_problems = gpu_windows(snapshots)
    if released_pids:
        windows = {k: tuple(_without(r, released_pids) for r in rs) for k, rs in windows.items()}
    window_start = snapshots[0].time if snapshots else now
    owned_pids = {pid for r in resources for pid in r.pids}

    def why_unresolved(pid: int) -> str | None:
        return None if pid in owned_pids else pid_problem(pid)

    problems = {k: gpu_problems(rs, len(snapshots), why_unresolved) for k, rs in windows.items()}
    names = {k: rs[-1].name or k for k, rs in windows.items()}
    rows: dict[str, Row] = {}
    holders: dict[str, list[Resource]] = {}
    for resource in resources:
        keys, evidence = evidence_for(resource, windows, problems, nvml_problems, window_start,
                                      _idle_since(state, resource.key, resource.started_at))
        for key in keys:
            holders.setdefault(key, []).append(resource)
        row = _row(resource.key, resource.kind, resource.id, resource.name, keys, names,
                   _decide_safely(evidence, policy, now), now, prices, capacity)
        rows[resource.key] = replace(row, flow_run_id=resource.flow_run_id)
    _block_instances(rows, {r.key: r for r in resources})
    gpu_rows = []
    for key, readings in windows.items():
        held_by = holders.get(key, [])
        progress = [r.last_progress for r in held_by if r.last_progress]
        evidence = Evidence(gpus={key: readings}, window_start=window_start,
                            unknown=(*nvml_problems, *(f"{key}: {p}" for p in problems[key])),
                            last_progress=max(progress, default=None),
                            idle_since=_idle_since(state, f"gpu:{key}", None),
                            starting={n: t for r in held_by
                                      for n, t in starting_jobs(r.jobs).items()})
        row = _row(f"gpu:{key}", "gpu", key, names[key], [key], names,
                   _decide_safely(evidence, policy, now), now, prices, capacity)
        gpu_rows.append(_with_action(row, "none", _held_by(held_by, readings, owned_pids)))
    return _Judgement({r.key: r for r in resources}, rows, gpu_rows)


def _without(reading: GpuReading, pids: frozenset[int]) -> GpuReading:
    if not reading.processes:
        return reading
    return replace(reading, processes=tuple(p for p in reading.processes if p.pid not in pids))


def _decide_safely(evidence: Evidence, policy: Policy, now: float) -> Decision:
    """The decision, or unknown with the error: one odd reading never ends the whole sweep."""
    try:
        return decide(evidence, policy, now)
    except Exception as e:  # noqa: BLE001 - any failure has one outcome: this row is unknown
        log.exception("cost guard: deciding failed")
        return Decision(Verdict.UNKNOWN, (f"cannot judge: {type(e).__name__}: {e}",))


def _held_by(holders: list[Resource], readings: tuple[GpuReading, ...],
             owned_pids: set[int]) -> str:
    """Who holds a GPU: Stoker resources, and processes on it that are not Stoker's."""
    names = [f"{r.kind} {r.name}" for r in holders]
    foreign = sorted({p.pid for r in readings for p in r.processes or ()} - owned_pids)
    for pid in foreign:
        name = process_name(pid) if pid_problem(pid) is None else None
        names.append(f"process {pid} ({name})" if name else f"process {pid} (unresolved)")
    return "held by " + (", ".join(names) if names else "no process and no Stoker resource")


def _block_instances(rows: dict[str, Row], resources: Mapping[str, Resource]) -> None:
    """An instance is not stopped while a container or job on it is neither idle nor stalled
    (starting, warming up, busy, unknown, without a GPU): stopping the instance would end it."""
    others = [row for key, row in rows.items() if resources[key].kind != "instance"
              and row.decision.verdict not in (Verdict.IDLE, Verdict.STALLED)]
    if not others:
        return
    why = ", ".join(f"{r.kind} {r.name} is {r.decision.verdict}" for r in others)
    for key, row in rows.items():
        if resources[key].kind == "instance" and row.decision.act:
            decision = replace(row.decision, verdict=Verdict.BUSY, act=False,
                               reasons=(*row.decision.reasons, f"but {why} on it"))
            rows[key] = replace(row, decision=decision, idle_gpu_hours=0.0, usd_per_hour=0.0)


def _row(key: str, kind: str, id_: str, name: str, gpus: list[str], names: dict[str, str],
         decision: Decision, now: float, prices: PriceTable, capacity: CapacityType) -> Row:
    wasteful = decision.verdict in (Verdict.IDLE, Verdict.STALLED, Verdict.LEAK)
    hours = 0.0
    if wasteful and decision.waste_since is not None:
        hours = len(gpus) * max(0.0, now - decision.waste_since) / 3600
    usd = sum(prices.price(names[k], capacity) for k in gpus) if wasteful else 0.0
    return Row(key, kind, id_, name, tuple(gpus), tuple(names[k] for k in gpus), decision,
               idle_gpu_hours=hours, usd_per_hour=usd)


def _with_action(row: Row, status: str, detail: str) -> Row:
    return replace(row, action_status=status, action=detail)


def _idle_since(state: Mapping[str, dict], key: str, started_at: float | None) -> float | None:
    entry = state.get(key)
    if not entry or entry.get("started_at") != started_at:
        return None  # never seen idle, or restarted since: a new streak
    return entry.get("idle_since")


def load_state(path: Path) -> dict[str, dict]:
    """Idle streaks from earlier sweeps ({} when there is no readable state file)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as e:
        log.warning("cost guard state %s unreadable (%s): idle streaks start over", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def save_state(path: Path, judgement: _Judgement) -> None:
    """Remember when each idle resource and GPU was first seen idle (atomic write)."""
    state = {}
    for row in [*judgement.rows.values(), *judgement.gpu_rows]:
        if row.decision.verdict == Verdict.IDLE:
            resource = judgement.resources.get(row.key)
            state[row.key] = {"idle_since": row.decision.waste_since,
                              "started_at": resource.started_at if resource else None}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def run_sweep(config: CostGuardConfig, reader: NvmlReader, discover: Discover,
              actors: Mapping[str, Actor], clock: Callable[[], float] = time.time,
              sleep: Callable[[float], None] = time.sleep) -> SweepReport:
    """Sample, judge, re-check, act (unless dry-run) and report.

    Args:
        config: policy, dry-run switch, prices; ``config.state_file`` keeps idle streaks.
        reader: an entered :class:`NvmlReader`.
        discover: returns (resources, notes about what could not be listed).
        actors: by resource kind; a kind without an actor is only reported.
        clock: Unix time (s); sleep: waits between samples (s).

    Returns:
        The report; the state file is updated.
    """
    started = clock()
    snapshots = sample_window(reader, config.policy, sleep)
    resources, notes = discover()
    state = load_state(config.state_file)
    judgement = judge(snapshots, resources, config.policy, clock(), state, config.prices,
                      config.capacity_type)
    # Jobs and containers first: stopping the instance ends them anyway, but less gracefully.
    order = {"job": 0, "container": 1, "slurm": 1, "instance": 2}
    rows = []
    released: set[int] = set()  # PIDs of what this sweep stopped: gone on purpose
    for key in sorted(judgement.rows, key=lambda k: (order.get(judgement.rows[k].kind, 3), k)):
        row = judgement.rows[key]
        if row.decision.act:
            status, detail = _act(config, row, judgement.resources[key], snapshots, reader,
                                  discover, actors, state, clock, frozenset(released))
            if status in _RELEASED:
                released |= judgement.resources[key].pids
        elif row.decision.verdict == Verdict.IDLE and config.policy.stop_idle:
            status, detail = "waiting", (f"idle, not yet for min_idle_s "
                                         f"{config.policy.min_idle_s:g}")
        elif row.decision.verdict in (Verdict.IDLE, Verdict.STALLED):
            status, detail = "none", "report only (policy)"
        elif row.decision.verdict == Verdict.LEAK:
            status, detail = "none", "alert only"
        else:
            status, detail = "none", ""
        rows.append(_with_action(row, status, detail))
    save_state(config.state_file, judgement)
    return SweepReport(
        started=started, finished=clock(), dry_run=config.dry_run,
        window_s=config.policy.window_s, samples=len(snapshots),
        gpus=tuple(judgement.gpu_rows), resources=tuple(rows),
        notes=tuple(dict.fromkeys([*notes, *(s.error for s in snapshots if s.error)])),
        capacity_type=config.capacity_type)


def _act(config: CostGuardConfig, row: Row, resource: Resource, snapshots: list[Snapshot],
         reader: NvmlReader, discover: Discover, actors: Mapping[str, Actor],
         state: Mapping[str, dict], clock: Callable[[], float],
         released: frozenset[int]) -> tuple[str, str]:
    actor = actors.get(resource.kind)
    verb = _VERB.get(resource.kind, "stop")
    if actor is None:
        return "none", f"no {resource.kind} actor enabled"
    if config.dry_run:
        return "dry_run", f"dry run: would {verb}"
    # Re-check right before acting: a fresh sample, and everything re-read (containers, job
    # folders, heartbeats): a container or job that started since blocks its instance's stop.
    fresh = reader.snapshot()
    resources, _ = discover()
    again = judge([*snapshots, fresh], resources, config.policy, clock(), state, config.prices,
                  config.capacity_type, released)
    current = again.rows.get(resource.key)
    if current is None:
        return "gone", "gone before acting"
    if not current.decision.act:
        why = "; ".join(current.decision.reasons)
        return "skipped", f"re-check: now {current.decision.verdict} ({why})"
    # Before the signal: the job's retry policy must see a guard stop, not a preemption.
    for job in again.resources[resource.key].jobs:
        with contextlib.suppress(OSError):
            request_stop(job.job_dir, "cost-guard", f"{current.decision.verdict}: "
                         + "; ".join(current.decision.reasons),
                         verdict=str(current.decision.verdict))
    result = actor.act(again.resources[resource.key])
    log.info("%s %s: %s", resource.key, result.status, result.detail)
    return result.status, result.detail
