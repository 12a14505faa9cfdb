"""``torchrun`` with Stoker's exit-code contract, for the training image's entrypoint.

``python -m stoker.runtime.launch [torchrun options] -m stoker.runtime SPEC.yaml`` accepts exactly
torchrun's command line (and its ``PET_*`` environment variables) and runs torchrun in-process, then
maps how the workers ended to one exit code that container engines and schedulers can act on:

* 0: every worker finished.
* 75 (EX_TEMPFAIL): preempted, resume me: the first failed worker exited 75 (it committed a
  checkpoint), or this launcher itself received SIGTERM/SIGINT (``docker stop``, spot notice),
  passed it on to the workers, and they committed their stop checkpoint within
  ``--shutdown-timeout`` seconds (a rank records that in the file named by
  ``STOKER_STOP_COMMITTED_FILE``).
* 137: the first failed worker was killed by SIGKILL (OOM killer, node loss), or exited 137 itself
  (an infrastructure failure it found: its data workers stalled, a peer rank is gone; the launcher
  then prints ``rank N ended the attempt itself with exit 137 ..., not a SIGKILL``), or the
  launcher was stopped and the workers were killed before their stop checkpoint committed,
  or this launcher's hang watchdog found no rank progressing (:mod:`stoker.runtime.hang`:
  every rank's stack is dumped, then the ranks are killed).
* anything else: the first failed worker's exit code (a bug or bad config in user code), or
  128 + N when it died of signal N.

Plain torchrun exits 1 for all of these, which would make a preemption look like a bug.

How the ranks start (``STOKER_WORKER_START``):

* ``fork``: this process imports the runtime (torch, ``torch._dynamo``, the trainer) once, then
  torchrun forks every rank from it (its ``fork`` start method, with the runtime's ``main`` as
  the entrypoint). A rank skips the imports a fresh interpreter pays: about 4 s of an attempt's
  start-up on 2 CPU cores, and 2-5 CPU-s per rank. The default where no GPU device is present
  (no ``/dev/nvidia*``, ``/dev/kfd`` or ``/dev/dxg``): CUDA must never be initialised before a
  fork, and this path has not been verified on a GPU yet.
* ``exec``: every rank is a fresh ``python -u -m stoker.runtime SPEC`` process (plain
  torchrun). The default on a machine with a GPU device.

Either way a rank names itself ``stoker-rank<RANK>`` (the process name ``ps -o comm``, ``pgrep``
and ``top`` show), so one rank can be found and signalled.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from stoker.runtime import EXIT_INFRASTRUCTURE, EXIT_PREEMPTED, hang, private
from stoker.runtime.attempt_tmp import (  # noqa: F401 - re-exported: the local launcher's names
    ATTEMPT_TMP_ENV,
    MAX_TEMPORARY_FOLDER,
    attempt_folder,
    attempt_temporaries,
)
from stoker.runtime.hang import HEARTBEAT_DIR_ENV
from stoker.runtime.preemption import STOP_COMMITTED_ENV, STOP_COMMITTED_FILE, completed_at

RANK_ENDED = re.compile(r"stoker\.runtime\.launch: rank (\d+) ended the attempt itself")


def rank_ended_line(rank: int) -> str:
    """The launcher's line for a first failure that was rank ``rank`` exiting 137 on its own (a
    stall or a lost peer it found), not a kill; :data:`RANK_ENDED` finds it in the output."""
    return (f"stoker.runtime.launch: rank {rank} ended the attempt itself with exit 137 (an "
            "infrastructure failure it found: see its line above), not a SIGKILL")


def exit_code_for(exitcode: int) -> int:
    """Map a worker's exit status (negative = killed by that signal) to a shell exit code."""
    if exitcode < 0:
        return 128 + (-exitcode)
    return exitcode


WORKER_START_ENV = "STOKER_WORKER_START"
WORKER_STARTS = ("fork", "exec")
RUNTIME_MODULE = "stoker.runtime"


def gpu_device_present(dev: Path = Path("/dev")) -> bool:
    """Whether a GPU device file exists under ``dev``: NVIDIA (``nvidia0``, ...), AMD
    (``kfd``) or WSL2's GPU (``dxg``). Without one no CUDA or ROCm device can be visible, so
    this answers "no GPU" without importing torch or initialising a driver."""
    return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists() or (dev / "dxg").exists()


def worker_start(environ: dict[str, str] | None = None, dev: Path = Path("/dev")) -> str:
    """How the ranks start: ``fork`` or ``exec`` (see the module docstring).

    ``STOKER_WORKER_START`` (``fork``, ``exec`` or ``auto``, the default) decides; ``auto`` is
    ``exec`` when a GPU device file exists under ``dev`` (NVIDIA, AMD or WSL2's; see
    ``gpu_device_present``), else ``fork``. No CUDA call is made to find out.

    Raises:
        ValueError: naming ``STOKER_WORKER_START`` and its allowed values.
    """
    value = (os.environ if environ is None else environ).get(WORKER_START_ENV, "auto")
    value = value.strip().lower() or "auto"
    if value in WORKER_STARTS:
        return value
    if value != "auto":
        raise ValueError(f"{WORKER_START_ENV}={value!r}: use fork, exec or auto")
    return "exec" if gpu_device_present(dev) else "fork"


STANDBY_FLAG = "--standby"
# An attempt that ended this way is usually retried at once: the launcher stays, warm, for it.
PARKABLE_EXITS = (EXIT_PREEMPTED, 137)
PARKED_MARKER = "stoker.runtime.launch: parked "  # + the request's token + " exit " + code
_signalled: list[int] = []  # signals this launcher itself received (a stop from outside)


def standby(stdin=None, stdout=None) -> int:
    """``python -m stoker.runtime.launch --standby``: import what an attempt imports before its
    ranks start (torch, torchrun, and for the ``fork`` start the runtime), then wait for the
    attempt on stdin: one JSON line ``{"argv": [torchrun options ...], "env": {...}}``, with an
    optional ``"park": TOKEN``. The environment replaces this process's (the ranks inherit it)
    and ``main(argv)`` runs.

    With ``park``, an attempt whose ranks ended it with a code of ``PARKABLE_EXITS`` (75:
    preempted, 137: infrastructure), which is retried at once, does not end the process (unless
    the launcher itself was signalled: a stop from outside ends it): its ranks are gone,
    it writes ``PARKED_MARKER + TOKEN + " exit " + CODE`` as its last line on stdout and waits
    for the next attempt's line, warm (a signal ends it while it waits). Any other exit code
    ends it with that code.

    End of input before a line (the orchestrator discarded the standby, or died) ends the
    process with 0 and nothing run. See :class:`stoker.launch.local.Standby`."""
    import json

    from stoker.runtime import startup_gc

    startup_gc.pause()  # (already, in one forked from `stoker run`)
    import torch.distributed.run  # noqa: F401  (what _run_torchrun imports)

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    with contextlib.suppress(ValueError):  # main() reports a bad value once the attempt arrives
        if worker_start() == "fork":
            _warm_up()
            warm_up_tracking()
    startup_gc.settle()  # before any attempt: its ranks collect cycles as usual
    from stoker.runtime.preemption import title_process

    title_process()  # now: each attempt below replaces the environment, then names its job
    while True:
        line = stdin.readline()
        if not line.strip():
            return 0
        request = json.loads(line)
        os.environ.clear()
        os.environ.update(request["env"])
        _signalled.clear()
        code = main(list(request["argv"]))
        token = request.get("park")
        if not token or code not in PARKABLE_EXITS or _signalled:
            return code  # (stopped from outside, this launcher is not kept: stop means stop)
        # torchrun's handlers raise into its agent, which is done: a signal now just ends us.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        sys.stderr.flush()  # the same pipe: everything the attempt wrote comes first
        print(f"{PARKED_MARKER}{token} exit {code}", file=stdout, flush=True)


_TIMER_MODULE = "torch/distributed/elastic/rendezvous/utils.py"


def _from_torch_timer_stop(unraisable) -> bool:
    """Whether ``unraisable`` is torchrun's rendezvous keep-alive timer failing to join itself:
    its ``weakref.finalize`` (``_PeriodicTimer._stop_thread``: set the stop event, then join
    the thread) ran in the timer's own thread, when a garbage collection there freed the
    timer. The stop event is already set, so the thread ends all the same; only the join
    raises ``RuntimeError("cannot join current thread")``, which Python prints as ``Exception
    ignored in ...`` with a traceback (a CI run saw it as a budget stop ended the launcher)."""
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == "cannot join current thread"):
        return False
    frame = unraisable.exc_traceback
    while frame is not None:
        code = frame.tb_frame.f_code
        if code.co_name == "_stop_thread" and code.co_filename.replace(os.sep, "/").endswith(
                _TIMER_MODULE):
            return True
        frame = frame.tb_next
    return False


def quiet_timer_self_join() -> None:
    """Leave out of stderr the one harmless error of :func:`_from_torch_timer_stop`; every
    other unraisable exception goes to the hook installed before (Python's: printed)."""
    previous = sys.unraisablehook
    if getattr(previous, "stoker_timer_filter", False):
        return

    def hook(unraisable) -> None:
        if not _from_torch_timer_stop(unraisable):
            previous(unraisable)

    hook.stoker_timer_filter = True
    sys.unraisablehook = hook


def main(argv: list[str] | None = None) -> int:
    quiet_timer_self_join()
    try:
        start = worker_start()
    except ValueError as e:
        print(f"stoker.runtime.launch: {e}", file=sys.stderr, flush=True)
        return 2
    argv = sys.argv[1:] if argv is None else argv
    _name_the_job(argv)
    with attempt_temporaries() as tmp:
        beats = tmp / "heartbeats"  # each rank's (stoker.runtime.hang), read by the watchdog
        private.make_dir(beats)
        os.environ[HEARTBEAT_DIR_ENV] = str(beats)  # the workers inherit it
        given = os.environ.get(STOP_COMMITTED_ENV, "").strip()
        if given:  # the caller's (the local launcher: in the job folder, which the lease guards)
            marker = Path(given)
            marker.unlink(missing_ok=True)  # an earlier attempt's: not this stop's
            try:
                return _run_torchrun(argv, marker, start)
            finally:
                with contextlib.suppress(OSError):
                    marker.unlink(missing_ok=True)
        marker = tmp / STOP_COMMITTED_FILE
        os.environ[STOP_COMMITTED_ENV] = str(marker)  # the workers inherit it
        return _run_torchrun(argv, marker, start)


def _name_the_job(argv: list[str]) -> None:
    """Put the job this attempt trains in the launcher's command line (``ps -eo args``:
    ``stoker-launch job <JOB>: python -m stoker.runtime.launch ...``): a standby launcher
    started before its job was known says ``--standby`` until then, and a forked rank inherits
    the line until it names itself."""
    from stoker.runtime.preemption import spec_job, title_process

    if RUNTIME_MODULE in argv[:-1]:
        spec = argv[argv.index(RUNTIME_MODULE) + 1]
        title_process(f"stoker-launch job {spec_job(spec)}: python -m stoker.runtime.launch "
                      + " ".join(argv))


def _runs_the_runtime(args) -> bool:
    """Whether torchrun's command line runs ``python -m stoker.runtime ...``."""
    return (args.module and not args.no_python and not args.run_path
            and args.training_script == RUNTIME_MODULE)


def _launch_forked(args) -> None:
    """torchrun's ``run(args)``, with the ranks forked from this warm process.

    The same rendezvous defaults as ``torch.distributed.run.run`` (``--standalone``, a
    single-node static rendezvous without an endpoint), then ``elastic_launch`` with the
    runtime's entry point and the ``fork`` start method.
    """
    import uuid

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_min_max_nnodes

    single_static = (args.rdzv_backend == "static" and not args.rdzv_endpoint
                     and args.master_port is None and parse_min_max_nnodes(args.nnodes)[1] == 1)
    if args.standalone or single_static:
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _cmd, _cmd_args = config_from_args(args)
    config.start_method = "fork"
    _warm_up()
    # The imported modules' objects into the permanent generation: a forked rank's collections
    # no longer walk them (and copy their pages). Bare training, forked / exec'd ranks, 4 pairs
    # on 2 cores: 0.966 without, 0.987 with.
    gc.freeze()
    elastic_launch(config=config, entrypoint=forked_rank)(*args.training_script_args)


def _warm_up() -> None:
    """Import what every rank imports before its first step, once, before the fork."""
    import torch._dynamo  # noqa: F401  (torch.optim and deterministic mode load it)

    import stoker.runtime.__main__  # noqa: F401
    import stoker.runtime.imagefolder  # noqa: F401
    import stoker.runtime.trainer  # noqa: F401

    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
        stream.flush()


# What rank 0's tracking imports when it opens the MLflow run: the client, the sqlite store (its
# module imports alembic and SQLAlchemy's models) and the system metrics monitor. On 2 cores,
# rank 0 importing them (~1.8 CPU-s) while it trained slowed its steps, and rank 1 waited in
# all-reduce: the default job's steps took 4.9 s in `stoker run` against 3.1 s bare (5.0 s
# for a bare torchrun that tracked).
TRACKING_IMPORTS = ("mlflow", "mlflow.store.tracking.sqlalchemy_store",
                    "mlflow.system_metrics.system_metrics_monitor", "stoker.runtime.tracking")


def warm_up_tracking() -> None:
    """A standby's warm-up, after :func:`_warm_up`: import ``TRACKING_IMPORTS`` (and configure
    MLflow's SQLAlchemy models) before the fork. Even when an attempt is already waiting this
    is the cheaper place: rank 0 importing them beside 2 training ranks on 2 cores slowed the
    steps by more than the import delays the attempt (measured both ways: steps 4.8 s against
    3.6 s). Imports only: no store, engine or Python thread is made, so nothing is shared
    across the fork (pyarrow, which MLflow imports, starts its allocator's native background
    thread, as in any process that imports MLflow). An image without MLflow skips them (rank
    0 says what fails when it tracks)."""
    import importlib

    try:
        for name in TRACKING_IMPORTS:
            importlib.import_module(name)
        from sqlalchemy.orm import configure_mappers

        configure_mappers()
    except Exception:  # noqa: BLE001 - rank 0 imports them again and says what failed
        pass
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def _apply_omp_num_threads() -> None:
    """Give a forked rank the intra-op threads ``OMP_NUM_THREADS`` asks for (torchrun sets 1 for
    several ranks per node). OpenMP read the variable when this launcher imported torch, before
    torchrun set it: without this, each of 2 forked ranks ran 2 threads on 2 cores and trained
    3.7x slower than exec'd ranks (``python -m stoker.runtime.launch`` without the variable, as
    a CPU container's entrypoint runs)."""
    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def forked_rank(*argv: str) -> None:
    """One rank, forked from the warm launcher: the runtime's ``main(argv)``.

    A non-zero exit code ends the process at once with that code (torchrun reads it as for an
    exec'd rank). Exit 0 returns: torchrun's worker wrapper then reports the return value and
    waits until the launcher has read every rank's; only after that does the process end, with
    ``os._exit(0)`` (a multiprocessing finalizer: no interpreter shutdown, no wait for a thread
    left behind). Ending it earlier would leave the launcher waiting on the rank forever.
    """
    from multiprocessing import util

    from stoker.runtime.__main__ import exit_now
    from stoker.runtime.__main__ import main as rank_main
    from stoker.runtime.preemption import STOP_SIGNALS, stop_signal_received

    for handler in logging.root.handlers[:]:  # the rank configures its own ([rankN] lines)
        logging.root.removeHandler(handler)
    _apply_omp_num_threads()
    code = rank_main(list(argv))
    if code:
        exit_now(code)
    # Done, and nothing of the rank is left to save. While the wrapper waits, a stop signal must
    # end it: the rank's handler only sets a flag nothing reads any more, so when a peer died
    # near the end (torchrun then closes every rank with SIGTERM, perhaps while this one still
    # logged its model) the launcher waited 30 s, then SIGKILLed this rank. One that came
    # already is raised again. Ended by the signal, the rank reads as a failure to torchrun,
    # never as an exit 0 whose return value the launcher would wait for.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    if (sig := stop_signal_received()) is not None:
        os.kill(os.getpid(), sig)
    # Runs when the worker wrapper returns, before the threads are joined.
    util.Finalize(None, exit_now, args=(0,), exitpriority=100)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def _run_torchrun(argv: list[str], marker: Path, start: str = "exec") -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    _act_on_the_first_stop_signal_only()
    done, hung = threading.Event(), []
    folder = os.environ.get(HEARTBEAT_DIR_ENV, "")
    watchdog = threading.Thread(target=lambda: hung.append(hang.watch(folder, done)),
                                name="stoker-hang-watchdog", daemon=True)
    if folder:
        watchdog.start()
    try:
        if start == "fork" and _runs_the_runtime(args):
            _launch_forked(args)
        else:
            run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if _stop_watchdog(watchdog, done, hung):
            return EXIT_INFRASTRUCTURE  # the watchdog ended the ranks: its line said why
        if failure.exitcode == EXIT_INFRASTRUCTURE:
            # The rank chose 137 (its data workers stalled, a peer was gone): a shell, Docker
            # and the attempt line would read 137 as a SIGKILL; say that nothing was killed.
            print(rank_ended_line(rank), file=sys.stderr, flush=True)
        return exit_code_for(failure.exitcode)
    except SignalException as e:
        if not _signalled:
            _signalled.append(int(e.sigval))
        if e.sigval not in (signal.SIGTERM, signal.SIGINT):
            return 128 + int(e.sigval)
        if completed_at(marker):  # the ranks had completed training: nothing was stopped
            print(f"stoker.runtime.launch: {signal.Signals(e.sigval).name} after the workers "
                  "completed training: nothing to stop", file=sys.stderr, flush=True)
            return 0
        if marker.exists():
            return EXIT_PREEMPTED
        # No marker: a rank failed while stopping (its error is in the lines above), or the
        # ranks ran out of the grace torchrun gives them; both lose the steps since the last
        # committed checkpoint.
        print(f"stoker.runtime.launch: stopped by {signal.Signals(e.sigval).name} but the "
              "workers ended before their stop checkpoint committed (a rank failed while "
              "stopping, see its error above; or they ran out of train.preemption_grace_s): "
              "exit 137", file=sys.stderr, flush=True)
        return 137
    finally:
        _stop_watchdog(watchdog, done, hung)
    return 0


def _stop_watchdog(watchdog: threading.Thread, done: threading.Event, hung: list) -> bool:
    """Stop the hang watchdog; returns whether it found a hang (and ended the ranks)."""
    done.set()
    if watchdog.is_alive():
        watchdog.join()
    return any(hung)


def _act_on_the_first_stop_signal_only() -> None:
    """Make torchrun act on the first stop signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) this
    launcher gets in an attempt and only record the later ones (in ``_signalled``).

    torchrun's handler raises ``SignalException`` at every signal: the first makes it stop its
    ranks and wait up to its shutdown timeout for their stop checkpoint; a second one, raised
    inside that wait, ended the launcher at once and its ranks were killed before they had
    committed. Repeats are not a user's "now": Linux sends the parent-death signal
    (``PR_SET_PDEATHSIG``) again at each thread of a ``kill -9``-ed multithreaded orchestrator
    that the launcher is handed to on the way (1 to 3 SIGTERMs seen). What stops at once is
    SIGKILL (the orchestrator's second Ctrl-C sends it to the whole tree).

    A rank forked from this launcher keeps the handler until its runtime installs its own. A
    stop signal in between (the orchestrator signals every process of the tree, the rank
    included, as it is being forked) ends that rank at once, exit 128 + the signal: it has
    trained nothing, and torchrun's handler would raise inside the fork's own hooks, which
    swallow the exception (``Exception ignored in: _after_at_fork_child_reinit_locks``), so the
    stop was lost and the rank trained on (trial: for 30 s, until its peer was gone)."""
    from torch.distributed.elastic.multiprocessing import api

    if getattr(api._terminate_process_handler, "first_only", False):
        return
    torchrun_handler = api._terminate_process_handler
    launcher = os.getpid()

    def first_only(signum: int, frame) -> None:
        if os.getpid() != launcher:  # a rank forked from the launcher, before its handlers
            os._exit(128 + int(signum))
        _signalled.append(int(signum))
        if len(_signalled) == 1:
            torchrun_handler(signum, frame)

    first_only.first_only = True
    api._terminate_process_handler = first_only  # what torchrun registers when ranks start


def exit_after(run: Callable[[], int]) -> NoReturn:
    """Run the launcher (``run`` returns its exit code), then end the process with
    ``os._exit``, whatever happened: never through the interpreter's shutdown.

    The ranks are gone when ``run`` returns; torch's finalizers would hold the exit code back
    for seconds. And a launcher in interpreter shutdown joins its forked children
    (multiprocessing's exit function) while a forked rank waits for the launcher to read its
    result: both wait forever, an orphan pair that outlived its orchestrator (seen once after a
    ``kill -9`` of ``stoker run``). So an exception out of ``run`` (a write to the dead
    orchestrator's pipe) is printed where it can be and ends the process with 1; a failing
    flush is ignored; and any process of this launcher still alive then is killed (SIGKILL),
    DataLoader workers included."""
    code = 1
    try:
        code = run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - said and turned into an exit code
        with contextlib.suppress(Exception):
            import traceback

            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        _kill_descendants()
        os._exit(code)


def _kill_descendants() -> None:
    import psutil

    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()


if __name__ == "__main__":
    exit_after(lambda: standby() if sys.argv[1:] == [STANDBY_FLAG] else main())
