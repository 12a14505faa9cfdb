"""One attempt's temporary folder: made the temporary folder of the launcher and its ranks,
short enough for multiprocessing's sockets, and deleted with everything in it when the attempt
ends. Runs inside the training container: no Prefect."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

# The attempt's temporary folder (attempt_temporaries), named by the local launcher.
ATTEMPT_TMP_ENV = "STOKER_ATTEMPT_TMPDIR"

# multiprocessing's Unix sockets lie two levels down (``pymp-XXXXXXXX/listener-XXXXXXXX``, 32
# bytes) and their path may not pass 107 bytes: in a longer folder a DataLoader worker cannot
# hand a batch over ("AF_UNIX path too long") and its rank waits for it until
# train.data_timeout_s.
MAX_TEMPORARY_FOLDER = 107 - 32


def attempt_folder() -> str:
    """A new ``stoker-*`` folder for one attempt's temporaries: in the system's temporary folder
    (``TMPDIR``), or in ``/tmp`` when that one's path is too long for multiprocessing's sockets
    (``MAX_TEMPORARY_FOLDER``, e.g. a scheduler's per-job ``TMPDIR`` deep in a scratch disk)."""
    folder = tempfile.mkdtemp(prefix="stoker-")
    if len(os.fsencode(folder)) > MAX_TEMPORARY_FOLDER and os.path.isdir("/tmp"):
        os.rmdir(folder)
        folder = tempfile.mkdtemp(prefix="stoker-", dir="/tmp")
    return folder


@contextlib.contextmanager
def attempt_temporaries() -> Iterator[Path]:
    """The attempt's temporary folder, made the temporary folder of this launcher and of its
    ranks (``tempfile.tempdir`` for the forked ones, ``TMPDIR`` for exec'd ones) and deleted
    with everything in it when the attempt ends: the one ``STOKER_ATTEMPT_TMPDIR`` names (the
    local launcher's, which it deletes too, also after a SIGKILL of this process), else a new
    one (:func:`attempt_folder`).

    torchrun's log folder (``torchelastic_*``) and multiprocessing's (``pymp-*``, the ranks' and
    their DataLoader workers') land there: those processes end with ``os._exit``, so their own
    clean-up never runs, and the folders collected in ``/tmp``, a few per attempt.
    ``torch.compile``'s cache stays where it was (``TORCHINDUCTOR_CACHE_DIR``, by default
    ``torchinductor_<user>`` in the system's temporary folder), so a resumed attempt reuses the
    kernels compiled before."""
    import getpass
    import shutil

    previous_dir, previous_env = tempfile.tempdir, os.environ.get("TMPDIR")
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor is None:
        with contextlib.suppress(Exception):  # no user name (a container's uid): torch's default
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
                tempfile.gettempdir(), "torchinductor_" + getpass.getuser())
    folder = os.environ.get(ATTEMPT_TMP_ENV, "").strip() or attempt_folder()
    os.makedirs(folder, exist_ok=True)
    tempfile.tempdir, os.environ["TMPDIR"] = folder, folder
    try:
        yield Path(folder)
    finally:
        tempfile.tempdir = previous_dir  # a parked standby's next attempt gets its own
        for name, value in (("TMPDIR", previous_env), ("TORCHINDUCTOR_CACHE_DIR", inductor)):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(folder, ignore_errors=True)
