"""``torchrun`` with Stoker's exit-code contract, for the training image's entrypoint.

``python -m stoker.runtime.launch [torchrun options] -m stoker.runtime SPEC.yaml`` accepts exactly
torchrun's command line (and its ``PET_*`` environment variables) and runs torchrun in-process, then
maps how the workers ended to one exit code that container engines and schedulers can act on:

* 0: every worker finished.
* 75 (EX_TEMPFAIL): preempted, resume me: the first failed worker exited 75 (it committed a
  checkpoint), or this launcher itself received SIGTERM/SIGINT (``docker stop``, spot notice) and
  passed it on to the workers, which checkpoint within ``--shutdown-timeout`` seconds.
* 137: the first failed worker was killed by SIGKILL (OOM killer, node loss): infrastructure.
* anything else: the first failed worker's exit code (a bug or bad config in user code), or
  128 + N when it died of signal N.

Plain torchrun exits 1 for all of these, which would make a preemption look like a bug.
"""

from __future__ import annotations

import signal
import sys

from stoker.runtime import EXIT_PREEMPTED


def exit_code_for(exitcode: int) -> int:
    """Map a worker's exit status (negative = killed by that signal) to a shell exit code."""
    if exitcode < 0:
        return 128 + (-exitcode)
    return exitcode


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        _rank, failure = e.get_first_failure()
        return exit_code_for(failure.exitcode)
    except SignalException as e:
        if e.sigval in (signal.SIGTERM, signal.SIGINT):
            return EXIT_PREEMPTED
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
