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
* 137: the first failed worker was killed by SIGKILL (OOM killer, node loss), or the launcher was
  stopped and the workers were killed before their stop checkpoint committed: infrastructure.
* anything else: the first failed worker's exit code (a bug or bad config in user code), or
  128 + N when it died of signal N.

Plain torchrun exits 1 for all of these, which would make a preemption look like a bug.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

from stoker.runtime import EXIT_PREEMPTED
from stoker.runtime.preemption import STOP_COMMITTED_ENV


def exit_code_for(exitcode: int) -> int:
    """Map a worker's exit status (negative = killed by that signal) to a shell exit code."""
    if exitcode < 0:
        return 128 + (-exitcode)
    return exitcode


def main(argv: list[str] | None = None) -> int:
    with tempfile.TemporaryDirectory(prefix="stoker-launch-") as tmp:
        marker = Path(tmp) / "stop-committed"
        os.environ[STOP_COMMITTED_ENV] = str(marker)  # the workers inherit it
        return _run_torchrun(sys.argv[1:] if argv is None else argv, marker)


def _run_torchrun(argv: list[str], marker: Path) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as e:
        _rank, failure = e.get_first_failure()
        return exit_code_for(failure.exitcode)
    except SignalException as e:
        if e.sigval not in (signal.SIGTERM, signal.SIGINT):
            return 128 + int(e.sigval)
        if marker.exists():
            return EXIT_PREEMPTED
        print(f"stoker.runtime.launch: stopped by {signal.Signals(e.sigval).name} but the "
              "workers ended before their stop checkpoint committed (raise "
              "train.preemption_grace_s): exit 137", file=sys.stderr, flush=True)
        return 137
    return 0


if __name__ == "__main__":
    code = main()
    # The workers are gone; torch's finalizers would hold the exit code back for seconds.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
