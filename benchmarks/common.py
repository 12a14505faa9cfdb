"""Shared pieces of the benchmarks: options, alternating runs, statistics, the result line.

Every benchmark measures a baseline and Stoker (the candidate) in the same run, alternately
(A B A B ...), reports median and min-max of each, and ends with one JSON line whose last fields
are the ratio, its target and whether the target was met. A missed target is data, not an
error: the scripts exit 0 unless the measurement itself failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

TELEMETRY_OFF = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                 "DVC_NO_ANALYTICS": "1", "DO_NOT_TRACK": "1"}
os.environ.update(TELEMETRY_OFF)
DATA_DIR_ENV = "STOKER_BENCH_DATA_DIR"


def parser(description: str, repeats: int) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes.

    Args:
        description: first line of the script's docstring.
        repeats: default number of baseline/candidate pairs at full size.
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true",
                   help="tiny size, one pair (a smoke run for CI: the figures mean little)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"baseline/candidate pairs, alternated (default {repeats}; 1 with --quick)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep all state under this folder (default: a temporary folder, removed)")
    p.add_argument("--data-dir", type=Path, default=os.environ.get(DATA_DIR_ENV) or None,
                   help="folder for the demo data repository and its pulled copy, kept and "
                        f"shared between benchmarks (default: ${DATA_DIR_ENV}, else inside the "
                        "work folder)")
    p.set_defaults(default_repeats=repeats)
    return p


def repeats_of(args: argparse.Namespace) -> int:
    """The number of pairs to run: ``--repeats``, else 1 with ``--quick``, else the default."""
    if args.repeats is not None:
        if args.repeats < 1:
            raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
        return args.repeats
    return 1 if args.quick else args.default_repeats


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for child processes: telemetry off, this checkout first on the path."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **TELEMETRY_OFF, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
            **(extra or {})}


def alternate(baseline: Callable[[int], Any], candidate: Callable[[int], Any],
              repeats: int) -> tuple[list[Any], list[Any]]:
    """Run ``baseline(i)`` and ``candidate(i)`` alternately, ``repeats`` times each.

    The order flips every pair (A B, B A, A B, ...) so that a drift in the machine's load does
    not always favour the same side. Returns (baseline results, candidate results).
    """
    base, cand = [], []
    for i in range(repeats):
        if i % 2 == 0:
            base.append(baseline(i))
            cand.append(candidate(i))
        else:
            cand.append(candidate(i))
            base.append(baseline(i))
        log(f"pair {i + 1}/{repeats}: baseline {_short(base[-1])}, candidate {_short(cand[-1])}")
    return base, cand


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def stats(values: Iterable[float], unit: str, name: str) -> dict[str, Any]:
    """Median, min, max and every value (rounded to 6 significant digits)."""
    values = [float(v) for v in values]
    return {"name": name, "unit": unit, "median": _round(statistics.median(values)),
            "min": _round(min(values)), "max": _round(max(values)), "n": len(values),
            "values": [_round(v) for v in values]}


def _round(value: float) -> float:
    return float(f"{value:.6g}")


@dataclass(frozen=True)
class Target:
    """A target on a figure: ``op`` is ``<=`` or ``>=``; ``value`` in the figure's unit."""

    op: str
    value: float

    def met(self, figure: float) -> bool:
        return figure <= self.value if self.op == "<=" else figure >= self.value

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}"


def check(name: str, figure: float, unit: str, target: Target,
          spread: tuple[float, float] | None = None) -> dict[str, Any]:
    """One measured figure against its target (for benchmarks with more than the ratio).

    ``spread`` is the figure's (min, max) over the runs; ``decided`` then says whether both
    ends give the same verdict.
    """
    out = {"name": name, "value": _round(figure), "unit": unit, "target": str(target),
           "met": target.met(figure)}
    if spread is not None:
        out |= {"range": [_round(spread[0]), _round(spread[1])],
                "decided": target.met(spread[0]) == target.met(spread[1])}
    return out


def ratio_range(fn: Callable[[float, float], float], baseline: dict,
                candidate: dict) -> tuple[float, float]:
    """The ratio ``fn(baseline, candidate)`` at the extremes of both sides: (lowest, highest)
    over the four (min/max, min/max) pairs. A target between them is within the noise."""
    corners = [fn(b, c) for b in (baseline["min"], baseline["max"])
               for c in (candidate["min"], candidate["max"])]
    return min(corners), max(corners)


def emit(benchmark: str, *, metric: str, baseline: dict | None, candidate: dict | None,
         ratio: float | None, target: Target | str | None, checks: list[dict] | None = None,
         notes: list[str] | None = None, details: dict | None = None, quick: bool = False,
         status: str = "ok", reason: str | None = None,
         spread: tuple[float, float] | None = None) -> dict[str, Any]:
    """Print the human summary and then the result as one JSON line (the last line of output).

    ``target`` is the ratio's Target, or a text naming the absolute targets of ``checks`` when
    the ratio is informative only. ``target_met`` is true when the ratio meets its Target (if
    it has one) and every check meets its own; None when skipped or nothing has a target.
    ``spread`` is the ratio's range (``ratio_range``); ``decided`` is false when the verdict
    of the ratio or of a check flips within its range (the noise could change it).
    The JSON keys end with ``ratio``, ``target`` and ``target_met``.
    """
    checks = checks or []
    met = decided = None
    if status == "ok" and ratio is not None:
        verdicts = [c["met"] for c in checks]
        settled = [c["decided"] for c in checks if "decided" in c]
        if isinstance(target, Target):
            verdicts.append(target.met(ratio))
            if spread is not None:
                settled.append(target.met(spread[0]) == target.met(spread[1]))
        met = all(verdicts) if verdicts else None
        decided = all(settled) if settled and met is not None else None
    result: dict[str, Any] = {"benchmark": benchmark, "status": status, "quick": quick,
                              "metric": metric}
    if reason:
        result["reason"] = reason
    result |= {"baseline": baseline, "candidate": candidate, "checks": checks,
               "notes": notes or [], "details": details or {},
               "ratio_range": None if spread is None else [_round(v) for v in spread],
               "decided": decided, "ratio": None if ratio is None else _round(ratio),
               "target": None if target is None else str(target), "target_met": met}
    for side in (baseline, candidate):
        if side:
            print(f"{side['name']}: median {side['median']:.4g} {side['unit']} "
                  f"(min {side['min']:.4g}, max {side['max']:.4g}, n={side['n']})")
    for c in checks:
        print(f"check {c['name']}: {c['value']:.4g} {c['unit']} (target {c['target']}: "
              f"{'met' if c['met'] else 'MISSED'})")
    for note in notes or []:
        print(f"note: {note}")
    if status != "ok":
        print(f"{benchmark}: {status}: {reason}")
    elif ratio is not None:
        verdict = {True: "met", False: "MISSED", None: "no target"}[met]
        if decided is False:
            verdict += ", within the noise"
        span = f", range {spread[0]:.4g} to {spread[1]:.4g}" if spread else ""
        print(f"ratio ({metric}): {ratio:.4g}{span} (target {target}: {verdict})")
    print(json.dumps(result), flush=True)
    return result


def log(message: str) -> None:
    """Progress for the reader (stderr, so stdout stays the results)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_timed(cmd: list[str], log_path: Path, timeout_s: float,
              extra_env: dict[str, str] | None = None, cwd: Path | None = None) -> float:
    """Run ``cmd`` to its end and return its wall time in seconds (``time.perf_counter``).

    Output goes to ``log_path``. Raises RuntimeError naming the log when it exits non-zero.
    """
    with open(log_path, "w") as out:
        started = time.perf_counter()
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env(extra_env),
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
