"""Render a sweep as Markdown (the Prefect artifact) and as plain event payloads."""

from __future__ import annotations

import datetime as dt
import traceback

from stoker.costguard.sweep import Row, SweepReport


def _fmt(value: float | int | None, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}{unit}"


def _signals(row: Row) -> str:
    s = row.decision.signals
    parts = [f"util max {_fmt(s.get('max_utilization_percent'), '%')}",
             f"mem max {_fmt(s.get('max_memory_mib'), ' MiB')}",
             f"{s.get('samples', 0)} samples"]
    if s.get("heartbeat_age_s") is not None:
        parts.append(f"heartbeat {_fmt(s['heartbeat_age_s'], ' s')} ago")
    if s.get("age_s") is not None:
        parts.append(f"up {_fmt(s['age_s'] / 60, ' min')}")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: tuple[Row, ...], with_kind: bool) -> list[str]:
    head = "| resource | GPUs | signals | verdict | reasons | action | idle GPU-h | $/h saved |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        name = f"{row.kind} `{row.name}`" if with_kind else f"`{row.id}` {row.name}"
        gpus = ", ".join(f"`{g}`" for g in row.gpus) if with_kind else "1"
        action = f"**{row.action_status}**" + (f": {row.action}" if row.action else "")
        lines.append("| " + " | ".join(_cell(c) for c in [
            name, gpus, _signals(row), f"**{row.decision.verdict}**",
            "; ".join(row.decision.reasons), action, f"{row.idle_gpu_hours:.2f}",
            f"{row.usd_per_hour:.2f}"]) + " |")
    return lines


def render_markdown(report: SweepReport) -> str:
    """The sweep as Markdown: a summary, one table of GPUs, one of Stoker-owned resources."""
    when = dt.datetime.fromtimestamp(report.started, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    mode = "**dry run**: nothing was stopped" if report.dry_run else "**act**: stops enabled"
    wasteful = sum(1 for r in report.gpus if r.decision.verdict in ("idle", "stalled", "leak"))
    lines = [
        "# Stoker cost guard", "",
        f"- Sweep at {when}, {report.samples} samples over {report.window_s:g} s; {mode}",
        f"- Idle, stalled or leaking GPUs: {wasteful} "
        f"of {len(report.gpus)}; {report.idle_gpu_hours:.2f} GPU-hours observed; "
        f"${report.usd_per_hour:.2f}/hour ({report.capacity_type} prices) if released",
        "",
    ]
    if report.notes:
        lines += ["## Notes", "", *[f"- {_cell(n)}" for n in report.notes], ""]
    lines += ["## GPUs", ""]
    lines += _table(report.gpus, with_kind=False) if report.gpus else ["No GPU readings."]
    lines += ["", "## Stoker-owned resources", ""]
    lines += (_table(report.resources, with_kind=True) if report.resources
              else ["No Stoker-owned resources found."])
    return "\n".join(lines) + "\n"


def log_line(row: Row) -> str:
    """One log line per resource: what was seen, the verdict and why, what was done."""
    why = "; ".join(row.decision.reasons)
    done = row.action_status + (f": {row.action}" if row.action else "")
    what = f"gpu {row.id} ({row.name})" if row.kind == "gpu" else f"{row.kind} {row.name}"
    line = f"{what}: {row.decision.verdict}"
    return line + (f" ({why})" if why else "") + f"; action {done}"


def event_payload(row: Row, dry_run: bool) -> dict:
    """A JSON-able summary of one row for a Prefect event payload."""
    return {
        "kind": row.kind, "id": row.id, "name": row.name, "gpus": list(row.gpus),
        "verdict": str(row.decision.verdict), "reasons": list(row.decision.reasons),
        "signals": row.decision.signals, "action_status": row.action_status,
        "action": row.action, "idle_gpu_hours": round(row.idle_gpu_hours, 4),
        "usd_per_hour": round(row.usd_per_hour, 4), "dry_run": dry_run,
    }


def event_resource(row: Row) -> dict[str, str]:
    """The Prefect event resource of a sweep row: ``stoker.<kind>.<id>`` with its name."""
    return {"prefect.resource.id": f"stoker.{row.kind}.{row.id}",
            "prefect.resource.name": row.name, "stoker.kind": row.kind}


def render_failure(error: BaseException, dry_run: bool) -> str:
    """Markdown for a sweep that crashed: what failed and where, and what it means."""
    frame = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" (in {frame[0].name}, {frame[0].filename}:{frame[0].lineno})" if frame else ""
    mode = "dry run" if dry_run else "act"
    return "\n".join([
        "# Stoker cost guard", "",
        f"- **The sweep failed** ({mode}): `{_cell(type(error).__name__)}: {_cell(str(error))}`"
        f"{where}",
        "- No verdicts were reached; resources not stopped before the failure were left as they "
        "are. The task log has the full traceback.", ""])


def failure_payload(error: BaseException, dry_run: bool) -> dict:
    """The payload of the ``stoker.cost-guard.failed`` event."""
    return {"error_type": type(error).__name__, "error": str(error), "dry_run": dry_run}
