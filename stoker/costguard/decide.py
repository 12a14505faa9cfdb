"""The decision: samples + heartbeats + policy -> a verdict per resource, with its reasons.

Pure functions, no I/O. The rules, in order:

1. **unknown** - NVML failed, a query was unsupported (MIG utilization), a GPU is missing from a
   sample, a process PID cannot be resolved, or too few samples. Unknown is never idle.
2. **no_gpu** - the resource was given no GPU and none of its processes runs on one.
3. **warming_up** - younger than ``warmup_grace_s``.
4. **idle** - in every sample of the window, every GPU at or below both the utilization and the
   memory threshold, and no heartbeat fresher than ``idle_timeout_s``.
5. **stalled** - holds memory on a GPU in every sample, utilization at or below
   ``stall_utilization_percent`` throughout, and a heartbeat older than ``stall_timeout_s``.
6. **busy** - anything else (with the reason: utilization, memory, a fresh heartbeat).
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


@dataclass(frozen=True)
class Evidence:
    """Everything the decision reads about one resource. Times are Unix seconds.

    ``gpus``: each GPU's readings over the window, oldest first. ``unknown``: reasons its state
    cannot be known that were found while collecting (NVML, PID mapping, unreadable files).
    ``idle_since``: when earlier sweeps first saw it idle (None: they did not).
    """

    gpus: dict[str, tuple[GpuReading, ...]]
    window_start: float
    unknown: tuple[str, ...] = ()
    last_progress: float | None = None
    started_at: float | None = None
    idle_since: float | None = None


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
                 known_pid: Callable[[int], bool]) -> list[str]:
    """Why one GPU's state over the window is unknown ([] when it is known).

    Args:
        readings: the GPU's readings; samples: how many snapshots the window has.
        known_pid: whether a PID resolves to a process on this host.
    """
    problems = []
    if len(readings) < samples:
        problems.append(f"missing from {samples - len(readings)} of {samples} samples")
    for error in dict.fromkeys(r.error for r in readings if r.error):
        problems.append(error)
    if any(r.processes is None for r in readings) and not any(r.error for r in readings):
        problems.append("process list unavailable")
    unresolved = sorted({p.pid for r in readings for p in r.processes or ()
                         if not known_pid(p.pid)})
    if unresolved:
        problems.append(f"PIDs {unresolved} cannot be resolved on this host")
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
    """Collect a resource's GPUs and evidence. Returns (its GPU keys, evidence)."""
    keys, unknown = resource_gpus(resource, windows, problems)
    job_errors = [f"job {job.name}: {e}" for job in resource.jobs for e in job.errors]
    unknown = [*nvml_problems, *resource.errors, *job_errors, *unknown]
    unknown += [f"{k}: {reason}" for k in keys for reason in problems.get(k, [])]
    return keys, Evidence(
        gpus={k: windows[k] for k in keys}, window_start=window_start, unknown=tuple(unknown),
        last_progress=resource.last_progress, started_at=resource.started_at,
        idle_since=idle_since)


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
        return Decision(Verdict.NO_GPU, ("no GPU given and none of its processes on a GPU",),
                        signals=signals)
    age_s = signals["age_s"]
    if age_s is not None and age_s < policy.warmup_grace_s:
        return Decision(Verdict.WARMING_UP, (
            f"started {age_s:.0f} s ago (< warmup_grace_s {policy.warmup_grace_s:.0f})",),
            signals=signals)
    progress_age = signals["heartbeat_age_s"]
    max_util, max_mib = signals["max_utilization_percent"], signals["max_memory_mib"]
    if max_util <= policy.idle_utilization_percent and max_mib <= policy.idle_memory_mib:
        return _idle(evidence, policy, now, signals, progress_age)
    held = [k for k, rs in evidence.gpus.items()
            if all(r.memory_used_mib > policy.idle_memory_mib for r in rs)]
    if held and max_util <= policy.stall_utilization_percent:
        return _held_without_compute(policy, signals, progress_age, held, evidence)
    reasons = []
    if max_util > policy.idle_utilization_percent:
        reasons.append(f"utilization up to {max_util:.0f}% "
                       f"(> {policy.idle_utilization_percent:g}%)")
    if max_mib > policy.idle_memory_mib:
        reasons.append(f"memory up to {max_mib:.0f} MiB (> {policy.idle_memory_mib:g} MiB)")
    return Decision(Verdict.BUSY, tuple(reasons), signals=signals)


def _idle(evidence: Evidence, policy: Policy, now: float, signals: dict,
          progress_age: float | None) -> Decision:
    window = (f"utilization <= {policy.idle_utilization_percent:g}% and memory <= "
              f"{policy.idle_memory_mib:g} MiB in all {signals['samples']} samples")
    if progress_age is not None and progress_age < policy.idle_timeout_s:
        return Decision(Verdict.BUSY, (
            window, f"but heartbeat {progress_age:.0f} s old (< idle_timeout_s "
            f"{policy.idle_timeout_s:.0f})"), signals=signals)
    since = min(evidence.idle_since or evidence.window_start, evidence.window_start)
    idle_for = now - since
    act = policy.stop_idle and idle_for >= policy.min_idle_s
    beat = ("no heartbeat" if progress_age is None else
            f"heartbeat {progress_age:.0f} s old (>= idle_timeout_s {policy.idle_timeout_s:.0f})")
    reasons = [window, beat, f"idle for {idle_for:.0f} s observed"]
    if policy.stop_idle and not act:
        reasons.append(f"waiting for min_idle_s {policy.min_idle_s:.0f} before stopping")
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
                                       f"stall_timeout_s {policy.stall_timeout_s:.0f})"),
                        signals=signals)
    return Decision(Verdict.STALLED, (holding, f"heartbeat has not advanced for "
                                      f"{progress_age:.0f} s (>= stall_timeout_s "
                                      f"{policy.stall_timeout_s:.0f})"),
                    act=policy.stop_stalled, waste_since=evidence.last_progress, signals=signals)


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
