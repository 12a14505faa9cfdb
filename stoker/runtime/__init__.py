"""The training runtime: runs under torchrun (locally or inside the training image).

It imports no Prefect. Start it as ``python -m stoker.runtime SPEC.yaml`` under torchrun, or as
``python -m stoker.runtime.launch [torchrun options] -m stoker.runtime SPEC.yaml`` to get the exit
code contract below from the launcher process too. The same command starts and resumes a run.

Exit codes: 0 done; 75 (EX_TEMPFAIL) preempted, resume me; 137 an infrastructure failure a rank
found itself (its data workers stalled, a peer rank is gone): resume from the last checkpoint;
74 (EX_IOERR) the checkpoint storage refused a write (a full disk, a folder this user cannot
write): not retried, the user must act; anything else: an error.
"""

EXIT_OK = 0
EXIT_PREEMPTED = 75
# A rank's own infrastructure exit: the code a SIGKILL gives, which the launcher treats the same.
EXIT_INFRASTRUCTURE = 137
# The checkpoint storage refused a write (sysexits' EX_IOERR): neither a bug nor bad input.
EXIT_STORAGE = 74


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, verified or loaded (``stoker.runtime.checkpoint``; here,
    so that the orchestrator can name it without importing torch)."""


class CheckpointWriteError(CheckpointError):
    """The file system refused a checkpoint's write (a full disk, a folder this user cannot
    write): the ranks exit ``EXIT_STORAGE`` and the attempt's outcome is ``storage_error``."""
