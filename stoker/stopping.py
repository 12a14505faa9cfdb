"""How ``stoker run`` stops: Ctrl-C, SIGTERM and SIGHUP end it with one defined outcome.

The first SIGINT (Ctrl-C), SIGTERM or SIGHUP (the terminal closed) raises :class:`Interrupted` in
the main thread, where the flow runs: the launcher's ``finally`` passes SIGTERM to the training
tree, the ranks commit a stop checkpoint within ``train.preemption_grace_s``, the MLflow run ends
KILLED, the flow run ends Cancelled, and ``stoker run`` exits 130 (SIGINT), 143 (SIGTERM) or 129
(SIGHUP). A second signal while that is under way kills every process ``stoker run`` started at
once and exits with the same code.

No Prefect here; :func:`stop_reason` tells Prefect glue why the run was stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil

from stoker.terminal import after_echo

EXIT_STOPPED = 3  # the cost guard or a user stopped the job (stop-requested.json): not retried
EXIT_BUDGET = 5  # the job's budget (train.max_cost_usd / max_duration) stopped it
EXIT_SIGINT = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_SIGTERM = 143  # 128 + SIGTERM
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_received: list[int] = []
_installed: list[bool] = []  # install() was called in this process (``stoker run``)
_outcome: list[str] = []  # what the stop left of the job (note_outcome)
_done: list[str] = []  # the job is done (note_done): its summary, while not yet said
_after_done: list[int] = []  # stop signals received once the job was done
_hooks: list[Callable[[str], None]] = []  # on_stop: run before the training tree is signalled
_training_probes: list[Callable[[], bool]] = []  # ranks_training: whether ranks train now
_interrupt_hooks: list[Callable[[BaseException], None]] = []  # on_interrupt
_probes: list[Callable[[], str | None]] = []  # outcome_probe: asked after a second signal
_kill_hooks: list[Callable[[str], None]] = []  # on_kill: run after a second signal's kill
_at_once_hooks: list[Callable[[], None]] = []  # on_stop_at_once: before a second signal's kill
KILL_HOOKS_WAIT_S = 3.0  # at most, for the on_kill hooks, before the process ends


class Interrupted(KeyboardInterrupt):
    """``stoker run`` received SIGINT or SIGTERM; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def stop_reason() -> str | None:
    """Why this process is stopping (``"SIGINT (Ctrl-C)"``, ``"SIGTERM"``, ``"SIGHUP (terminal
    closed)"``), or None."""
    if not _received:
        return None
    name = signal.Signals(_received[0]).name
    return {"SIGINT": "SIGINT (Ctrl-C)", "SIGHUP": "SIGHUP (terminal closed)"}.get(name, name)


def note_outcome(what: str) -> None:
    """Record what the stop left of the job (``"job digits-3f2a: its ranks committed a stop
    checkpoint at step 120"``): ``stoker run``'s last line says it (:func:`stopped_line`)."""
    _outcome[:] = [what]


def note_done(summary: str = "") -> None:
    """The job is done and recorded (marked done, its model registered): from here on a stop
    signal has nothing left to stop or to resume, and rerunning the command would train a new
    job (trial: SIGTERM right after the flow run's Completed said "stopped ...; run the same
    command again", and the rerun trained and registered another version). The first signal is
    said and otherwise ignored: the command ends as done (exit 0, its summary last); a second
    one ends it at once, exit 0, after writing ``summary`` (the command's summary, JSON) when
    :func:`summary_said` has not been called since. Call again with the summary once known."""
    _done[:] = [summary]


def summary_said() -> None:
    """The done job's summary is on stdout: a second signal need not write it."""
    if _done:
        _done[:] = [""]


def done_line(signum: int) -> str:
    """What ``stoker run`` says for a stop signal once its job is done (:func:`note_done`)."""
    name = signal.Signals(signum).name
    name = {"SIGINT": "SIGINT (Ctrl-C)", "SIGHUP": "SIGHUP (terminal closed)"}.get(name, name)
    return (f"stoker run: {name} after the job was done: nothing to stop and nothing to run "
            "again; ending as done")


def stopped_line() -> str:
    """``stoker run``'s last line after a stop: the signal, what the ranks did (steps lost, if
    any: see :func:`note_outcome`), and how to resume. A stop before any training attempt (the
    data pull, the image build) left nothing to resume: the same command runs again (trial:
    a Ctrl-C during the pull said "run the same command to resume")."""
    stopped = f"stoker run: stopped by {stop_reason() or 'an interrupt'}"
    if not _outcome:
        return f"{stopped}; run the same command again"
    return f"{stopped}; {_outcome[0]}; run the same command to resume"


def kill_descendants() -> list[int]:
    """SIGKILL every process this one started (and their process groups); returns the pids."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)  # a child that leads its own session
    return [c.pid for c in children]


def on_stop(hook: Callable[[str], None]) -> contextlib.AbstractContextManager[None]:
    """While inside (the training task, while ranks run), call ``hook(stop_reason())`` when the
    first stop signal arrives, before :class:`Interrupted` unwinds to the launcher that signals
    the training tree (e.g. to record for the ranks who stops them). A hook that raises is
    ignored. While one is registered, the line printed at once says the ranks save first."""
    return _registered(_hooks, hook)


def ranks_training(probe: Callable[[], bool]) -> contextlib.AbstractContextManager[None]:
    """While inside, the line the first stop signal prints asks ``probe()`` whether ranks
    train now (called in the signal handler: a small local read). Without one registered, or
    when one raises, they are taken to train. Trial: a Ctrl-C while torchrun was still
    starting said the ranks commit a stop checkpoint first, before any rank existed."""
    return _registered(_training_probes, probe)


def _ranks_train() -> bool:
    if not _training_probes:
        return True
    for probe in list(_training_probes):
        try:
            if probe():
                return True
        except Exception:
            return True
    return False


def on_interrupt(hook: Callable[[BaseException], None]) -> contextlib.AbstractContextManager[None]:
    """While inside, call ``hook(error)`` when a launcher's wait for its attempt is interrupted
    by ``error`` (:func:`interrupted`: a stop signal, a Prefect cancel's ``TerminationSignal``, a
    timeout), before the launcher signals the training tree: e.g. to record for the ranks who
    stops them where no handler of ours saw a signal (a worker's flow process, where SIGTERM
    belongs to Prefect). A hook that raises is ignored."""
    return _registered(_interrupt_hooks, hook)


def on_stop_at_once(hook: Callable[[], None]) -> contextlib.AbstractContextManager[None]:
    """While inside (the training task), a second stop signal first calls ``hook()``, at once
    and in the signal handler: a small local write (the job's record that its run was stopped
    at once on purpose, not killed). A hook that raises is ignored."""
    return _registered(_at_once_hooks, hook)


def on_kill(hook: Callable[[str], None]) -> contextlib.AbstractContextManager[None]:
    """While inside (a flow body), a second stop signal, which kills the training tree at once
    and ends the process, first calls ``hook(stop_reason())`` (e.g. to record the flow run
    Cancelled: no one else would, and it stayed Running). The hooks run in a thread and get
    :data:`KILL_HOOKS_WAIT_S` in all (a server that does not answer does not hold the exit
    back); a hook that raises is ignored."""
    return _registered(_kill_hooks, hook)


@contextlib.contextmanager
def _registered(hooks: list, hook: Callable) -> Iterator[None]:
    """``hook`` in ``hooks`` while inside."""
    hooks.append(hook)
    try:
        yield
    finally:
        hooks.remove(hook)


def _run_kill_hooks(reason: str) -> None:
    """Call the :func:`on_kill` hooks in a daemon thread; wait at most KILL_HOOKS_WAIT_S."""
    if not _kill_hooks:
        return
    import threading

    def run() -> None:
        for hook in list(_kill_hooks):
            with contextlib.suppress(Exception):
                hook(reason)

    thread = threading.Thread(target=run, name="stoker-on-kill", daemon=True)
    thread.start()
    thread.join(KILL_HOOKS_WAIT_S)


def outcome_probe(probe: Callable[[], str | None]) -> contextlib.AbstractContextManager[None]:
    """While inside (the training task), a second stop signal, which kills the training tree at
    once, asks ``probe()`` what the first stop had already left of the job when
    :func:`note_outcome` has not said it yet (``"job digits-1: its ranks committed a stop
    checkpoint at step 757"``; None: nothing recorded). A probe that raises is ignored."""
    return _registered(_probes, probe)


def interrupted(error: BaseException) -> None:
    """For launchers: their wait for an attempt was interrupted by ``error`` and they are about
    to stop its process tree; runs the :func:`on_interrupt` hooks. Never raises."""
    for hook in list(_interrupt_hooks):
        with contextlib.suppress(Exception):
            hook(error)


# The same signal again within this many seconds of the first is the same stop, delivered
# twice: GNU ``timeout`` sends its signal to the command and then to its whole process group
# (trial: ``timeout 300 stoker run`` got one SIGINT as two, and the second one's "stopped at
# once" gave up the stop checkpoint). A person's second Ctrl-C comes later than this.
DUPLICATE_WINDOW_S = 0.1
_first_at: list[float] = []  # time.monotonic() of the first stop signal


def _duplicate(signum: int, first: int) -> bool:
    """Whether ``signum`` repeats the first stop signal ``first`` within DUPLICATE_WINDOW_S."""
    return (signum == first and bool(_first_at)
            and time.monotonic() - _first_at[0] < DUPLICATE_WINDOW_S)


def _handle(signum: int, _frame) -> None:
    if _done and not _received:  # nothing left to stop (note_done)
        if _after_done and _duplicate(signum, _after_done[0]):
            return
        _first_at[:] = _first_at or [time.monotonic()]
        _after_done.append(signum)
        if len(_after_done) == 1:
            with contextlib.suppress(OSError):
                os.write(2, f"{after_echo(signum)}{done_line(signum)}\n".encode())
            return
        if _done[0]:
            with contextlib.suppress(OSError):
                os.write(1, f"{_done[0]}\n".encode())
        os._exit(0)
    if _received and _duplicate(signum, _received[0]):
        return
    _received.append(signum)
    if len(_received) == 1:
        _first_at[:] = [time.monotonic()]
        # At once: the stop checkpoint can take a while (a slow save, a stalled rank), and a
        # user who sees nothing presses Ctrl-C again, which gives it up.
        training = "" if not _hooks else (  # on_stop: the training task is waiting on them
            ": the ranks commit a stop checkpoint first (up to train.preemption_grace_s); a "
            "second Ctrl-C (any stop signal) stops at once without it" if _ranks_train()
            else ": no rank trains yet, so there is no stop checkpoint to wait for")
        with contextlib.suppress(OSError):
            os.write(2, f"{after_echo(signum)}stoker run: stopping ({stop_reason()})"
                        f"{training}\n".encode())
        for hook in list(_hooks):
            with contextlib.suppress(Exception):
                hook(stop_reason())
        raise Interrupted(signum)
    # Second signal: the user does not want to wait for the stop checkpoint.
    for hook in list(_at_once_hooks):
        with contextlib.suppress(Exception):
            hook()
    kill_descendants()
    line = second_signal_line()  # before the hooks: what the ranks had left when killed
    _run_kill_hooks(stop_reason() or "an interrupt")
    with contextlib.suppress(OSError):
        os.write(2, f"{after_echo(signum)}{line}\n".encode())
    os._exit(128 + _received[0])


def second_signal_line() -> str:
    """``stoker run``'s last line after a second stop signal: what the first stop had already
    left when the ranks' end is known (:func:`note_outcome`: a third trial's second Ctrl-C came
    after the stop checkpoint had committed, and the line said there was none), else that it
    did not wait for the stop checkpoint. Between the ranks' end and that note, the
    :func:`outcome_probe` says what they recorded (a fourth trial's second Ctrl-C came then).
    Once the first stop is recorded (the note), the line is :func:`stopped_line`'s, as the flow
    run's state says (fifth trial: "stopped at once" beside Prefect's "stopped by SIGINT")."""
    if _outcome:
        return stopped_line()
    what = None
    for probe in list(_probes):
        with contextlib.suppress(Exception):
            what = probe()
        if what:
            break
    if what:
        return (f"stoker run: stopped at once (second signal); {what}; run the same "
                "command to resume")
    return ("stoker run: stopped at once (second signal), without waiting for the stop "
            "checkpoint; run the same command to resume from the last committed checkpoint")


def install() -> dict[int, Any]:
    """Route SIGINT, SIGTERM and SIGHUP of this process to the stop sequence (main thread
    only). Returns the handlers it replaced, for :func:`uninstall`."""
    _received.clear()
    _outcome.clear()
    _done.clear()
    _after_done.clear()
    _first_at.clear()
    _installed[:] = [True]
    return {sig: signal.signal(sig, _handle) for sig in STOP_SIGNALS}


def uninstall(previous: dict[int, Any]) -> None:
    """Give the signals back to the handlers :func:`install` replaced (a command that ends
    before any stop sequence could matter: bad input, a busy job)."""
    _installed.clear()
    for sig, handler in previous.items():
        with contextlib.suppress(ValueError, TypeError):  # not the main thread; not settable
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def rearm() -> None:
    """Inside a flow body: take SIGTERM back from Prefect's bridge if :func:`install` ran here.

    Prefect's flow engine replaces the SIGTERM handler for the flow's duration (its
    ``TerminationSignal`` ends the flow Crashed and only then passes the signal on), so a
    SIGTERM to ``stoker run`` would otherwise not be known as a stop while the training tree
    commits its stop checkpoint. A worker's flow process never calls :func:`install`: there
    SIGTERM stays Prefect's cancel signal. No-op outside the main thread.
    """
    if not _installed:
        return
    with contextlib.suppress(ValueError):  # not the main thread
        for sig in STOP_SIGNALS:
            signal.signal(sig, _handle)


def stop_exit_code() -> int:
    """128 + the first stop signal received (130 when none was: a plain KeyboardInterrupt)."""
    return 128 + _received[0] if _received else EXIT_SIGINT


def exit_now(code: int) -> None:
    """Flush output and logs, then end the process at once with ``code`` (``os._exit``).

    For the end of a command whose work is recorded: the interpreter's finalizers (exit hooks
    of Prefect's services, torch) add seconds and can do nothing useful any more.
    """
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def stopped_exit_code(error: BaseException) -> int:
    """``stoker run``'s code for a :class:`~stoker.jobs.stop_request.TrainingStopped`: 5 when
    the job's budget stopped it (``error.by == "budget"``), else 3."""
    return EXIT_BUDGET if getattr(error, "by", None) == "budget" else EXIT_STOPPED
