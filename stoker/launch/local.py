"""Run torchrun on this host as one attempt, and terminate process trees that must not outlive it.

No Prefect here. ``LocalLauncher.run`` has the launcher interface of :mod:`stoker.launch.factory`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import psutil

from stoker.runtime.launch import (
    ATTEMPT_TMP_ENV,
    PARKED_MARKER,
    STANDBY_FLAG,
    attempt_folder,
    exit_code_for,
)
from stoker.runtime.preemption import (
    STOP_COMMITTED_ENV,
    STOP_COMMITTED_FILE,
    die_with_parent,
    name_process,
    title_process,
)
from stoker.stopping import interrupted


def terminate_tree(pid: int, grace_s: float) -> list[int]:
    """SIGTERM ``pid`` and all its descendants, SIGKILL whatever is left after ``grace_s``.

    Also kills the process group ``pid`` leads (the launcher starts torchrun in its own session),
    which catches processes that re-parented away from the tree. Returns the pids signalled.
    """
    try:
        parent = psutil.Process(pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGTERM)
    _gone, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    return [p.pid for p in procs]


# Environment variables read when torch, its OpenMP/BLAS, CUDA, NCCL or gloo runtimes or the
# interpreter start: a standby launcher started with other values than an attempt's is not used
# for it (the attempt starts cold). Others (Prefect's, MLflow's, Stoker's) are handed over.
IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "BLIS_", "CUDA_", "NCCL_",
                   "NVIDIA_", "HIP_", "ROCM_", "HSA_", "GLOO_", "TORCH", "PYTORCH_", "LD_",
                   "PYTHON", "MALLOC_", "STOKER_WORKER_START")


def _import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


class ForkedStandby:
    """A ``subprocess.Popen``-like handle (``pid``, ``args``, ``stdin``, ``stdout``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``: what a standby's owner
    uses) on a standby launcher forked from this process rather than started as a new
    interpreter (see :func:`can_fork_standby`).

    The child is set up as ``Popen(..., start_new_session=True, preexec_fn=die_with_parent)``
    sets up ``python -m stoker.runtime.launch --standby``: its own session, SIGTERM when this
    process dies, stdin and merged stdout/stderr on pipes, ``env`` as its whole environment,
    default signal dispositions, no log handler or stream wrapper of this process. It then
    runs :func:`stoker.runtime.launch.standby` and ends with ``os._exit``. What it inherits
    is the modules this process imported: MLflow's client and store, which a forked rank 0
    needs, are imported once (here) instead of once here and once in the launcher: about
    2 CPU-s of the default job's ``stoker run`` on 2 cores (``bench_goodput``).
    """

    def __init__(self, env: dict[str, str]):
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
            with contextlib.suppress(Exception):
                stream.flush()
        ready_r, ready_w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(ready_r)
            _become_standby(stdin_r, stdout_w, (stdin_w, stdout_r), env, parent, ready_w)
        for fd in (stdin_r, stdout_w, ready_w):
            os.close(fd)
        # Returned once the child leads its session and dies with this process, as Popen
        # returns after the exec: no signal to this process group reaches it after this.
        os.read(ready_r, 1)  # b"" if it died first
        os.close(ready_r)
        self.pid, self.returncode = pid, None
        self.args = [sys.executable, "-m", "stoker.runtime.launch", "--standby"]
        self.stdin = open(stdin_w, "w", encoding="utf-8")  # noqa: SIM115 - closed by its owner
        self.stdout = open(stdout_r, encoding="utf-8", errors="replace")  # noqa: SIM115

    def poll(self) -> int | None:
        """The exit code (-N for a death by signal N) once it ended, else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: as Popen, say 0
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end and return the exit code.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _become_standby(stdin_fd: int, stdout_fd: int, parent_ends: tuple[int, int],
                    env: dict[str, str], parent: int, ready_fd: int) -> NoReturn:
    """In a child just forked by :class:`ForkedStandby`: become the standby launcher."""
    try:
        os.setsid()
        die_with_parent()
        if os.getppid() != parent:  # the parent died before PR_SET_PDEATHSIG was set
            os._exit(1)
        for fd in parent_ends:  # else its own input would never reach its end
            os.close(fd)
        os.dup2(stdin_fd, 0)
        os.dup2(stdout_fd, 1)
        os.dup2(stdout_fd, 2)
        os.close(stdin_fd)
        os.close(stdout_fd)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                    signal.SIGUSR2, signal.SIGALRM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a new interpreter's
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)  # an event loop's, if the command had started one
        sys.excepthook, sys.unraisablehook = sys.__excepthook__, sys.__unraisablehook__
        os.write(ready_fd, b"1")
        os.close(ready_fd)
        # setproctitle moves the environment out of the way on its first call, which it cannot
        # once os.environ was cleared: first the line an exec'd standby shows, then the
        # environment.
        # Named first (not the command's `stoker`: pgrep -x stoker), so that the title, which
        # keeps the name it finds, keeps this one.
        name_process(Path(sys.executable).name)
        title_process(" ".join(["python", "-m", "stoker.runtime.launch", STANDBY_FLAG]))
        os.environ.clear()
        os.environ.update(env)
        import io
        import logging

        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout, sys.stderr = (  # unbuffered, as PYTHONUNBUFFERED=1 makes them
            io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                             errors="backslashreplace", write_through=True)
            for fd in (1, 2))
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            if isinstance(logger, logging.Logger):
                logger.handlers.clear()
        sys.argv = [sys.argv[0], STANDBY_FLAG]
        from stoker.runtime.launch import exit_after, standby

        exit_after(standby)
    except BaseException:  # noqa: BLE001 - said where it can be; the child never returns
        with contextlib.suppress(Exception):
            import traceback

            traceback.print_exc()
    os._exit(1)


def can_fork_standby(python: str, env: dict[str, str]) -> bool:
    """Whether :func:`prestart` may fork the standby from this process
    (:class:`ForkedStandby`) instead of starting a new interpreter: the ranks are forked too
    (``STOKER_WORKER_START``: no GPU device, or ``fork``), the attempt's interpreter is this
    one, the interpreter-level variables (``PYTHON*``, ``LD_*``, ...) are this process's
    (PYTHONUNBUFFERED aside, which the fork reproduces), and this process runs no other thread
    yet (a fork copies no thread, and a lock one held would stay held in the child)."""
    from stoker.runtime.launch import worker_start

    try:
        forked_ranks = worker_start(env) == "fork"
    except ValueError:  # the attempt says it in one line
        return False
    def interpreter(environ) -> dict[str, str]:
        return {k: v for k, v in environ.items()
                if k.startswith(("PYTHON", "LD_", "MALLOC_")) and k != "PYTHONUNBUFFERED"}

    return (forked_ranks and hasattr(os, "fork") and python == sys.executable
            and threading.active_count() == 1 and interpreter(env) == interpreter(os.environ))


class Standby:
    """A launcher process started ahead of its attempt: ``python -m stoker.runtime.launch
    --standby`` imports torch, torchrun and (for forked ranks) the runtime while the
    orchestrator still pulls data and checks lineage, then waits for its command line.
    :func:`prestart` forks it from ``stoker run`` where it can (:class:`ForkedStandby`).

    ``stoker run`` starts one before its flow (:func:`prestart`); the first local attempt of
    the same interpreter, working directory and import-time environment (``IMPORT_TIME_ENV``)
    takes it (:meth:`LocalLauncher.run`), any other starts cold. Until then it has done nothing
    but import: no rendezvous, no file written. It lives in its own session, like an
    attempt's launcher, and ends when its input closes: when it is discarded, when the
    orchestrator exits or dies (its pipe closes; ``PR_SET_PDEATHSIG`` as well).

    Every local attempt's launcher is one (a cold start hands its attempt over at once). One
    whose attempt exits 75 or 137 parks: its ranks are gone and it waits, warm, as the standby
    for the retry, which then skips the launcher's imports (about 3 s on 2 cores); one that
    was itself signalled (a cancel, Ctrl-C, ``kill``) ends as before. The
    ``train`` task discards a parked one that no retry takes.
    """

    def __init__(self, python: str, env: dict[str, str], fork: bool = False):
        self.python, self.env, self.cwd = python, dict(env), os.getcwd()
        if fork:
            # What a forked rank 0 imports to track (the launcher's warm-up would import it
            # in the child): here, once, for this process's own tracking and the child's.
            from stoker.runtime.launch import warm_up_tracking

            warm_up_tracking()
            self.process: subprocess.Popen | ForkedStandby = ForkedStandby(self.env)
        else:
            self.process = subprocess.Popen(
                [python, "-m", "stoker.runtime.launch", "--standby"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env,
                start_new_session=True, preexec_fn=die_with_parent)

    def fits(self, python: str, env: dict[str, str]) -> bool:
        """Whether an attempt of ``python`` with ``env`` may take this standby: it is alive
        and was started the same way (interpreter, directory, import-time variables)."""
        return (_alive(self.process) and python == self.python
                and os.getcwd() == self.cwd and _import_time(env) == _import_time(self.env))

    def hand_over(self, argv: list[str], env: dict[str, str], park: str | None = None
                  ) -> subprocess.Popen:
        """Send the attempt (torchrun's options and the whole environment); returns the
        process, now that attempt's launcher. With ``park`` (a token), a launcher whose attempt
        exits 75 or 137 stays for the next attempt (see ``stoker.runtime.launch.standby``)
        and its input stays open; without it, its input is closed.

        Raises:
            OSError: the standby died in the meantime (a closed pipe).
        """
        request = {"argv": argv, "env": env, **({"park": park} if park else {})}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        if not park:
            self.process.stdin.close()
        return self.process

    def discard(self) -> None:
        """End it now (SIGKILL: it has only imported, nothing is lost) and reap it."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()
        with contextlib.suppress(OSError):
            self.process.stdout.close()


def _alive(process: subprocess.Popen) -> bool:
    """Whether ``process`` runs on: not exited, and not dying either. A process killed while one
    of its native threads still ends (pyarrow's jemalloc background thread, which importing
    MLflow starts) shows its main thread as a zombie while ``poll()`` still says it runs, and
    its stdin still takes a line: a retry handed to it died with it (exit 143)."""
    if process.poll() is not None:
        return False
    try:
        return psutil.Process(process.pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


_standby: Standby | None = None
_standby_lock = threading.Lock()


def prestart(nproc_per_node: int, python: str = sys.executable) -> Standby:
    """Start the standby launcher for this process's next local attempt (see
    :class:`Standby`), replacing an unused one. Returns it."""
    global _standby
    with _standby_lock:
        if _standby is not None:
            _standby.discard()
        env = LocalLauncher(nproc_per_node, python=python).environment()
        _standby = Standby(python, env, fork=can_fork_standby(python, env))
        return _standby


def _pop_standby() -> Standby | None:
    global _standby
    with _standby_lock:
        standby, _standby = _standby, None
    return standby


def _park(standby: Standby) -> None:
    """Keep ``standby`` (a launcher whose attempt just ended, parked) for the next attempt."""
    global _standby
    with _standby_lock:
        previous, _standby = _standby, standby
    if previous is not None:
        previous.discard()


def take_standby(python: str, env: dict[str, str]) -> Standby | None:
    """The standby started by :func:`prestart`, if it fits an attempt of ``python`` with
    ``env``; one that does not fit is discarded. Either way none is left behind."""
    standby = _pop_standby()
    if standby is not None and not standby.fits(python, env):
        standby.discard()
        return None
    return standby


def discard_standby() -> None:
    """End an unused standby (nothing to train: a done job, a refused dataset, the end of a
    job's attempts, parked or not)."""
    standby = _pop_standby()
    if standby is not None:
        standby.discard()


class LocalLauncher:
    """torchrun as a child process in its own session, rendezvous on 127.0.0.1.

    Args:
        nproc_per_node: worker processes (ranks) to start.
        shutdown_grace_s: seconds workers get to checkpoint after SIGTERM before SIGKILL
            (torchrun ``--shutdown-timeout``; the tree kill waits a little longer).
        python: interpreter that has Stoker and torch installed.
        env: extra environment variables for the workers.
    """

    def __init__(self, nproc_per_node: int, shutdown_grace_s: float = 25.0,
                 python: str = sys.executable, env: dict[str, str] | None = None,
                 rdzv_host: str = "127.0.0.1"):
        self.nproc_per_node = nproc_per_node
        self.shutdown_grace_s = shutdown_grace_s
        self.python = python
        self.env = env or {}
        self.rdzv_host = rdzv_host
        self.process: subprocess.Popen | None = None

    def environment(self) -> dict[str, str]:
        """The launcher's environment: this process's, ``env``, ``PYTHONUNBUFFERED=1``."""
        # OMP_NUM_THREADS=1 is what torchrun sets for several processes per node; set here, it
        # skips torchrun's four-line banner about it at every attempt. A user's value wins.
        omp = {"OMP_NUM_THREADS": "1"} if self.nproc_per_node > 1 else {}
        return {**omp, **os.environ, **self.env, "PYTHONUNBUFFERED": "1"}

    def torchrun_args(self, spec_path: Path) -> list[str]:
        """torchrun's options and the runtime's module and spec, handed to a standby: the
        attempt runs what ``python -m stoker.runtime.launch ARGS`` would (torchrun with the
        exit-code contract, running the runtime)."""
        return [
            "--nnodes=1", f"--nproc-per-node={self.nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={self.rdzv_host}:0",
            f"--rdzv-id={uuid.uuid4().hex[:12]}", f"--local-addr={self.rdzv_host}",
            "--max-restarts=0", f"--shutdown-timeout={int(self.shutdown_grace_s)}",
            "-m", "stoker.runtime", str(spec_path),
        ]

    def run(self, spec_path: Path, on_line: Callable[[str], None] = print,
            timeout_s: float | None = None) -> int:
        """Run one attempt to its end and return its exit code (128 + N for a death by signal
        N, of a rank or of the launcher itself).

        Output (stdout and stderr, merged) is passed line by line to ``on_line``. If the call is
        interrupted (timeout, cancellation, KeyboardInterrupt, any exception) the whole process
        tree is terminated before the exception propagates: no worker outlives the call.

        Raises:
            subprocess.TimeoutExpired: the attempt ran longer than ``timeout_s``.
        """
        env = self.environment()
        # The stop-committed marker in the job folder, not in a temporary folder of the
        # launcher's: a SIGKILLed launcher (a second Ctrl-C) left one in /tmp per attempt.
        env[STOP_COMMITTED_ENV] = str(Path(spec_path).parent / STOP_COMMITTED_FILE)
        # The attempt's temporary folder (torchrun's logs, multiprocessing's sockets): the
        # launcher deletes it as the attempt ends, and this call after a SIGKILL of it too.
        env[ATTEMPT_TMP_ENV] = attempt_folder()
        argv, token = self.torchrun_args(spec_path), uuid.uuid4().hex
        standby = take_standby(self.python, env)
        self.process = None
        if standby is not None:
            try:
                self.process = standby.hand_over(argv, env, park=token)
            except OSError:  # it died since it was checked: start cold
                standby.discard()
        if self.process is None:  # cold: a standby that imports and then runs it at once
            standby = Standby(self.python, env)
            self.process = standby.hand_over(argv, env, park=token)
        parked: list[int] = []
        reader = threading.Thread(target=_pump, daemon=True, args=(
            self.process.stdout, on_line, f"{PARKED_MARKER}{token} exit ", parked))
        reader.start()
        try:
            code = self._wait(reader, parked, timeout_s)
        except BaseException as e:
            interrupted(e)  # who stops the ranks is recorded before they are signalled
            raise
        finally:
            if parked and self.process.poll() is None:  # warm, for the next attempt
                _end_session_but(self.process.pid)
                _park(standby)
            elif self.process.poll() is None:
                terminate_tree(self.process.pid, self.shutdown_grace_s + 5)
                self.process.wait()
            else:  # torchrun is gone; make sure nothing it started is left either
                # A launcher killed outright (kill -9) leaves its ranks committing the stop
                # checkpoint their parent-death SIGTERM asked for: they get the grace first.
                if self.process.returncode < 0:  # killed, not exited: its ranks may be saving
                    _wait_session(self.process.pid, self.shutdown_grace_s + 5)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.process.pid, signal.SIGKILL)
            reader.join(timeout=5)
            shutil.rmtree(env[ATTEMPT_TMP_ENV], ignore_errors=True)
        return code

    def _wait(self, reader: threading.Thread, parked: list[int],
              timeout_s: float | None) -> int:
        """The attempt's exit code: the launcher's, or the one it parked with; a launcher
        killed by signal N is 128 + N, as a shell reports it (and as the launcher reports a
        rank's death)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            reader.join(timeout=0.05)
            if parked:
                return parked[0]
            code = self.process.poll()
            if code is not None:
                return exit_code_for(code)
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.process.args, timeout_s)


def _session(pid: int, but: int | None = None) -> list[psutil.Process]:
    """The live processes of the session ``pid`` leads (its launcher's), except ``but``."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.pid != but and os.getsid(proc.pid) == pid and proc.status() != \
                    psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def _wait_session(pid: int, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the processes of session ``pid`` to end on their own."""
    left = _session(pid)
    if left:
        psutil.wait_procs(left, timeout=timeout_s)


def _end_session_but(pid: int) -> None:
    """SIGKILL every process of the session ``pid`` leads except ``pid`` (what an attempt's
    ranks left behind: a DataLoader worker re-parented away)."""
    for proc in _session(pid, but=pid):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _pump(stream, on_line: Callable[[str], None], marker: str = "",
          parked: list[int] | None = None) -> None:
    """Pass ``stream``'s lines to ``on_line`` until its end, or until the line ``marker`` +
    exit code (a parked launcher: the code goes to ``parked``; the stream stays open)."""
    for line in stream:
        line = line.rstrip("\n")
        if marker and line.startswith(marker) and parked is not None:
            with contextlib.suppress(ValueError):
                parked.append(int(line[len(marker):]))
                return
        on_line(line)
