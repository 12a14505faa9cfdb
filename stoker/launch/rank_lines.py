"""An attempt's output lines: :class:`LineLog` writes each, stamped with a time, to the job's
log (what ``stoker logs`` shows) and passes it on at the level its rank or torchrun logged it
(:func:`at_rank_level`); it also notes a rank's named error and the rank that ended the
attempt. No Prefect."""

from __future__ import annotations

import logging
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

from stoker.runtime import private
from stoker.runtime.launch import RANK_ENDED


def log_time(unix_s: float) -> str:
    """``unix_s`` as the ranks' log lines write their time (Python logging's ``asctime``: local
    time, milliseconds after a comma), e.g. ``2026-12-01 11:17:14,374``."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s)) + \
        f",{int((unix_s - int(unix_s)) * 1000):03d}"


# A rank's log line (stoker.runtime.__main__'s format: "[rank1] <time> WARNING name: ..."), in a
# container after "[node N] ": its prefix up to the level.
RANK_STAMPED = re.compile(r"^(?:\[node \d+\] )?\[rank\d+\] \d{4}-\d\d-\d\d "
                          r"\d\d:\d\d:\d\d,\d{3} ")
RANK_LEVEL = re.compile(RANK_STAMPED.pattern + r"(WARNING|ERROR|CRITICAL) ")  # and its level
# torchrun's own lines (glog style: "E1204 20:04:19.123000 4242 torch/...] failed (exitcode:
# -9) ..."), whose first letter is the level.
TORCH_LEVEL = re.compile(r"^(?:\[node \d+\] )?([EWF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\] ")
_TORCH_LEVELS = {"E": logging.ERROR, "W": logging.WARNING, "F": logging.CRITICAL}


# The launcher's lines about how an attempt ended (a hang, a rank's own 137, a stop that lost
# its checkpoint), in a container after "[node N] ": warnings.
LAUNCHER_LINE = re.compile(r"^(?:\[node \d+\] )?stoker\.runtime\.launch: ")
# The hang watchdog's last line: what hung and which rank stood out (stoker.runtime.hang).
HANG = re.compile(r"stoker\.runtime\.launch: hang: (no rank progressed .*\)); every rank's "
                  r"stack is above")


def at_rank_level(logger: logging.Logger | logging.LoggerAdapter) -> Callable[[str], None]:
    """A ``forward`` for :class:`LineLog` that logs each line at INFO, and a rank's WARNING,
    ERROR or CRITICAL line, or torchrun's (``E``, ``W``, ``F``: a rank killed by a signal,
    ``failed (exitcode: -9)``), at that level, and the launcher's own lines (a hang, a rank's
    own 137) at WARNING (so the Prefect UI's level filter finds them)."""

    def forward(line: str) -> None:
        if level := RANK_LEVEL.match(line):
            logger.log(logging.getLevelName(level.group(1)), line)
        elif torch_level := TORCH_LEVEL.match(line):
            logger.log(_TORCH_LEVELS[torch_level.group(1)], line)
        elif LAUNCHER_LINE.match(line):
            logger.log(logging.WARNING, line)
        else:
            logger.log(logging.INFO, line)

    return forward


class LineLog:
    """Appends every output line of the attempts to ``path`` (what ``stoker logs`` shows) and
    passes it on to ``forward`` (the Prefect task log), except torchrun's own lines about a stop
    (``AGENT_NOISE``). A full disk or a closed file never fails the attempt: the line still
    reaches ``forward``.

    Every line in the file carries a time (:func:`log_time`): a rank's log line has its own after
    its ``[rankN]`` prefix (``RANK_STAMPED``) and is written as it is; any other line (torchrun's
    own, Stoker's, a rank's traceback or print) starts with the time it was read. ``forward``
    gets the line as it came: the Prefect log stamps its lines itself."""

    # What a rank logs for a named user error (exit 2): ``[rank0] <time> ERROR stoker.runtime: ...``
    RANK_ERROR = re.compile(r"^\[rank\d+\] .*? ERROR stoker\.runtime[\w.]*: (.+)$")
    # torchrun's own lines about a stop that Stoker reports itself ("attempt 2 ended: preempted
    # (exit 75)"), and its "failed (exitcode: N)" for an exit the rank chose and named in its
    # own line (2 bad input, 74 storage, 137 an infrastructure failure it found: the launcher's
    # line says which rank): kept in the file, not passed on (they read as warnings and
    # errors). With forked ranks torchrun words them differently, and logs the traceback of its
    # own wait for the ranks (each line prefixed) beside a rank's exit: the rank's own log says
    # why. A rank a bug ended (exitcode 1) keeps torchrun's line; one a signal ended (-9) is
    # said by the attempt's end line instead (``killed``).
    AGENT_NOISE = re.compile(
        r"torch/distributed/elastic/\S+\] (Sending process \d+ closing signal|Closing process "
        r"\d+ via signal|Received \S+ death signal|failed \(exitcode: (?:75|74|2|137)\)|"
        r"Traceback \(most "
        r"recent call last\)|\s|torch\.multiprocessing\.spawn\.Process\w*Exception: )"
        r"|torch/multiprocessing/spawn\.py:\d+\] Terminating process \d+ via signal")

    # torchrun's line for a rank a signal ended (``kill -9``, the OOM killer): said in Stoker's
    # own words on the attempt's end line (``killed``), kept raw in the file only (trial: the
    # raw ``failed (exitcode: -9)`` line reached the terminal).
    RANK_KILLED = re.compile(r"^(?:\[node (\d+)\] )?\S+ \S+ +\d+ \S*torch/distributed/"
                             r"elastic/\S+\] failed \(exitcode: -(\d+)\) local_rank: (\d+) "
                             r"\(pid: (\d+)\)")

    def __init__(self, path: Path, forward: Callable[[str], None]):
        self.path, self.forward = Path(path), forward
        self._file = None
        # The first rank a signal ended, in words: "local rank 1 (pid 4321) was killed by SIGKILL"
        self.killed: str | None = None
        self.first_error: str | None = None  # the first rank's ERROR message, if any
        # The rank whose own exit 137 ended the attempt (the launcher's line), not a SIGKILL.
        self.ended_by_rank: int | None = None
        self.hang: str | None = None  # the hang watchdog's summary, when it ended the attempt

    def __call__(self, line: str) -> None:
        if self.hang is None and (hung := HANG.search(line)):
            self.hang = hung.group(1)
        if self.first_error is None and (error := self.RANK_ERROR.match(line)):
            self.first_error = error.group(1)
        if self.ended_by_rank is None and (ended := RANK_ENDED.search(line)):
            self.ended_by_rank = int(ended.group(1))
        said_here = self.killed is None and self._note_killed(line)
        try:
            if self._file is None:
                self._file = private.open_file(self.path, "a", buffering=1)  # closed in close()
            stamped = line if RANK_STAMPED.match(line) else f"{log_time(time.time())} {line}"
            self._file.write(stamped + "\n")
        except OSError:
            pass
        if not said_here and not self.AGENT_NOISE.search(line):
            self.forward(line)

    def _note_killed(self, line: str) -> bool:
        """Whether ``line`` is torchrun's for a rank a signal ended; if so, ``killed`` says it."""
        if not (match := self.RANK_KILLED.match(line)):
            return False
        node, number, rank, pid = match.groups()
        try:
            name = signal.Signals(int(number)).name
        except ValueError:
            name = f"signal {number}"
        where = f" on node {node}" if node is not None else ""
        self.killed = f"local rank {rank}{where} (pid {pid}) was killed by {name}"
        return True

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
