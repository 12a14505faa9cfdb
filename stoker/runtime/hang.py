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
from dataclasses import dataclass, field, replace
from pathlib import Path

from stoker.runtime import private

HEARTBEAT_DIR_ENV = "STOKER_HEARTBEAT_DIR"
POLICY_FILE = "policy.json"
STACK_FILE = "rank-{rank}.stack"  # a rank's stack dump on SIGUSR2
ENDED_FILE = "ended-by-watchdog"  # written before the watchdog ends the ranks
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
_stack_file = None  # kept open: faulthandler writes to its descriptor


def install(rank: int, policy: HangPolicy) -> None:
    """Start this rank's heartbeat (where ``STOKER_HEARTBEAT_DIR`` is set) and let ``SIGUSR2``
    write every thread's Python stack: to ``rank-<RANK>.stack`` beside the heartbeat, which
    the watchdog prints under the rank's name (forked ranks share thread ids: unlabelled dumps
    on one stderr could not be told apart), else to stderr. Rank 0 also writes ``policy`` for
    the launcher."""
    global _heartbeat, _stack_file
    folder = os.environ.get(HEARTBEAT_DIR_ENV, "").strip()
    if not folder or not os.path.isdir(folder):
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
        return
    _stack_file = os.fdopen(os.open(Path(folder) / STACK_FILE.format(rank=rank),
                                    os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w")
    faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True)
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
    suspects: tuple[str, ...] = ()  # why a rank stands out (:func:`suspects`)

    def summary(self) -> str:
        """What hung and which rank stands out, e.g. ``no rank progressed for 6 s in section
        step (timeout 6 s; rank 0 at step 9, rank 1 at step 9; rank 1 is stopped (SIGSTOP))``."""
        where = ", ".join(f"rank {r} at step {s}" for r, s in sorted(self.steps.items()))
        who = "; ".join(self.suspects) or "no rank stands out: compare their stacks"
        return (f"no rank progressed for {self.idle_s:.0f} s in section {self.section} "
                f"(timeout {self.timeout_s:.0f} s; {where}; {who})")

    def line(self) -> str:
        return (f"stoker.runtime.launch: hang: {self.summary()}; every rank's stack is above; "
                "ending the attempt as an infrastructure failure (exit 137), retried from the "
                "last committed checkpoint")


def suspects(beats: dict[int, Beat], states: dict[int, str]) -> tuple[str, ...]:
    """The ranks that stand out in a hang, and why: a process that is not running
    (``states``: rank -> ``"stopped"``, ``"zombie"`` or ``"gone"``, from
    :func:`rank_states`); else the ranks behind the others' step; else the ranks in another
    section than ``step`` (the others wait for them in a collective). Empty: none stands out."""
    says = {"stopped": "is stopped (SIGSTOP: state T)", "zombie": "has exited (a zombie)",
            "gone": "has no process any more"}
    found = tuple(f"rank {r} {says[s]}" for r, s in sorted(states.items()) if s in says)
    if found or not beats:
        return found
    low, high = min(b.step for b in beats.values()), max(b.step for b in beats.values())
    if low < high:
        return tuple(f"rank {r} is behind (step {b.step}; the others reached {high})"
                     for r, b in sorted(beats.items()) if b.step == low)
    if len({b.section for b in beats.values()}) > 1:
        return tuple(f"rank {r} is in section {b.section} (the others wait for it)"
                     for r, b in sorted(beats.items()) if b.section != "step")
    return ()


def rank_states(beats: dict[int, Beat]) -> dict[int, str]:
    """Each rank's process state (``running``, ``stopped``, ``zombie``, ``gone``), looked up
    only among this process's own descendants (a pid in a heartbeat file is not trusted)."""
    import psutil

    mine = {p.pid: p for p in psutil.Process().children(recursive=True)}
    states = {}
    for rank, beat in beats.items():
        proc = mine.get(beat.pid)
        try:
            status = proc.status() if proc is not None else "gone"
        except psutil.Error:
            status = "gone"
        states[rank] = {psutil.STATUS_STOPPED: "stopped", psutil.STATUS_TRACING_STOP: "stopped",
                        psutil.STATUS_ZOMBIE: "zombie", "gone": "gone"}.get(status, "running")
    return states


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
        # The slowest rank's section: ranks ahead of it wait for it in a collective. Of the
        # ranks at that step, one in eval, checkpoint or startup is the one the others wait
        # for (they wait in a step's collective), so its section's timeout applies.
        slowest = min(b.step for b in beats.values())
        at_slowest = [b.section for b in beats.values() if b.step == slowest]
        section = max([s for s in at_slowest if s != "step"] or at_slowest,
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


def end_hung_ranks(beats: dict[int, Beat], dump_wait_s: float = 1.0,
                   folder: str | Path | None = None) -> None:
    """Dump every rank's stack (``SIGUSR2``), wait ``dump_wait_s`` seconds for the dumps, then
    SIGKILL the ranks; with the heartbeat ``folder``, first mark it (:data:`ENDED_FILE`: a rank
    that sees its peers go then says why) and print each rank's dump under its name. The
    running ranks first: a rank frozen by ``SIGSTOP`` dumps only once continued (``SIGCONT``),
    and with its peers gone it cannot train on in that moment. Only this process's own
    descendants are signalled (a pid in a heartbeat file is not trusted further)."""
    import psutil

    if folder is not None:
        with contextlib.suppress(OSError):
            (Path(folder) / ENDED_FILE).touch()
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
    if folder is not None:
        print_stacks(beats, folder)


def print_stacks(beats: dict[int, Beat], folder: str | Path) -> None:
    """Print each rank's stack dump (``rank-<RANK>.stack``) to stderr under a line naming the
    rank and its pid."""
    for rank, beat in sorted(beats.items()):
        try:
            dump = (Path(folder) / STACK_FILE.format(rank=rank)).read_text(errors="replace")
        except OSError:
            dump = ""
        said = "" if dump.strip() else " none (it wrote no dump within the wait)"
        print(f"stoker.runtime.launch: hang: rank {rank}'s stack (pid {beat.pid}):{said}",
              file=sys.stderr, flush=True)
        if dump.strip():
            print(dump.rstrip("\n"), file=sys.stderr, flush=True)


def ended_by_watchdog() -> bool:
    """Whether this rank's launcher found a hang and is ending the ranks (its line names the
    rank that stands out): a rank that sees its peers go then is not the one to blame them."""
    folder = os.environ.get(HEARTBEAT_DIR_ENV, "").strip()
    return bool(folder) and (Path(folder) / ENDED_FILE).exists()


def watch(folder: str | Path, done, poll_s: float = 0.5) -> Hang | None:
    """Poll the heartbeats in ``folder`` until ``done`` (a ``threading.Event``) is set or the
    attempt hangs; on a hang print its line (naming the ranks that stand out), end the ranks
    (:func:`end_hung_ranks`, which prints their stacks) and return it."""
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
            found = replace(found, suspects=suspects(beats, rank_states(beats)))
            print(found.line().replace("every rank's stack is above", "every rank's stack "
                                       "follows"), file=sys.stderr, flush=True)
            end_hung_ranks(beats, folder=folder)
            print(found.line(), file=sys.stderr, flush=True)
            return found
    return None
