"""Shared pieces of the benchmarks: options, pairs of runs with their CPU time, the result line.

Every benchmark measures a baseline and Stoker (the candidate) in the same run, in pairs whose
order alternates (A B, B A, ...), after an untimed warm-up pair. Each run's figure comes with
its wall time and the CPU time (user + system) of this process and of every child process it
waited for. The result is one JSON line (the last line of output) whose ratio is the median of
the per-pair ratios, with min-max, a bootstrap interval and a verdict from the interval
(``benchmarks.stats``). A missed target is data, not an error: the scripts exit 0 unless the
measurement itself failed. Every result records the commit it ran at and whether the checkout
had uncommitted changes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.stats import (
    MET,
    MISSED,
    UNDECIDED,
    Target,
    check,
    median_interval,
    overall,
    per_pair,
    ratio_summary,
    summary,
)

__all__ = ["Target", "check", "summary"]  # re-exported for the scripts

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

TELEMETRY_OFF = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                 "DVC_NO_ANALYTICS": "1", "DO_NOT_TRACK": "1"}
os.environ.update(TELEMETRY_OFF)
DATA_DIR_ENV = "STOKER_BENCH_DATA_DIR"


class Sized(NamedTuple):
    """An option whose default depends on ``--quick``: ``full`` normally, ``quick`` with it."""

    flag: str
    type: type
    full: Any
    quick: Any
    help: str


def options(doc: str, repeats: int, *sized: Sized,
            extra: Callable[[argparse.ArgumentParser], None] | None = None,
            argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the options every benchmark takes, plus its ``sized`` and ``extra`` ones.

    Args:
        doc: the script's docstring (its first line is the description).
        repeats: default number of timed pairs at full size (1 with ``--quick``).
        sized: options with a full and a quick default, resolved after parsing.
        extra: adds the script's other options to the parser.

    Returns:
        The namespace, with ``repeats`` and ``warmups`` resolved to numbers and every sized
        option to its value. Exits 2 (argparse) on a bad value.
    """
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny size, one pair, no warm-up (a smoke run: the figures mean little)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed pairs, order alternated (default {repeats}; 1 with --quick)")
    p.add_argument("--warmups", type=int, default=None,
                   help="untimed pairs first (default 1; 0 with --quick)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep all state under this folder (default: a temporary folder, removed)")
    p.add_argument("--data-dir", type=Path, default=os.environ.get(DATA_DIR_ENV) or None,
                   help="folder for the demo data repository and its pulled copy, kept and "
                        f"shared between benchmarks (default: ${DATA_DIR_ENV}, else inside the "
                        "work folder)")
    for s in sized:
        p.add_argument(s.flag, type=s.type, default=None,
                       help=f"{s.help} (default {s.full}; {s.quick} with --quick)")
    if extra:
        extra(p)
    args = p.parse_args(argv)
    for name, value, least in (("repeats", args.repeats, 1), ("warmups", args.warmups, 0)):
        if value is not None and value < least:
            p.error(f"--{name} must be >= {least}, got {value}")
    args.repeats = args.repeats or (1 if args.quick else repeats)
    args.warmups = args.warmups if args.warmups is not None else (0 if args.quick else 1)
    for s in sized:
        dest = s.flag.lstrip("-").replace("-", "_")
        if getattr(args, dest) is None:
            setattr(args, dest, s.quick if args.quick else s.full)
    return args


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for child processes: telemetry off, this checkout first on the path."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **TELEMETRY_OFF, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
            **(extra or {})}


def cpu_s() -> float:
    """CPU seconds (user + system) of this process and of its waited-for children, so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass(frozen=True)
class Run:
    """One run of one side: its figure, wall seconds and CPU seconds of the process tree."""

    value: float
    wall_s: float
    cpu_s: float


def measure(fn: Callable[[int], float], i: int) -> Run:
    """``fn(i)``'s figure with the wall and CPU time the call took (children included)."""
    cpu, started = cpu_s(), time.perf_counter()
    value = fn(i)
    return Run(float(value), time.perf_counter() - started, cpu_s() - cpu)


@dataclass(frozen=True)
class Pairs:
    """Baseline run i and candidate run i, for every timed pair i."""

    baseline: tuple[Run, ...]
    candidate: tuple[Run, ...]
    extra: dict[str, tuple[Run, ...]] = field(default_factory=dict)  # further arms, by name

    def values(self, side: str, field: str = "value") -> list[float]:
        """One side's figures (or ``field`` of its runs), pair by pair: ``baseline``,
        ``candidate`` or the name of an extra arm."""
        runs = self.extra[side] if side in self.extra else getattr(self, side)
        return [getattr(r, field) for r in runs]


def alternate(baseline: Callable[[int], float], candidate: Callable[[int], float],
              repeats: int, warmups: int = 0,
              extra: dict[str, Callable[[int], float]] | None = None,
              decided: Callable[[Pairs], bool] | None = None,
              max_repeats: int | None = None) -> Pairs:
    """Run ``baseline(i)`` and ``candidate(i)`` as ``repeats`` pairs, after ``warmups`` pairs.

    The order flips every pair (A B, B A, A B, ...) so that a drift in the machine's load does
    not always favour the same side. Warm-up pairs get negative indices (-1, -2, ...) and are
    not returned: they pay first-use costs (imports, caches, database creation).

    ``extra`` arms (name -> function) run inside every pair too, after the candidate (A B X,
    X B A, ...): a variant of the candidate that attributes part of its cost, compared pair by
    pair like the two sides. Their runs are in ``Pairs.extra[name]``.

    ``decided`` (e.g. ``until_decided(ratio_of, target)``): after ``repeats`` pairs, more pairs
    run while it says the figure's verdict is still undecided, up to ``max_repeats`` pairs
    (default 3 x ``repeats``): a verdict follows from the interval, and a straddling interval
    needs more pairs, not a rounder reading.
    """
    arms = [("baseline", baseline), ("candidate", candidate), *(extra or {}).items()]
    for w in range(warmups):
        log(f"warm-up pair {w + 1}/{warmups} (not counted)")
        for _, fn in arms:
            fn(-1 - w)
    runs: dict[str, list[Run]] = {name: [] for name, _ in arms}
    # A --quick run (one pair) has no interval to decide: it stays one pair.
    limit = repeats if decided is None or repeats < 2 else max(repeats, max_repeats or 3 * repeats)
    i = 0
    while i < repeats or (i < limit and not decided(_pairs(runs))):
        for name, fn in arms if i % 2 == 0 else arms[::-1]:
            runs[name].append(measure(fn, i))
        shown = ", ".join(f"{name} {runs[name][-1].value:.4g}" for name, _ in arms)
        i += 1
        log(f"pair {i}/{repeats if i <= repeats else limit}: {shown}"
            + ("" if i <= repeats else " (undecided after the planned pairs: one more)"))
    return _pairs(runs)


def _pairs(runs: dict[str, list[Run]]) -> Pairs:
    return Pairs(tuple(runs["baseline"]), tuple(runs["candidate"]),
                 {name: tuple(r) for name, r in runs.items()
                  if name not in ("baseline", "candidate")})


def until_decided(ratio_of: Callable[[float, float], float],
                  target: Target) -> Callable[[Pairs], bool]:
    """For ``alternate(decided=...)``: whether the per-pair ratios' interval decides ``target``
    (met or missed, not undecided)."""
    def decided(pairs: Pairs) -> bool:
        if len(pairs.baseline) < 2:
            return False
        ratios = per_pair(pairs.values("baseline"), pairs.values("candidate"), ratio_of)
        return target.verdict(median_interval(ratios)) != UNDECIDED
    return decided


def side(pairs: Pairs, which: str, name: str, unit: str) -> dict[str, Any]:
    """One side's figure (``summary``) with its wall and CPU seconds per run beside it."""
    return summary(pairs.values(which), unit, name) | {
        "wall_s": summary(pairs.values(which, "wall_s"), "s"),
        "cpu_s": summary(pairs.values(which, "cpu_s"), "s")}


def compared(pairs: Pairs, ratio_of: Callable[[float, float], float], target: Target | str,
             baseline: str, candidate: str, unit: str) -> dict[str, Any]:
    """The keyword arguments of ``emit`` for a pair-wise comparison: both sides, the per-pair
    ratio ``ratio_of(baseline, candidate)`` and the per-pair CPU ratio (candidate CPU /
    baseline CPU, whole runs)."""
    return {"baseline": side(pairs, "baseline", baseline, unit),
            "candidate": side(pairs, "candidate", candidate, unit),
            "ratio": ratio_summary(pairs.values("baseline"), pairs.values("candidate"),
                                   ratio_of, target),
            "cpu_ratio": ratio_summary(pairs.values("baseline", "cpu_s"),
                                       pairs.values("candidate", "cpu_s"), lambda b, c: c / b),
            "target": target}


# The published results themselves: rewriting them (``run_all.py --merge``, one part after
# another) changes no code that is measured.
RESULT_FILES = ("benchmarks/RESULTS.md", "benchmarks/RESULTS.json", "benchmarks/GPU_CHECK.json")


def checkout() -> dict[str, Any]:
    """The commit the benchmark runs at (``git rev-parse HEAD``) and whether the checkout has
    uncommitted changes (``git status --porcelain``, the results files ``RESULT_FILES`` left
    out; the first 20 lines kept)."""
    def git(*args: str) -> str:
        proc = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=False)
        return proc.stdout.rstrip() if proc.returncode == 0 else ""

    changes = [line for line in git("status", "--porcelain").splitlines()
               if line[3:] not in RESULT_FILES]
    return {"commit": git("rev-parse", "HEAD").strip() or None, "dirty": bool(changes),
            "changes": changes[:20]}


def emit(benchmark: str, *, metric: str, baseline: dict | None = None,
         candidate: dict | None = None, ratio: dict | None = None,
         target: Target | str | None = None, cpu_ratio: dict | None = None,
         checks: list[dict] | None = None, notes: list[str] | None = None,
         details: dict | None = None, quick: bool = False, status: str = "ok",
         reason: str | None = None) -> dict[str, Any]:
    """Print the human summary and then the result as one JSON line (the last line of output).

    ``ratio`` is a ``ratio_summary`` (per-pair ratios); ``target`` the ratio's Target, or a text
    naming the absolute targets of ``checks`` when the ratio is informative only. ``verdict``
    combines the ratio's (with a Target) and every check's: missed if any missed, undecided if
    any is undecided, else met; None when skipped or nothing has a target. ``target_met`` is
    True for met, False for missed, None otherwise. The JSON keys end with ``ratio`` (the
    per-pair median), ``target``, ``verdict`` and ``target_met``.
    """
    checks = checks or []
    verdict = None
    if status == "ok":
        verdict = overall([c["verdict"] for c in checks]
                          + ([ratio["verdict"]] if ratio and "verdict" in ratio else []))
    result: dict[str, Any] = {"benchmark": benchmark, "status": status, "quick": quick,
                              "metric": metric, "checkout": checkout()}
    if reason:
        result["reason"] = reason
    result |= {"baseline": baseline, "candidate": candidate, "pairs": ratio,
               "cpu_ratio": cpu_ratio, "checks": checks, "notes": notes or [],
               "details": details or {}, "ratio": ratio["median"] if ratio else None,
               "target": None if target is None else str(target), "verdict": verdict,
               "target_met": {MET: True, MISSED: False}.get(verdict)}
    _print_summary(result)
    print(json.dumps(result), flush=True)
    return result


def describe(s: dict) -> str:
    """``median [min–max], 95 % CI low–high (n=N)`` of a ``summary``."""
    ci = s.get("ci")
    interval = f", {s['confidence']:.0%} CI {ci[0]:.4g}–{ci[1]:.4g}" if ci else ", no CI"
    return f"{s['median']:.4g} [{s['min']:.4g}–{s['max']:.4g}]{interval} (n={s['n']})"


def _print_summary(result: dict) -> None:
    for s in (result["baseline"], result["candidate"]):
        if s:  # sides measured within one run (recovery's trials) have no wall/CPU of their own
            cost = (f"; wall {s['wall_s']['median']:.4g} s, CPU {s['cpu_s']['median']:.4g} s "
                    "per run (medians)" if "cpu_s" in s else "")
            print(f"{s.get('name')}: {describe(s)} {s['unit']}{cost}")
    for c in result["checks"]:
        print(f"check {c['name']} ({c['statistic']}): {describe(c)} {c['unit']} "
              f"(target {c['target']}: {c['verdict']})")
    for note in result["notes"]:
        print(f"note: {note}")
    if result["checkout"]["dirty"]:
        print(f"warning: uncommitted changes in the checkout ({result['checkout']['commit']})")
    if result["status"] != "ok":
        print(f"{result['benchmark']}: {result['status']}: {result.get('reason')}")
    elif result["pairs"]:
        own = result["pairs"].get("verdict") or "informative"  # from the ratio's own interval
        print(f"per-pair ratio ({result['metric']}): {describe(result['pairs'])} "
              f"(target {result['target']}: {own})")
        if result["checks"]:
            print(f"verdict of the row (the ratio's and every check's): "
                  f"{result['verdict'] or 'no verdict'}")
        if result["cpu_ratio"]:
            print(f"per-pair CPU ratio (candidate / baseline): {describe(result['cpu_ratio'])}")


def log(message: str) -> None:
    """Progress for the reader (stderr, so stdout stays the results)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_timed(cmd: list[str], log_path: Path, timeout_s: float,
              extra_env: dict[str, str] | None = None, cwd: Path | None = None,
              leave_out: tuple[str, ...] | None = None) -> float:
    """Run ``cmd`` to its end and return its wall time in seconds (``time.perf_counter``).

    Output goes to ``log_path``. The environment is :func:`env`'s (this checkout first on the
    path) or, with ``leave_out``, this process's without those variables, as a new user's
    shell would have it (telemetry off and ``extra_env`` either way). Raises RuntimeError
    naming the log when it exits non-zero.
    """
    if leave_out is None:
        child_env = env(extra_env)
    else:
        child_env = {k: v for k, v in os.environ.items() if k not in leave_out}
        child_env |= TELEMETRY_OFF | (extra_env or {})
    with open(log_path, "w") as out:
        started = time.perf_counter()
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env,
                              cwd=cwd or ROOT, timeout=timeout_s, check=False).returncode
        wall_s = time.perf_counter() - started
    if code != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{' '.join(map(str, cmd[:6]))} ... exited {code}; log {log_path}:\n"
                           f"{tail}")
    return wall_s


def torchrun(nproc: int, *target: str) -> list[str]:
    """A plain torchrun command line (rendezvous on 127.0.0.1) running ``target``."""
    return [PYTHON, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1",
            *target]


class Workdir:
    """``--workdir`` if given (kept), else a temporary folder removed on exit."""

    def __init__(self, path: Path | None, prefix: str):
        import tempfile

        self._tmp = None if path else tempfile.TemporaryDirectory(prefix=f"stoker-{prefix}-")
        self.path = (path or Path(self._tmp.name)).resolve()
        self.path.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()

