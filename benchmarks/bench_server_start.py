"""The local Prefect server's cost to a command in a new work folder: its own new server (before
issue 45) vs the machine's one server, reused.

Each run is ``stoker server start`` in a new process, timed from the command to its exit, as a
user waits for it (``stoker run`` does the same before its flow starts):

* baseline: a new work folder as before issue 45: a server of its own on a new database that
  the server migrates inside its start timeout (``PREFECT_HOME`` of its own; the database left
  to the server, as Stoker did then);
* candidate: a new work folder now (``--work-dir`` new, no ``PREFECT_HOME``): the machine's
  server, running, is found and reused;
* extra arm ``prepared start``: the machine's server started again after ``stoker server stop``,
  on its prepared database (what a start costs now, once per machine boot or stop).

Before the pairs, once: the very first start of a new machine (a new state folder): the
database is prepared (``preparing the Prefect database (once)``), then the server starts.

Target: reused / own new server <= 0.25 (wall, per pair). Servers are stopped untimed.

    python benchmarks/bench_server_start.py [--quick] [--repeats N]
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    PYTHON,
    Target,
    Workdir,
    alternate,
    compared,
    emit,
    log,
    options,
    run_timed,
    side,
)
from benchmarks.stats import ratio_summary  # noqa: E402
from stoker.local_server import LocalServer  # noqa: E402
from stoker.server_database import STAMP, stamp  # noqa: E402

TARGET = Target("<=", 0.25)
TIMEOUT_S = 600
_READY = re.compile(r"Prefect database ready in ([\d.]+) s")


class Machine:
    """The benchmark's stand-in for a user's machine: its state folder (XDG_STATE_HOME)."""

    def __init__(self, work: Path, name: str):
        self.work, self.state = work, work / name
        self.home = self.state / "stoker" / "prefect"

    def start(self, label: str, *args: str, **extra: str) -> tuple[float, str]:
        """Wall seconds of one ``stoker server start`` and its output."""
        log_path = self.work / f"{label}.log"
        wall_s = run_timed([PYTHON, "-m", "stoker.cli", "server", "start", *args], log_path,
                           TIMEOUT_S, extra_env={"XDG_STATE_HOME": str(self.state), **extra},
                           cwd=self.work)
        return wall_s, log_path.read_text()


def own_new_server(work: Path, i: int) -> float:
    """A new work folder as before issue 45: its own home, a new database the server migrates."""
    home = work / f"own-{i}" / ".prefect"
    home.mkdir(parents=True)
    (home / "prefect.db").touch()  # left to the server: Stoker does not prepare it
    (home / STAMP).write_text(stamp({}) + "\n")
    try:
        return Machine(work, "unused").start(f"own-{i}", PREFECT_HOME=str(home))[0]
    finally:
        LocalServer(home).stop()


def main() -> None:
    args = options(__doc__, 5)
    with Workdir(args.workdir, "bench-server") as work:
        for name in ("PREFECT_HOME", "PREFECT_API_URL"):
            os.environ.pop(name, None)  # the runs choose their own
        machine = Machine(work, "state")
        log("the first start of a new machine: the database prepared once, then the server")
        first_s, first_log = machine.start("first")
        prepared = _READY.search(first_log)
        try:
            def reused(i: int) -> float:
                LocalServer(machine.home).ensure()  # running (untimed when it already is)
                return machine.start(f"reused-{i}", "--work-dir", str(work / f"new-{i}"))[0]

            def prepared_start(i: int) -> float:
                LocalServer(machine.home).stop()  # untimed: the figure is the start's
                return machine.start(f"restart-{i}")[0]

            pairs = alternate(lambda i: own_new_server(work, i), reused, args.repeats,
                              args.warmups, extra={"prepared start": prepared_start})
        finally:
            LocalServer(machine.home).stop()
    restart = side(pairs, "prepared start", "the machine's server started again (prepared "
                   "database)", "s")
    restart_ratio = ratio_summary(pairs.values("baseline"), pairs.values("prepared start"),
                                  lambda b, c: c / b)
    emit("server_start", metric="wall time of `stoker server start` in a new work folder: the "
         "machine's server reused / its own new server (before issue 45)", quick=args.quick,
         **compared(pairs, lambda b, c: c / b, TARGET, "own new server, new database (before)",
                    "the machine's server, reused (now)", "s"),
         notes=[f"first start of a new machine (prepare once + start): {first_s:.1f} s, of "
                f"which preparing the database {prepared.group(1) if prepared else '?'} s",
                f"prepared start (after `stoker server stop`): median "
                f"{restart['median']:.3g} s; per pair / own new server: median "
                f"{restart_ratio['median']:.3g}",
                "CPU figures are the command's only: the server runs detached (not a waited-for "
                "child), so its start-up CPU (migrations included, before) is left out of them"],
         details={"first_start_s": first_s,
                  "prepare_s": float(prepared.group(1)) if prepared else None,
                  "prepared_start": restart, "prepared_start_ratio": restart_ratio})


if __name__ == "__main__":
    main()
