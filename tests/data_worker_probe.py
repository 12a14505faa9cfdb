"""A dataset factory for ``train.dataset = "data_worker_probe:splits"``: the built-in image folder,
whose samples, when read in a DataLoader worker, leave that worker's PID in ``$PROBE_DIR/pids/``,
and where a file ``$PROBE_DIR/hang`` makes the first worker that sees it hang for good (signals
held, like a child stuck in ``fork()``), naming itself in ``$PROBE_DIR/hung``; a file
``$PROBE_DIR/kill`` makes the first worker that sees it SIGKILL itself (as the OOM killer would),
naming itself in ``$PROBE_DIR/killed``."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

from torch.utils.data import Dataset, get_worker_info

from stoker.runtime.data import image_folder


class Probe(Dataset):
    def __init__(self, inner: Dataset):
        self.inner = inner

    def for_epoch(self, epoch: int) -> Probe:
        return Probe(self.inner.for_epoch(epoch))

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i):
        if get_worker_info() is not None:
            probe = Path(os.environ["PROBE_DIR"])
            (probe / "pids" / str(os.getpid())).touch()
            try:
                (probe / "kill").rename(probe / "killed")  # one worker claims it
            except FileNotFoundError:
                pass
            else:
                (probe / "killed").write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                (probe / "hang").rename(probe / "hung")
            except FileNotFoundError:
                pass
            else:
                (probe / "hung").write_text(str(os.getpid()))
                signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals))
                while True:
                    time.sleep(3600)
        return self.inner[i]


def splits(data_dir: str, seed: int, val_fraction: float):
    base = image_folder(data_dir, seed, val_fraction)
    return dataclasses.replace(base, train=Probe(base.train), val=Probe(base.val))
