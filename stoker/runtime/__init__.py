"""The training runtime: runs under torchrun (locally or inside the training image).

It imports no Prefect. Start it as ``python -m stoker.runtime SPEC.yaml`` under torchrun, or as
``python -m stoker.runtime.launch [torchrun options] -m stoker.runtime SPEC.yaml`` to get the exit
code contract below from the launcher process too. The same command starts and resumes a run.

Exit codes: 0 done; 75 (EX_TEMPFAIL) preempted, resume me; anything else: an error.
"""

EXIT_OK = 0
EXIT_PREEMPTED = 75


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, verified or loaded (``stoker.runtime.checkpoint``; here,
    so that the orchestrator can name it without importing torch)."""
