"""``python -m stoker.runtime SPEC.yaml``: one rank of one attempt, with exit codes.

0 done, 75 preempted (stop checkpoint committed), 2 a named user error (config, data, checkpoint),
1 a bug (traceback in the rank's log), 137 an infrastructure failure this rank found (a peer rank
is gone, or gone before the stop checkpoint committed; its data workers stalled or were killed),
treated like a SIGKILL; the launcher says that no process was killed. SIGTERM/SIGINT are caught
from the first line on.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

# Only light imports before the handler is installed: a SIGTERM that arrives while torch is
# still importing (a second or more) must be a preemption, not a death by signal (exit 143).
from stoker.runtime import EXIT_INFRASTRUCTURE, startup_gc
from stoker.runtime.preemption import (
    StopFlag,
    die_with_parent,
    name_process,
    record_stop_committed,
    title_process,
)

# Stopped, but a peer died before the stop checkpoint committed (or the data workers stalled): steps
# since the last commit are lost, as with a SIGKILL, and the launcher classes it the same way.
EXIT_STOP_LOST = EXIT_INFRASTRUCTURE

log = logging.getLogger("stoker.runtime")


def main(argv: list[str] | None = None) -> int:
    """``python -m stoker.runtime SPEC.yaml``; returns the process exit code."""
    stop = StopFlag().install()
    startup_gc.pause()  # torch and the runtime import next (see run)
    die_with_parent()  # torchrun SIGKILLed: stop (and checkpoint) instead of training on orphaned
    name_process(f"stoker-rank{os.environ.get('RANK', '0')}")  # ps/pgrep find one rank
    parser = argparse.ArgumentParser(prog="python -m stoker.runtime",
                                     description="Train (or resume) the job described by SPEC.")
    parser.add_argument("spec", type=Path, help="run spec YAML written by the orchestrator")
    args = parser.parse_args(argv)
    return run(args.spec, stop)


def run(spec_path: Path, stop: StopFlag) -> int:
    """Load the spec and train; ``stop`` is already listening. Returns the exit code."""
    from stoker.config import ConfigError
    from stoker.runtime import EXIT_OK, EXIT_PREEMPTED, EXIT_STORAGE, CheckpointWriteError, hang
    from stoker.runtime.bucket import attach, caused_by_lost_lease
    from stoker.runtime.checkpoint import CheckpointError
    from stoker.runtime.data import DataError, DataStall, data_worker_killed, loader_workers
    from stoker.runtime.distributed import init_distributed, teardown
    from stoker.runtime.lease import watch_lease
    from stoker.runtime.peers import peer_gone
    from stoker.runtime.spec import RunSpec
    from stoker.runtime.trainer import Trainer

    # The imports are done: collect cycles again, before anything of the job (a checkpoint
    # loaded on resume) is made. A forked rank's launcher froze its own imports already.
    startup_gc.settle()
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("botocore", "aiobotocore", "s3fs"):  # "Found credentials ..." per request
        logging.getLogger(chatty).setLevel(logging.WARNING)
    try:
        spec = RunSpec.load(spec_path)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    title_process(f"stoker-rank{rank} job {Path(spec.job_dir).name}: python -m stoker.runtime "
                  f"{spec_path}")  # ps -eo args: which job this rank trains
    policy = hang.HangPolicy(**spec.train.hang.model_dump())
    hang.install(int(rank), policy)
    trainer: Trainer | None = None
    outcome = "failed"
    try:
        # In the try: a peer that joined, found bad input at once (exit 2) and left while this
        # rank still connected its gloo mesh ("Connection closed by peer") is a peer gone, not
        # this rank's traceback (CI: the attempt read `user_error (exit 1)` instead of 2).
        env = init_distributed(policy.collective_timeout_s)
        if spec.lease_token and env.rank == 0:  # rank 0 alone: any rank's stop stops all
            watch_lease(spec.job_dir, spec.lease_token, stop.request)
        if spec.train.preemption_notice_url:
            stop.watch_notice_url(spec.train.preemption_notice_url,
                                  spec.train.preemption_notice_interval_s)
        trainer = Trainer(spec, env, stop)
        if env.rank == 0:
            attach(trainer, spec, stop.request)
        outcome = trainer.train()
        if outcome == "preempted":
            record_stop_committed(trainer.step)
            return EXIT_PREEMPTED
        # A stop signal to the launcher while the ranks exit now loses nothing (trial: it said
        # the workers "ended before their stop checkpoint committed").
        record_stop_committed(trainer.step, completed=outcome == "completed")
        return EXIT_OK
    except CheckpointWriteError as e:
        # The storage refused the write (a full disk): neither a bug nor bad input, and a retry
        # would meet the same disk. Its own outcome (storage), not retried.
        log.error("%s", e)
        outcome = "storage"
        return EXIT_STORAGE
    except CheckpointError as e:
        if (gone := peer_gone(e)) is not None:
            # A rank died (or never answered) while rank 0 waited for its checkpoint digest:
            # infrastructure, as a peer lost in a collective is (issue 45's re-trial: 30 s
            # silent, then torchrun's SIGKILL).
            log.warning("%s at step %s: stopping this rank", gone, trainer.step if trainer else 0)
            outcome = "infrastructure"
            stop.wait(PEER_LOST_WAIT_S)
            return EXIT_STOP_LOST
        if caused_by_lost_lease(e):
            # Another node owns the job: stop as a lost local lease does (exit 75).
            log.error("stopping: %s", e)
            return EXIT_PREEMPTED
        log.error("%s", e)
        return 2
    except DataStall as e:
        # Not the user's data (that fails with DataError, named): a hung worker or stalled
        # storage. Infrastructure: the attempt is retried from the last checkpoint.
        outcome = "infrastructure"
        return data_workers_lost(str(e), trainer)
    except (ConfigError, DataError) as e:
        log.error("%s", e)
        return 2
    except Exception as e:
        if trainer is not None and (stall := trainer.data_stalled) is not None:
            # The watchdog killed the workers: whatever that raised (here, or in a collective
            # a step later), the cause is the stall.
            outcome = "infrastructure"
            return data_workers_lost(str(stall), trainer)
        if killed := data_worker_killed(e, loader_workers(getattr(trainer, "_batches", None))):
            # The OOM killer's usual victim: infrastructure, as a rank killed by it would be.
            outcome = "infrastructure"
            return data_workers_lost(f"{killed} (the OOM killer? see dmesg)", trainer)
        if hang.ended_by_watchdog():
            # The launcher found a hang and ends the ranks: a peer gone now is its doing, and
            # its line names the rank that stood out (trial: the frozen rank, once continued,
            # blamed "a peer rank").
            log.warning("the hang watchdog ended this attempt at step %s (its line names the "
                        "rank that stood out): stopping this rank", trainer.step if trainer else 0)
            outcome = "infrastructure"
            return EXIT_STOP_LOST
        if stop.requested and is_peer_lost(e):
            # A coordinated stop whose peer was killed first (grace ran out), or torchrun's
            # SIGTERM to the survivors after a peer died: not a bug here either way.
            log.warning("%s: no stop checkpoint", peer_lost_while_stopping(
                trainer.step if trainer else 0, peer_lost_reason(e),
                stop.describe(spec.job_dir, trainer.created) if trainer else stop.reason))
            outcome = "infrastructure"
            return EXIT_STOP_LOST
        if is_peer_lost(e):
            # Another rank died (OOM killer, node loss, kill -9): this rank is not at fault, and
            # the attempt is an infrastructure failure that resumes from the last checkpoint.
            log.warning("a peer rank is gone at step %s (%s): stopping this rank",
                        trainer.step if trainer else 0, peer_lost_reason(e))
            outcome = "infrastructure"
            # Give torchrun, which polls its ranks every 0.1 s, the time to see the peer that
            # died first: it names the first failure it sees, and SIGTERMs this rank, which
            # ends the wait. Exiting at once raced it, and this rank's 137 was named instead
            # of the killed rank (new-user trial).
            stop.wait(PEER_LOST_WAIT_S)
            return EXIT_STOP_LOST
        if timed_out := collective_timeout_reason(e):
            # A collective waited out the process group's timeout: a peer hangs (with
            # train.hang.enabled=false, or on a node whose watchdog is gone). Not a bug in the
            # training code: an infrastructure failure, retried from the last checkpoint.
            log.warning("a collective timed out at step %s (%s): a peer rank hangs; stopping "
                        "this rank", trainer.step if trainer else 0, timed_out)
            outcome = "infrastructure"
            return EXIT_STOP_LOST
        log.exception("training failed at step %s", trainer.step if trainer else 0)
        return 1
    finally:
        if trainer is not None:
            trainer.close(outcome)
        torn = time.monotonic()
        teardown()
        if trainer is not None and trainer.env.is_main:  # where the last step's seconds go
            log.info("end: %s", ", ".join(f"{name} {seconds:.2f} s" for name, seconds in (
                *getattr(trainer, "end_s", {}).items(),
                ("process group", time.monotonic() - torn))))


PEER_LOST_WAIT_S = 2.0  # at most, before a rank whose peer is gone exits (torchrun's turn)
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "NCCL communicator was aborted")


def peer_lost_while_stopping(step: int, lost: str | None, why: str | None) -> str:
    """The survivor's words for a peer gone while this rank was stopping. ``why``: the stop as
    :meth:`StopFlag.describe` words it. A bare signal names no sender: it may be torchrun ending
    the other ranks after that peer died, which is not a stop anyone asked for (new-user trial:
    after ``kill -9`` of rank 1, rank 0 read as if it had been stopping)."""
    if why in ("SIGTERM", "SIGINT"):
        return (f"a peer rank is gone at step {step} ({lost}), and this rank got {why} (torchrun "
                "ends the other ranks once one has failed; or a stop from outside)")
    return f"a peer rank is gone at step {step} ({lost}) while this rank was stopping ({why})"


def is_peer_lost(error: Exception) -> bool:
    """Whether ``error`` is a collective failing because another rank is gone (gloo/NCCL)."""
    return peer_lost_reason(error) is not None


def peer_lost_reason(error: Exception) -> str | None:
    """The backend's words for the lost peer (``"Connection closed by peer"``), without the
    file, line and remote address of its raw message; None when ``error`` is something else."""
    text = str(error)
    return next((s for s in PEER_LOST if s in text), None)


COLLECTIVE_TIMEOUT = ("Application timeout caused pair closure", "Timed out waiting",
                      "Watchdog caught collective operation timeout")


def collective_timeout_reason(error: Exception) -> str | None:
    """The backend's words for a collective that timed out (gloo's ``"Application timeout
    caused pair closure"``, NCCL's watchdog), None when ``error`` is something else."""
    text = str(error)
    return next((s for s in COLLECTIVE_TIMEOUT if s in text), None)


def data_workers_lost(reason: str, trainer) -> int:
    """Log ``reason``, end the rank's data workers (all of them: one may hang with the stop
    signals held) and return EXIT_STOP_LOST: an infrastructure failure, which the launcher
    retries from the last checkpoint."""
    # The workers are dead or about to be: torch's SIGCHLD handler would raise "DataLoader
    # worker … is killed" at the next death, anywhere, even inside the log call below (seen
    # in CI after the watchdog had killed a frozen worker and its sibling died a moment later).
    with contextlib.suppress(ValueError, OSError):  # ValueError: not the main thread
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    log.error("%s at step %s: ending this attempt as an infrastructure failure (exit %d; "
              "retried from the last checkpoint while retry.max_infra_failures allows)", reason,
              trainer.step if trainer else 0, EXIT_STOP_LOST)
    from stoker.runtime.data import kill_children

    if trainer is not None:
        trainer.close_data()  # (else torch's SIGCHLD handler raises at the kill below)
    kill_children()
    return EXIT_STOP_LOST


def exit_now(code: int) -> None:
    """Flush logs and output, then end the process without the interpreter's finalization.

    Everything that must outlive the rank is durable by now (the checkpoint committed, MLflow
    closed, the process group destroyed); the finalizers of torch, gloo and MLflow's threads
    took 3-5 s more, which is time a stop (and the grace of the other ranks) does not have.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
