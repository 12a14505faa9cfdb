"""The decision: samples + heartbeats + policy -> a verdict per resource, with its reasons.

Pure functions, no I/O. The rules, in order:

1. **unknown** - NVML failed, a query was unsupported (MIG utilization), a GPU is missing from a
   sample, a process PID cannot be resolved (out of range, <= 0, absent, another namespace), or
   too few samples. Unknown is never idle.
2. **no_gpu** - the resource was given no GPU and none of its processes runs on one; or NVML
   cannot be read at all but the resource cannot be using a GPU anyway (a local job on a host
   without a GPU device file, i.e. without a driver). Never acted on.
3. **warming_up** - younger than ``warmup_grace_s``.
4. **leak** - a GPU holds memory above ``idle_memory_mib`` at or below
   ``idle_utilization_percent`` with no compute process on it in every sample (memory held, no
   live owner), and its other GPUs are quiet. Alert only: never acted on.
5. **busy (starting)** - a job folder of the resource has a spec newer than its heartbeat (or no
   heartbeat yet), written less than ``idle_timeout_s`` ago.
6. **idle** - in every sample of the window, every GPU at or below both the utilization and the
   memory threshold, and no heartbeat fresher than ``idle_timeout_s``; when a live compute
   process is on one of its GPUs, only with positive evidence that its job stalled: a heartbeat
   older than ``idle_timeout_s`` (no heartbeat at all: busy).
7. **stalled** - holds memory on a GPU in every sample, utilization at or below
   ``stall_utilization_percent`` throughout, and a heartbeat older than ``stall_timeout_s``;
   or **hung**: memory held and utilization above it in every sample (a collective that never
   returns spins the GPU) with a heartbeat older than ``stall_timeout_s``.
8. **busy** - anything else (with the reason: utilization, memory, a fresh heartbeat).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from stoker.costguard.config import Policy
from stoker.costguard.inventory import Resource
from stoker.costguard.nvml import MIB, GpuReading, Snapshot


class Verdict(StrEnum):
    BUSY = "busy"
    IDLE = "idle"
    STALLED = "stalled"
    UNKNOWN = "unknown"
    WARMING_UP = "warming_up"
    NO_GPU = "no_gpu"
    LEAK = "leak"


@dataclass(frozen=True)
class Evidence:
    """Everything the decision reads about one resource. Times are Unix seconds.

    ``gpus``: each GPU's readings over the window, oldest first. ``unknown``: reasons its state
    cannot be known that were found while collecting (NVML, PID mapping, unreadable files).
    ``idle_since``: when earlier sweeps first saw it idle (None: they did not).
    ``starting``: job name -> when its spec was written, for job folders without a heartbeat.
    ``no_gpu_reason``: why it uses no GPU although NVML could not be read (None: NVML said).
    """

    gpus: dict[str, tuple[GpuReading, ...]]
    window_start: float
    unknown: tuple[str, ...] = ()
    last_progress: float | None = None
    started_at: float | None = None
    idle_since: float | None = None
    starting: dict[str, float] = field(default_factory=dict)
    no_gpu_reason: str | None = None


@dataclass(frozen=True)
class Decision:
    """A verdict with its reasons. ``act``: the policy says stop it now. ``waste_since``: since
    when its GPUs are idle (idle: first observed) or held without progress (stalled)."""

    verdict: Verdict
    reasons: tuple[str, ...]
    act: bool = False
    waste_since: float | None = None
    signals: dict[str, float | int | None] = field(default_factory=dict)


# --- Collecting: snapshots and PIDs -> per-GPU windows and per-resource evidence ----------------

def gpu_windows(snapshots: Sequence[Snapshot]) -> tuple[dict[str, tuple[GpuReading, ...]],
                                                        list[str]]:
    """Group readings by GPU over the window.

    Returns:
        (GPU key -> readings oldest first, reasons that make every GPU unknown: snapshots where
        NVML failed as a whole).
    """
    windows: dict[str, list[GpuReading]] = {}
    problems = [s.error for s in snapshots if s.error]
    for snapshot in snapshots:
        for reading in snapshot.gpus:
            windows.setdefault(reading.key, []).append(reading)
    return {k: tuple(v) for k, v in windows.items()}, list(dict.fromkeys(problems))


def gpu_problems(readings: Sequence[GpuReading], samples: int,
                 pid_problem: Callable[[int], str | None]) -> list[str]:
    """Why one GPU's state over the window is unknown ([] when it is known).

    Args:
        readings: the GPU's readings; samples: how many snapshots the window has.
        pid_problem: why a PID does not resolve to a process on this host (None: it does).
    """
    problems = []
    if len(readings) < samples:
        problems.append(f"missing from {samples - len(readings)} of {samples} samples")
    for error in dict.fromkeys(r.error for r in readings if r.error):
        problems.append(error)
    if any(r.processes is None for r in readings) and not any(r.error for r in readings):
        problems.append("process list unavailable")
    why = {pid: pid_problem(pid) for pid in sorted({p.pid for r in readings
                                                   for p in r.processes or ()})}
    unresolved = {pid: reason for pid, reason in why.items() if reason}
    if unresolved:
        problems.append(f"PIDs {sorted(unresolved)} cannot be resolved on this host: "
                        + "; ".join(unresolved.values()))
    return problems


def resource_gpus(resource: Resource, windows: dict[str, tuple[GpuReading, ...]],
                  problems: dict[str, list[str]]) -> tuple[list[str], list[str]]:
    """The GPUs a resource holds, and reasons they cannot be told.

    GPUs come from its ``devices`` tokens and from the GPUs its PIDs run on. A resource judged by
    its processes alone cannot be told while any GPU's process list is unknown.
    """
    latest = {key: readings[-1] for key, readings in windows.items()}
    keys: list[str] = []
    unknown: list[str] = []
    for token in resource.devices or ():
        matched = [k for k, r in latest.items() if token == "all" or _matches(token, r)]
        if not matched:
            unknown.append(f"device {token!r} is not among the GPUs NVML lists")
        keys.extend(matched)
    for key, readings in windows.items():
        if any(p.pid in resource.pids for r in readings for p in r.processes or ()):
            keys.append(key)
    keys = list(dict.fromkeys(keys))
    if resource.devices is None:
        blind = [k for k, reasons in problems.items() if reasons and k not in keys]
        if blind:
            unknown.append(f"cannot tell which GPUs its processes use: {', '.join(blind)} unknown")
    return keys, unknown


def _matches(token: str, reading: GpuReading) -> bool:
    if token.isdigit():
        return reading.index == int(token)
    return token in (reading.uuid, reading.parent_uuid)


def evidence_for(resource: Resource, windows: dict[str, tuple[GpuReading, ...]],
                 problems: dict[str, list[str]], nvml_problems: list[str], window_start: float,
                 idle_since: float | None) -> tuple[list[str], Evidence]:
    """Collect a resource's GPUs and evidence. Returns (its GPU keys, evidence).

    NVML failing as a whole makes a resource unknown, except one that cannot be using a GPU
    (``Resource.no_gpu_reason``, judged by its processes, none found on a GPU): a failure to
    read GPUs hides none from it. Its evidence names both."""
    keys, unknown = resource_gpus(resource, windows, problems)
    job_errors = [f"job {job.name}: {e}" for job in resource.jobs for e in job.errors]
    no_gpu = None
    if nvml_problems and resource.no_gpu_reason and resource.devices is None and not keys:
        no_gpu = f"{resource.no_gpu_reason} (NVML: {'; '.join(nvml_problems)})"
        nvml_problems = []
    unknown = [*nvml_problems, *resource.errors, *job_errors, *unknown]
    unknown += [f"{k}: {reason}" for k in keys for reason in problems.get(k, [])]
    return keys, Evidence(
        gpus={k: windows[k] for k in keys}, window_start=window_start, unknown=tuple(unknown),
        last_progress=resource.last_progress, started_at=resource.started_at,
        idle_since=idle_since, starting=starting_jobs(resource.jobs), no_gpu_reason=no_gpu)


def starting_jobs(jobs: Sequence) -> dict[str, float]:
    """Job name -> when its spec was written, for jobs starting (a spec newer than their
    heartbeat, or no heartbeat yet)."""
    return {job.name: job.spec_written_at for job in jobs if job.starting}


# --- Deciding ----------------------------------------------------------------------------------

def decide(evidence: Evidence, policy: Policy, now: float) -> Decision:
    """The verdict for one resource (rules in the module docstring).

    Args:
        evidence: its GPU readings over the window and its progress signals.
        policy: thresholds and timeouts.
        now: Unix time of the decision (s).
    """
    readings = [r for rs in evidence.gpus.values() for r in rs]
    unknown = list(evidence.unknown)
    unknown += [f"{k}: only {len(rs)} samples (< min_samples {policy.min_samples})"
                for k, rs in evidence.gpus.items() if len(rs) < policy.min_samples]
    unknown += list(dict.fromkeys(f"{r.key}: {r.error or 'incomplete reading'}" for r in readings
                                  if r.error or r.utilization_percent is None
                                  or r.memory_used_bytes is None))
    signals = _signals(evidence, readings, now)
    if unknown:
        return Decision(Verdict.UNKNOWN, tuple(dict.fromkeys(unknown)), signals=signals)
    if not evidence.gpus:
        return Decision(Verdict.NO_GPU, (evidence.no_gpu_reason
                                         or "no GPU given and none of its processes on a GPU",),
                        signals=signals)
    age_s = signals["age_s"]
    if age_s is not None and age_s < policy.warmup_grace_s:
        return Decision(Verdict.WARMING_UP, (
            f"started {age_s:.0f} s ago (< warmup_grace_s {policy.warmup_grace_s:g})",),
            signals=signals)
    leak = _leak(evidence, policy, signals)
    if leak is not None:
        return leak
    starting = {name: now - at for name, at in evidence.starting.items()
                if now - at < policy.idle_timeout_s}
    if starting:
        return Decision(Verdict.BUSY, tuple(
            f"job {name} starting: spec written {age:.0f} s ago, no heartbeat since"
            for name, age in starting.items()), signals=signals)
    progress_age = signals["heartbeat_age_s"]
    max_util, max_mib = signals["max_utilization_percent"], signals["max_memory_mib"]
    if max_util <= policy.idle_utilization_percent and max_mib <= policy.idle_memory_mib:
        return _idle(evidence, policy, now, signals, progress_age)
    held = [k for k, rs in evidence.gpus.items()
            if all(r.memory_used_mib > policy.idle_memory_mib for r in rs)]
    if held and max_util <= policy.stall_utilization_percent:
        return _held_without_compute(policy, signals, progress_age, held, evidence)
    if (held and progress_age is not None and progress_age >= policy.stall_timeout_s
            and all(r.utilization_percent > policy.stall_utilization_percent for r in readings)):
        return _hung(policy, signals, progress_age, held, evidence)
    reasons = []
    if max_util > policy.idle_utilization_percent:
        reasons.append(f"utilization up to {max_util:.0f}% "
                       f"(> {policy.idle_utilization_percent:g}%)")
    if max_mib > policy.idle_memory_mib:
        reasons.append(f"memory up to {max_mib:.0f} MiB (> {policy.idle_memory_mib:g} MiB)")
    return Decision(Verdict.BUSY, tuple(reasons), signals=signals)


def live_processes(evidence: Evidence) -> dict[str, list[int]]:
    """GPU key -> PIDs of the compute processes NVML listed on it during the window."""
    found = {k: sorted({p.pid for r in rs for p in r.processes or ()})
             for k, rs in evidence.gpus.items()}
    return {k: pids for k, pids in found.items() if pids}


def _leak(evidence: Evidence, policy: Policy, signals: dict) -> Decision | None:
    """Memory held with no process on the GPU in any sample while its other GPUs are quiet."""
    def quiet(r: GpuReading) -> bool:
        return r.utilization_percent <= policy.idle_utilization_percent

    leaked = [k for k, rs in evidence.gpus.items()
              if all(quiet(r) and r.memory_used_mib > policy.idle_memory_mib
                     and not r.processes for r in rs)]
    others = [r for k, rs in evidence.gpus.items() if k not in leaked for r in rs]
    if not leaked or not all(quiet(r) and r.memory_used_mib <= policy.idle_memory_mib
                             for r in others):
        return None
    held = ", ".join(f"{k} {max(r.memory_used_mib for r in evidence.gpus[k]):.0f} MiB"
                     for k in leaked)
    return Decision(Verdict.LEAK, (
        f"memory held with no live owner: {held} at <= {policy.idle_utilization_percent:g}% "
        f"utilization and no compute process in all {signals['samples']} samples",
        "alert only: memory without an owner is never stopped automatically"),
        waste_since=evidence.window_start, signals=signals)


def _idle(evidence: Evidence, policy: Policy, now: float, signals: dict,
          progress_age: float | None) -> Decision:
    window = (f"utilization <= {policy.idle_utilization_percent:g}% and memory <= "
              f"{policy.idle_memory_mib:g} MiB in all {signals['samples']} samples")
    if progress_age is not None and progress_age < policy.idle_timeout_s:
        return Decision(Verdict.BUSY, (
            window, f"but heartbeat {progress_age:.0f} s old (< idle_timeout_s "
            f"{policy.idle_timeout_s:g})"), signals=signals)
    live = live_processes(evidence)
    on_gpu = "; ".join(f"PIDs {pids} on {k}" for k, pids in live.items())
    if live and progress_age is None:
        # Bursty work can read 0% in every sample: a live process counts until a stale
        # heartbeat shows its job stalled.
        return Decision(Verdict.BUSY, (
            window, f"but compute processes are live ({on_gpu}) and no heartbeat shows their "
            f"job stalled"), signals=signals)
    since = min(evidence.idle_since or evidence.window_start, evidence.window_start)
    idle_for = now - since
    act = policy.stop_idle and idle_for >= policy.min_idle_s
    beat = ("no heartbeat" if progress_age is None else
            f"heartbeat {progress_age:.0f} s old (>= idle_timeout_s {policy.idle_timeout_s:g})")
    reasons = [window, beat, f"idle for {idle_for:.0f} s observed"]
    if live:
        reasons.insert(1, f"compute processes still listed ({on_gpu})")
    if policy.stop_idle and not act:
        reasons.append(f"waiting for min_idle_s {policy.min_idle_s:g} before stopping")
    return Decision(Verdict.IDLE, tuple(reasons), act=act, waste_since=since,
                    signals=signals | {"idle_for_s": idle_for})


def _held_without_compute(policy: Policy, signals: dict, progress_age: float | None,
                          held: list[str], evidence: Evidence) -> Decision:
    holding = (f"holds memory on {', '.join(held)} at <= "
               f"{policy.stall_utilization_percent:g}% utilization in all samples")
    if progress_age is None:
        return Decision(Verdict.BUSY, (holding, "no heartbeat to judge progress by"),
                        signals=signals)
    if progress_age < policy.stall_timeout_s:
        return Decision(Verdict.BUSY, (holding, f"heartbeat {progress_age:.0f} s old (< "
                                       f"stall_timeout_s {policy.stall_timeout_s:g})"),
                        signals=signals)
    return Decision(Verdict.STALLED, (holding, f"heartbeat has not advanced for "
                                      f"{progress_age:.0f} s (>= stall_timeout_s "
                                      f"{policy.stall_timeout_s:g})"),
                    act=policy.stop_stalled, waste_since=evidence.last_progress, signals=signals)


def _hung(policy: Policy, signals: dict, progress_age: float, held: list[str],
          evidence: Evidence) -> Decision:
    """Memory held and the GPUs busy, but no progress for ``stall_timeout_s``: a hung
    collective spins the GPU at full utilization, so utilization is no sign of work."""
    return Decision(Verdict.STALLED, (
        f"holds memory on {', '.join(held)} at up to "
        f"{signals['max_utilization_percent']:.0f}% utilization",
        f"heartbeat has not advanced for {progress_age:.0f} s (>= stall_timeout_s "
        f"{policy.stall_timeout_s:g}): hung (a collective that never returns keeps the GPU "
        "busy)"), act=policy.stop_stalled, waste_since=evidence.last_progress, signals=signals)


def _signals(evidence: Evidence, readings: list[GpuReading], now: float) -> dict:
    utils = [r.utilization_percent for r in readings if r.utilization_percent is not None]
    mems = [r.memory_used_bytes for r in readings if r.memory_used_bytes is not None]
    samples = min((len(rs) for rs in evidence.gpus.values()), default=0)
    return {
        "gpus": len(evidence.gpus), "samples": samples,
        "max_utilization_percent": max(utils, default=0.0),
        "max_memory_mib": max(mems, default=0) / MIB,
        "heartbeat_age_s": None if evidence.last_progress is None
        else max(0.0, now - evidence.last_progress),
        "age_s": None if evidence.started_at is None else now - evidence.started_at,
    }
