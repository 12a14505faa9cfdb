"""``python -m stoker.runtime SPEC.yaml``: one rank of one attempt, with exit codes.

0 done, 75 preempted (stop checkpoint committed), 2 a named user error (config, data, checkpoint),
1 a bug (traceback in the rank's log).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from stoker.config import ConfigError
from stoker.runtime import EXIT_OK, EXIT_PREEMPTED
from stoker.runtime.checkpoint import CheckpointError
from stoker.runtime.data import DataError
from stoker.runtime.distributed import init_distributed, teardown
from stoker.runtime.lease import watch_lease
from stoker.runtime.preemption import StopFlag, die_with_parent
from stoker.runtime.spec import RunSpec
from stoker.runtime.trainer import Trainer

log = logging.getLogger("stoker.runtime")


def main(argv: list[str] | None = None) -> int:
    """``python -m stoker.runtime SPEC.yaml``; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m stoker.runtime",
                                     description="Train (or resume) the job described by SPEC.")
    parser.add_argument("spec", type=Path, help="run spec YAML written by the orchestrator")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = RunSpec.load(args.spec)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    stop = StopFlag().install()
    die_with_parent()  # torchrun SIGKILLed: stop (and checkpoint) instead of training on orphaned
    env = init_distributed()
    trainer: Trainer | None = None
    outcome = "failed"
    try:
        if spec.lease_token and env.rank == 0:  # rank 0 alone: any rank's stop stops all
            watch_lease(spec.job_dir, spec.lease_token, stop.request)
        if spec.train.preemption_notice_url:
            stop.watch_notice_url(spec.train.preemption_notice_url,
                                  spec.train.preemption_notice_interval_s)
        trainer = Trainer(spec, env, stop)
        outcome = trainer.train()
        return EXIT_PREEMPTED if outcome == "preempted" else EXIT_OK
    except (ConfigError, DataError, CheckpointError) as e:
        log.error("%s", e)
        return 2
    except Exception:
        log.exception("training failed at step %s", trainer.step if trainer else 0)
        return 1
    finally:
        if trainer is not None:
            trainer.close(outcome)
        teardown()


if __name__ == "__main__":
    sys.exit(main())
