"""``stoker cost``: spend per job and per registered model over a period, from the MLflow store.

A read: it creates no store. Bad input (a period that cannot be parsed, a store that does not
exist) is one line with exit code 2.
"""

from __future__ import annotations

import datetime
import re
import time
from pathlib import Path
from typing import Annotated, Literal

import typer

_AGO = re.compile(r"^(\d+(?:\.\d+)?)([hdw])$")
_UNIT_S = {"h": 3600, "d": 86400, "w": 7 * 86400}


def parse_when(text: str, now_s: float, name: str) -> float:
    """``text`` as Unix seconds: an age (``30d``, ``12h``, ``2w``: that long before ``now_s``)
    or an ISO 8601 date or time (UTC when no offset is given).

    Raises:
        ValueError: neither (the message names ``name``).
    """
    if (m := _AGO.match(text.strip())):
        return now_s - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        when = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{name}: {text!r} is neither an age (30d, 12h, 2w) nor an ISO 8601 "
                         "date (2026-11-01)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


def cost(
    since: Annotated[str, typer.Option(help="Start of the period: an age (30d, 12h, 2w) or an "
                                       "ISO 8601 date/time (UTC)")] = "30d",
    until: Annotated[str | None, typer.Option(help="End of the period (excluded) [default: "
                                              "now]", show_default=False)] = None,
    output_format: Annotated[Literal["table", "csv", "json"], typer.Option(
        "--format", help="table (markdown), csv (one line per job, then TOTAL) or json")] =
        "table",
    plot: Annotated[Path | None, typer.Option(help="Also draw the cumulative spend over the "
                                              "period into this PNG")] = None,
    tracking_uri: Annotated[str | None, typer.Option(
        help="MLflow tracking URI [default: the store of --work-dir]", show_default=False)] =
        None,
    work_dir: Annotated[Path, typer.Option("--work-dir", "-w", help="The work folder whose "
                                           "MLflow store (`<work-dir>/mlflow.db`) is read")] =
        Path("work"),
    prices: Annotated[Path | None, typer.Option(
        help="YAML price table for the advice (the shape of cost.prices: usd_per_gpu_hour: "
        "{H100: {on_demand: 4.0, spot: 1.7, reserved: 1.6}, default: {...}}) [default: the "
        "built-in table]", show_default=False)] = None,
) -> None:
    """Spend per job and per registered model over a period: GPU-hours by capacity type, cost,
    goodput, steps lost to preemption and their cost, cost-guard stops, and the purchase mix
    (reserved, spot, on-demand) of least cost for the period's hour-by-hour demand."""
    import os

    from stoker.environment import TELEMETRY_OFF, sqlite_path

    for name, value in TELEMETRY_OFF.items():
        os.environ.setdefault(name, value)
    now = time.time()
    try:
        since_s = parse_when(since, now, "--since")
        until_s = parse_when(until, now, "--until") if until else now
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if until_s <= since_s:
        typer.echo(f"error: --until must be after --since ({since} .. {until})", err=True)
        raise typer.Exit(2)
    tracking_uri = tracking_uri or f"sqlite:///{work_dir / 'mlflow.db'}"
    store = sqlite_path(tracking_uri)
    if store is not None and not store.is_file():
        typer.echo(f"error: --tracking-uri: no MLflow store at {store}", err=True)
        raise typer.Exit(2)
    from mlflow import MlflowClient

    from stoker.tracking.pricing import PriceTable
    from stoker.tracking.spend_report import (
        collect,
        plot_spend,
        render_csv,
        render_json,
        render_table,
    )

    table = _price_table(prices) if prices is not None else PriceTable()
    summary = collect(MlflowClient(tracking_uri), since_s, until_s, table)
    render = {"table": render_table, "csv": render_csv, "json": render_json}[output_format]
    typer.echo(render(summary), nl=False)
    if plot is not None:
        plot_spend(summary, plot)
        typer.echo(f"spend plot: {plot}", err=True)


def _price_table(path: Path):
    """The price table in YAML file ``path``; exit 2 with one line when it cannot be read."""
    import yaml
    from pydantic import ValidationError

    from stoker.tracking.pricing import PriceTable

    try:
        return PriceTable(**(yaml.safe_load(path.read_text()) or {}))
    except (OSError, yaml.YAMLError, TypeError, ValidationError) as e:
        first = str(e).splitlines()[0] if not isinstance(e, ValidationError) else \
            "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        typer.echo(f"error: --prices {path}: {first}", err=True)
        raise typer.Exit(2) from None
