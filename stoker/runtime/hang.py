"""Per-rank heartbeats and the launcher's hang watchdog (no Prefect, no torch).

Every rank marks, in one small file of the attempt's heartbeat folder (``STOKER_HEARTBEAT_DIR``,
set by :mod:`stoker.runtime.launch`), a counter, its step, the section it is in (``startup``,
``step``, ``eval``, ``checkpoint``) and its pid: one ``pwrite`` of 64 bytes per step, no fsync
(the reader is on the same node and reads the page cache).

The launcher polls these files (:class:`HangWatch`). Once ``warmup_steps`` steps are seen, the
attempt is hung when no rank's counter moved for the timeout of the section the slowest rank is in:
``max(step_factor x observed step time, step_floor_s)`` in ``step``, ``eval_s`` in ``eval``,
``checkpoint_s`` in ``checkpoint`` and ``startup_s`` before that. The launcher then dumps every
rank's Python stack (``faulthandler`` on ``SIGUSR2``, installed by :func:`install`) and kills the
ranks: the attempt ends with 137, an infrastructure failure retried from the last committed
checkpoint.

``STOKER_TEST_PAUSE`` is a test-only hook (never set it in a real job): ``rank:section:step:
seconds[:once_file]`` makes that rank sleep when it enters that section at that step
(``once_file``: only if the file does not exist yet, and it is created), and ``STOKER_TEST_SLOW``
``rank:factor`` makes that rank's steps last ``factor`` times as long.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from stoker.runtime import private

HEARTBEAT_DIR_ENV = "STOKER_HEARTBEAT_DIR"
POLICY_FILE = "policy.json"
SECTIONS = ("startup", "step", "eval", "checkpoint")
STACK_SIGNAL = signal.SIGUSR2
TEST_PAUSE_ENV = "STOKER_TEST_PAUSE"
TEST_SLOW_ENV = "STOKER_TEST_SLOW"
_RECORD_BYTES = 64


@dataclass(frozen=True)
class HangPolicy:
    """The watchdog's figures (``train.hang``; seconds unless named otherwise).

    Attributes:
        enabled: False: no watchdog (the heartbeats are still written).
        step_factor: a step hangs after this many observed step times (at least step_floor_s).
        step_floor_s: the least time a step may take before it counts as hung, s.
        startup_s: before ``warmup_steps`` steps are seen (imports, data, resume), s.
        eval_s: one evaluation, s.
        checkpoint_s: one checkpoint save, s.
        warmup_steps: steps seen before step times count.
    """

    enabled: bool = True
    step_factor: float = 10.0
    step_floor_s: float = 120.0
    startup_s: float = 900.0
    eval_s: float = 600.0
    checkpoint_s: float = 600.0
    warmup_steps: int = 3

    @property
    def collective_timeout_s(self) -> float:
        """The process group's timeout (s): past every section's, so the watchdog, which dumps
        the stacks, fires first; a collective never waits torch's default 30 minutes."""
        return max(self.step_floor_s, self.startup_s, self.eval_s, self.checkpoint_s) + 30.0

    def timeout_s(self, section: str, step_time_s: float | None) -> float:
        """Seconds without progress that make ``section`` hung, given the observed step time."""
        if section == "startup" or (section == "step" and step_time_s is None):
            return self.startup_s if section == "startup" else max(self.step_floor_s,
                                                                    self.startup_s)
        if section == "eval":
            return self.eval_s
        if section == "checkpoint":
            return self.checkpoint_s
        return max(self.step_factor * step_time_s, self.step_floor_s)


@dataclass(frozen=True)
class Beat:
    """One rank's last heartbeat: its counter, step, section and pid."""

    count: int
    step: int
    section: str
    pid: int
    step_ms: int = 0  # the rank's last whole step (data wait included), ms; 0: none yet


class RankHeartbeat:
    """This rank's heartbeat file; :meth:`mark` costs one ``pwrite``."""

    def __init__(self, folder: str | Path, rank: int):
        self.rank, self.count = rank, 0
        path = Path(folder) / f"rank-{rank}.beat"
        self._fd = private.open_fd(path, os.O_RDWR)
        self._slow = _test_slow(rank)
        self._step_started: float | None = None
        self._step_ms = 0

    def mark(self, section: str, step: int) -> None:
        """Record that this rank entered ``section`` at ``step`` (one of :data:`SECTIONS`)."""
        if section == "step":
            now = time.monotonic()
            if self._slow and self._step_started is not None:  # test-only: factor x slower
                time.sleep((now - self._step_started) * (self._slow - 1))
                now = time.monotonic()
            if self._step_started is not None:
                self._step_ms = round((now - self._step_started) * 1000)
            self._step_started = now
        else:
            self._step_started = None  # an evaluation or a save is not a step's time
        self.count += 1
        record = f"{self.count} {step} {section} {os.getpid()} {self._step_ms}"
        record = record.ljust(_RECORD_BYTES)
        os.pwrite(self._fd, record.encode(), 0)
        _test_pause(self.rank, section, step)


_heartbeat: RankHeartbeat | None = None


def install(rank: int, policy: HangPolicy) -> None:
    """Start this rank's heartbeat (where ``STOKER_HEARTBEAT_DIR`` is set) and let ``SIGUSR2``
    print every thread's Python stack to stderr; rank 0 also writes ``policy`` for the
    launcher."""
    global _heartbeat
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
    folder = os.environ.get(HEARTBEAT_DIR_ENV, "").strip()
    if not folder or not os.path.isdir(folder):
        return
    if rank == 0:
        tmp = Path(folder) / (POLICY_FILE + ".tmp")
        private.write_text(tmp, json.dumps(policy.__dict__))
        tmp.replace(Path(folder) / POLICY_FILE)
    _heartbeat = RankHeartbeat(folder, rank)
    _heartbeat.mark("startup", 0)


def mark(section: str, step: int) -> None:
    """Mark this rank's heartbeat (a no-op without :func:`install`'s folder)."""
    if _heartbeat is not None:
        _heartbeat.mark(section, step)


def read_beats(folder: str | Path) -> dict[int, Beat]:
    """Every rank's last heartbeat in ``folder`` (unreadable or torn files are left out)."""
    beats: dict[int, Beat] = {}
    for path in Path(folder).glob("rank-*.beat"):
        with contextlib.suppress(OSError, ValueError):
            count, step, section, pid, step_ms = path.read_bytes()[:_RECORD_BYTES].split()
            if section.decode() in SECTIONS:
                beats[int(path.stem[5:])] = Beat(int(count), int(step), section.decode(),
                                                 int(pid), int(step_ms))
    return beats


def read_policy(folder: str | Path) -> HangPolicy | None:
    """The policy rank 0 wrote, None before it did (or if unreadable)."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        return HangPolicy(**json.loads((Path(folder) / POLICY_FILE).read_text()))
    return None


@dataclass(frozen=True)
class Hang:
    """No rank progressed for ``idle_s`` seconds in ``section`` (timeout ``timeout_s``)."""

    section: str
    idle_s: float
    timeout_s: float
    steps: dict[int, int]

    def line(self) -> str:
        where = ", ".join(f"rank {r} at step {s}" for r, s in sorted(self.steps.items()))
        return (f"stoker.runtime.launch: hang: no rank progressed for {self.idle_s:.0f} s in "
                f"section {self.section} (timeout {self.timeout_s:.0f} s; {where}); every "
                "rank's stack is above; ending the attempt as an infrastructure failure "
                "(exit 137), retried from the last committed checkpoint")


@dataclass
class HangWatch:
    """Decide from successive heartbeat readings whether the attempt hangs."""

    policy: HangPolicy
    _counts: dict[int, int] = field(default_factory=dict)
    _progress_at: float | None = None
    _step_ms: list[int] = field(default_factory=list)  # the slowest rank's, last readings
    _slowest: int = 0

    def step_time_s(self) -> float | None:
        """Median seconds per step of the slowest rank, after ``warmup_steps`` steps."""
        if self._slowest < self.policy.warmup_steps or not self._step_ms:
            return None
        return statistics.median(self._step_ms) / 1000

    def observe(self, beats: dict[int, Beat], now: float) -> Hang | None:
        """Take one reading (``now``: monotonic s); returns the hang once there is one."""
        if self._progress_at is None or any(self._counts.get(r) != b.count
                                            for r, b in beats.items()):
            self._progress_at = now
        self._counts = {r: b.count for r, b in beats.items()}
        if beats:
            slowest = min(b.step for b in beats.values())
            step_ms = max(b.step_ms for b in beats.values())
            if slowest > self._slowest and step_ms > 0:
                self._step_ms = (self._step_ms + [step_ms])[-20:]
            self._slowest = max(self._slowest, slowest)
        if not beats or not self.policy.enabled:
            return None
        step_time = self.step_time_s()
        # The slowest rank's section: ranks ahead of it wait for it in a collective.
        slowest = min(b.step for b in beats.values())
        section = max((b.section for b in beats.values() if b.step == slowest),
                      key=lambda s: self.policy.timeout_s(s, step_time))
        timeout = self.policy.timeout_s(section, step_time)
        idle = now - self._progress_at
        if idle < timeout:
            return None
        return Hang(section, idle, timeout, {r: b.step for r, b in beats.items()})


def _test_slow(rank: int) -> float:
    value = os.environ.get(TEST_SLOW_ENV, "")
    with contextlib.suppress(ValueError):
        who, factor = value.split(":")
        if int(who) == rank:
            return float(factor)
    return 0.0


def _test_pause(rank: int, section: str, step: int) -> None:
    """Test-only: sleep as ``STOKER_TEST_PAUSE`` asks (see the module docstring)."""
    value = os.environ.get(TEST_PAUSE_ENV, "")
    if not value:
        return
    parts = value.split(":")
    with contextlib.suppress(ValueError):
        if (int(parts[0]), parts[1], int(parts[2])) != (rank, section, step):
            return
        once = Path(parts[4]) if len(parts) > 4 else None
        if once is not None:
            if once.exists():
                return
            once.touch()
        time.sleep(float(parts[3]))


def end_hung_ranks(beats: dict[int, Beat], dump_wait_s: float = 1.0) -> None:
    """Dump every rank's stack (``SIGUSR2``), wait ``dump_wait_s`` seconds for the dumps, then
    SIGKILL the ranks. The running ranks first: a rank frozen by ``SIGSTOP`` dumps only once
    continued (``SIGCONT``), and with its peers gone it cannot train on in that moment. Only
    this process's own descendants are signalled (a pid in a heartbeat file is not trusted
    further)."""
    import psutil

    mine = {p.pid: p for p in psutil.Process().children(recursive=True)}
    ranks = [mine[b.pid] for b in beats.values() if b.pid in mine]
    frozen = []
    for proc in ranks:
        with contextlib.suppress(psutil.Error):
            if proc.status() == psutil.STATUS_STOPPED:
                frozen.append(proc)
    for group in ([p for p in ranks if p not in frozen], frozen):
        for proc in group:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(STACK_SIGNAL)
                if proc in frozen:
                    proc.send_signal(signal.SIGCONT)
        if group:
            time.sleep(dump_wait_s)
        for proc in group:
            with contextlib.suppress(psutil.Error):
                proc.kill()


def watch(folder: str | Path, done, poll_s: float = 0.5) -> Hang | None:
    """Poll the heartbeats in ``folder`` until ``done`` (a ``threading.Event``) is set or the
    attempt hangs; on a hang print its line, end the ranks (:func:`end_hung_ranks`) and
    return it."""
    watcher: HangWatch | None = None
    while not done.wait(poll_s):
        policy = read_policy(folder)
        if policy is None:  # rank 0 has not read its spec yet: torchrun's own start-up
            continue
        if watcher is None:
            watcher = HangWatch(policy)
        beats = read_beats(folder)
        found = watcher.observe(beats, time.monotonic())
        if found is not None:
            print(found.line().replace("every rank's stack is above", "every rank's stack "
                                       "follows"), file=sys.stderr, flush=True)
            end_hung_ranks(beats)
            print(found.line(), file=sys.stderr, flush=True)
            return found
    return None
