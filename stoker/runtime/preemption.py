"""Preemption notices: a signal handler and an optional cloud notice poller that set one flag.

Neither acts: the training loop reads the flag at a step boundary, all ranks agree on it with
one collective (one for about 0.1 s of steps, read a step late; see stoker.runtime.agreement), save
together and exit with EXIT_PREEMPTED.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from stoker.runtime import private

log = logging.getLogger(__name__)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (PR_SET_PDEATHSIG).

    A SIGKILLed orchestrator or torchrun cannot clean up; with this, its children still get
    SIGTERM (the runtime checkpoints and exits) instead of training on as orphans. No-op where
    prctl is unavailable.
    """
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG


def name_process(name: str) -> None:
    """Set this process's name (``/proc/PID/comm``: what ``ps -o comm``, ``pgrep`` and ``top``
    show; at most 15 bytes, longer is cut) with PR_SET_NAME. No-op where prctl is unavailable."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)


def title_process(title: str | None = None) -> None:
    """Set this process's command line as ``ps -eo args``, ``pgrep -f`` and ``top -c`` show it
    (setproctitle), keeping its process name (``ps -o comm``), which setproctitle would cut
    from the title. Every process of a job names the job this way
    (:mod:`stoker.jobs.processes`). No-op without setproctitle (an older image).

    ``title`` None sets the title it has: a process that will replace its environment (the
    standby launcher) calls this first, since setproctitle moves the environment out of the
    way on its first call and cannot once ``os.environ`` was cleared."""
    try:
        from setproctitle import getproctitle, setproctitle
    except ImportError:
        return
    name = ""  # read first: setproctitle's first call, getproctitle's too, rewrites it
    with contextlib.suppress(OSError):
        name = Path("/proc/self/comm").read_text().strip()
    title = getproctitle() if title is None else title
    setproctitle(title)
    if name:
        name_process(name)


def spec_job(spec_path: str | Path) -> str:
    """The job a run spec belongs to: the name of its ``job_dir`` (the job folder,
    ``<key>-<time>``), read without validating the spec; the spec's folder name when the file
    cannot be read (the runtime reports that itself)."""
    import yaml

    with contextlib.suppress(OSError, yaml.YAMLError, AttributeError, TypeError):
        values = yaml.safe_load(Path(spec_path).read_text())
        if isinstance(values, dict) and values.get("job_dir"):
            return Path(str(values["job_dir"])).name
    return Path(spec_path).parent.name


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn``: a data worker ignores SIGTERM/SIGINT.

    A preemption signal often reaches the whole process group (and Stoker's own stop signals
    the whole tree); a worker that died of it would make its rank fail ("DataLoader worker is
    killed by signal") before the stop checkpoint. The rank alone decides when to stop; its
    workers end with the loader. A worker is forked with these signals held back
    (:func:`loader_iter`): one sent before this ran stays pending, and is dropped here.
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def data_worker_init(worker_id: int, rank_pid: int | None = None) -> None:
    """DataLoader ``worker_init_fn`` of a rank's workers (``rank_pid``: the rank's pid).

    The worker ignores the stop signals (:func:`ignore_stop_signals`), names itself
    ``stoker-r<RANK>-data<ID>`` (``ps -o comm``; a rank is ``stoker-rank<RANK>``, which workers
    were too), and dies with its rank (PR_SET_PDEATHSIG, SIGKILL). A worker that outlived a
    SIGKILLed rank kept the rank's sockets and torchrun's exit pipe open for up to 5 s (the
    DataLoader's own check of its parent): the other ranks and torchrun noticed only once it
    went, and torchrun blamed the peer that exited 137 first, not the killed rank.
    """
    ignore_stop_signals(worker_id)
    name_process(f"stoker-r{os.environ.get('RANK', '0')}-data{worker_id}")
    die_with_parent(signal.SIGKILL)
    if rank_pid is not None and os.getppid() != rank_pid:  # the rank died before that
        os._exit(1)


@contextlib.contextmanager
def stop_signals_held():
    """Hold SIGTERM/SIGINT back from the calling thread (``pthread_sigmask``) for the block.

    A process forked meanwhile starts with them held too. The process itself still gets them:
    another of its threads takes a signal sent to it, and Python runs the handler in the main
    thread as usual; one sent to this thread alone waits until the block ends."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def loader_iter(loader):
    """``iter(loader)``, its DataLoader workers forked with the stop signals held back, so that a
    SIGTERM sent to the whole tree between a worker's fork and its ``worker_init_fn``
    (:func:`ignore_stop_signals`) cannot kill it: with a stop at an epoch's start, that lost the
    stop checkpoint (new-user trial: Ctrl-C with ``num_workers: 2``, 3 times in 9)."""
    with stop_signals_held():
        return iter(loader)


# torchrun's wrapper (stoker.runtime.launch), or its caller, names a file here; a rank writes it
# once the stop checkpoint has committed on every rank, so "preempted" (75) is claimed only when
# it is true. The local launcher names <job_dir>/stop-committed (a SIGKILLed wrapper leaves
# nothing in /tmp); without a name the wrapper uses a temporary folder of its own.
STOP_COMMITTED_ENV = "STOKER_STOP_COMMITTED_FILE"
STOP_COMMITTED_FILE = "stop-committed"  # its name in a job folder (the local launcher's choice)


def record_stop_committed(step: int, completed: bool = False) -> None:
    """Note that the stop checkpoint at ``step`` committed, or with ``completed`` that training
    completed at ``step`` (its last checkpoint committed): a stop signal to the launcher while
    the ranks exit then loses nothing (no-op outside the launch wrapper)."""
    path = os.environ.get(STOP_COMMITTED_ENV)
    if path:
        with contextlib.suppress(OSError), private.open_file(path, "w") as f:
            f.write(f"{step}{COMPLETED_MARK if completed else ''}\n")


COMPLETED_MARK = " completed"  # after the step in the marker: training completed


def completed_at(marker: Path) -> bool:
    """Whether ``marker`` (:func:`record_stop_committed`'s file) says training completed; a
    missing, unreadable or torn one does not."""
    try:
        return marker.read_text().endswith(f"{COMPLETED_MARK}\n")
    except (OSError, UnicodeDecodeError):
        return False


STOP_SENDER_FILE = "stop-sender.json"  # stoker run's record of why it signalled the ranks
_STOP_REQUEST_FILE = "stop-requested.json"  # stoker.jobs.stop_request: stoker stop, the guard


def record_stop_sender(job_dir: str | os.PathLike, sender: str) -> None:
    """Before signalling a job's ranks, say who asks them to stop (``"stoker run got SIGINT
    (Ctrl-C)"``), so their stop line names it and not only the SIGTERM they receive. Never
    raises (a stop must not fail on a record)."""
    from stoker.runtime.records import write_json

    with contextlib.suppress(OSError):
        write_json(Path(job_dir) / STOP_SENDER_FILE, {"sender": sender, "time": time.time()})


def mark_stopped_at_once(job_dir: str | os.PathLike) -> None:
    """Add ``"at_once": true`` to ``stoker run``'s record of its stop signal
    (:func:`record_stop_sender`): a second signal ended it at once, on purpose. Without the mark
    a run that recorded a signal and then left its attempt open was killed (``kill -9`` after
    Ctrl-C) and reads as died (:func:`stop_signal_reason`). Never raises."""
    from stoker.runtime.records import read_json, write_json

    path = Path(job_dir) / STOP_SENDER_FILE
    record = read_json(path, default=None, warn=lambda *_: None)
    if isinstance(record, dict):
        with contextlib.suppress(OSError):
            write_json(path, {**record, "at_once": True})


def stop_sender(job_dir: str | os.PathLike, since: float) -> str | None:
    """Who asked the ranks of ``job_dir`` to stop, as the sender recorded it at or after
    ``since`` (Unix seconds: the attempt's start; older records are an earlier stop's): a stop
    request (``stopped by user: ...``, ``stopped by cost-guard: ...``) or ``stoker run``'s own
    signal (:func:`record_stop_sender`). None when neither says; damaged records count as
    none."""
    from stoker.runtime.records import read_json

    quiet = lambda *_: None  # noqa: E731 - a torn record is simply not a sender
    request = read_json(Path(job_dir) / _STOP_REQUEST_FILE, default=None, warn=quiet)
    if isinstance(request, dict) and _at_or_after(request.get("time"), since) \
            and isinstance(request.get("by"), str):
        said = f"stopped by {request['by']}: {request.get('reason') or 'no reason given'}"
        return " ".join(said.split())  # one line in the rank's log (the writer flattens too)
    return signal_sender(job_dir, since)


def stop_signal_reason(job_dir: str | os.PathLike, since: float) -> str | None:
    """The first signal of a ``stoker run`` that a second one then stopped at once, recorded at
    or after ``since`` (:func:`record_stop_sender` and :func:`mark_stopped_at_once`), as
    :func:`stoker.stopping.stop_reason` words it (``SIGINT (Ctrl-C)``): its attempt was stopped,
    not lost. None when it recorded none, or a signal without the mark: that run was killed
    while stopping (``kill -9`` after Ctrl-C, trial), it died."""
    record = _sender_record(job_dir, since)
    if record is None or record.get("at_once") is not True:
        return None
    sender = record["sender"]
    if not sender.startswith(SENDER_PREFIX):
        return None
    return sender[len(SENDER_PREFIX):] or None


SENDER_PREFIX = "stoker run got "  # tasks.train's record: "stoker run got SIGINT (Ctrl-C)"


def signal_sender(job_dir: str | os.PathLike, since: float) -> str | None:
    """The sender in ``stop-sender.json`` (:func:`record_stop_sender`: a signal the orchestrator
    got and passes on to the ranks) when it is recorded at or after ``since``; None when
    missing, damaged or not this stop's."""
    record = _sender_record(job_dir, since)
    return None if record is None else record["sender"]


def _sender_record(job_dir: str | os.PathLike, since: float) -> dict | None:
    """``stop-sender.json`` when it names a sender recorded at or after ``since``, else None."""
    from stoker.runtime.records import read_json

    record = read_json(Path(job_dir) / STOP_SENDER_FILE, default=None, warn=lambda *_: None)
    if isinstance(record, dict) and _at_or_after(record.get("time"), since) \
            and isinstance(record.get("sender"), str):
        return record
    return None


def _at_or_after(value: object, since: float) -> bool:
    """A record time between ``since`` and now (a few seconds of slack): a future time is a
    forged record or another clock's, never this stop's."""
    from stoker.runtime.records import real_number

    at = real_number(value)
    return at is not None and since <= at <= time.time() + 5


# The stop signals this process's installed StopFlags received, in order (stop_signal_received).
_SIGNALLED: list[int] = []


def stop_signal_received() -> int | None:
    """The first stop signal a :meth:`StopFlag.install` handler of this process received, or
    None. A rank that completed anyway re-raises it once its handler is gone: the stop was
    also meant for the process (the launcher closing every rank), not only for its training."""
    return _SIGNALLED[0] if _SIGNALLED else None


class StopFlag:
    """Set once a stop was requested; ``reason`` says by whom (e.g. ``SIGTERM``)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None
        self._poller: threading.Thread | None = None

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` seconds; True once a stop was requested."""
        return self._event.wait(timeout_s)

    def request(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def describe(self, job_dir: str | os.PathLike, since: float) -> str:
        """Why the stop came, for the rank's stop line: the signal, and who sent it when the
        sender recorded that (:func:`stop_sender`), e.g. ``SIGTERM: stoker run got SIGINT
        (Ctrl-C)``; ``another rank`` when this rank only learned it from its peers."""
        if self.reason is None:
            return "another rank"
        if self.reason in ("SIGTERM", "SIGINT"):
            sender = stop_sender(job_dir, since)
            if sender:
                return f"{self.reason}: {sender}"
        return self.reason

    def install(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)):
        """Route ``signals`` to this flag (main thread only). Only sets the flag: safe anywhere."""
        def on_signal(signum: int, _frame) -> None:
            _SIGNALLED.append(signum)
            self.request(signal.Signals(signum).name)

        for sig in signals:
            signal.signal(sig, on_signal)
        return self

    def watch_notice_url(self, url: str, interval_s: float = 5.0, timeout_s: float = 2.0) -> None:
        """Poll a preemption-notice endpoint in a daemon thread.

        The AWS spot format: ``GET http://169.254.169.254/latest/meta-data/spot/instance-action``
        answers 404 until a notice exists, then 200 with JSON ``{"action": "terminate"|"stop",
        "time": "..."}``. Any 200 whose JSON action is terminate/stop/hibernate sets the flag.
        A session token is fetched first (IMDSv2: ``PUT /latest/api/token``) and sent with every
        poll; an endpoint without tokens (IMDSv1, other clouds) is polled without one. An answer
        other than 200/404 is logged once as a warning (a misconfigured notice must be visible);
        connection errors are logged at debug level and polling goes on.
        """
        self._poller = threading.Thread(target=NoticePoller(url, self, timeout_s).run,
                                        args=(interval_s,), name="preemption-notice",
                                        daemon=True)
        self._poller.start()


class NoticePoller:
    """Polls one notice URL with an IMDSv2 session token when the endpoint issues one."""

    TOKEN_TTL_S = 21600  # the IMDSv2 maximum; renewed when the endpoint answers 401

    def __init__(self, url: str, flag: StopFlag, timeout_s: float = 2.0):
        import requests

        self.url, self.flag, self.timeout_s = url, flag, timeout_s
        parts = urlsplit(url)
        self.token_url = urlunsplit((parts.scheme, parts.netloc, "/latest/api/token", "", ""))
        self.session = requests.Session()
        self.token: str | None = None
        self.warned = False

    def fetch_token(self) -> str | None:
        """An IMDSv2 token, or None where the endpoint has no token API."""
        import requests

        try:
            response = self.session.put(self.token_url, timeout=self.timeout_s, headers={
                "X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)})
        except requests.RequestException as e:
            log.debug("preemption notice token %s failed: %s", self.token_url, e)
            return None
        return response.text.strip() if response.status_code == 200 else None

    def poll(self) -> str | None:
        """One poll; returns the notice's action (terminate/stop/hibernate) or None."""
        import requests

        if self.token is None:
            self.token = self.fetch_token()
        headers = {"X-aws-ec2-metadata-token": self.token} if self.token else {}
        try:
            response = self.session.get(self.url, timeout=self.timeout_s, headers=headers)
        except requests.RequestException as e:
            log.debug("preemption notice poll %s failed: %s", self.url, e)
            return None
        if response.status_code == 401:
            self.token = None  # expired or never issued: fetch a new one next time
        if response.status_code not in (200, 404) and not self.warned:
            self.warned = True
            log.warning("preemption notice endpoint %s answered HTTP %d: notices from it are "
                        "not seen (check train.preemption_notice_url)", self.url,
                        response.status_code)
        if response.status_code != 200:
            return None
        try:
            action = response.json().get("action")
        except (ValueError, AttributeError):
            return None
        return action if action in ("terminate", "stop", "hibernate") else None

    def run(self, interval_s: float) -> None:
        while not self.flag.wait(interval_s):
            action = self.poll()
            if action:
                self.flag.request(f"preemption notice ({action}) from {self.url}")
