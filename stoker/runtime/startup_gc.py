"""Python's cyclic garbage collector paused while a process imports its libraries.

Importing MLflow, Prefect, torch and ``torch._dynamo`` makes hundreds of thousands of objects
that live as long as the process (modules, classes, functions, caches). Every full
(generation 2) collection during the imports walks all of them and frees next to nothing.
Measured on 2 cores (``gc.callbacks``, one warm ``stoker run`` of the default job): the command
spent 0.85 s in 7 full collections and its standby launcher 0.7 s in 3 more after its fork,
all on the way to the first training step; importing torch, torchrun and ``torch._dynamo``
alone took 2.38 CPU-s with the collector on and 1.89 with it paused.

While the collector is paused, reference counting frees objects as usual; only reference
cycles wait. :func:`settle` then moves everything the imports made into the permanent
generation (:func:`gc.freeze`: no later collection walks it, and a process forked from this
one does not copy those pages when a collection would touch them) and turns the collector
back on. The cycles that were already garbage are kept with them: about 12,500 objects
(5 MB) after MLflow's and Prefect's imports, once per process.

Nothing here imports Prefect, MLflow or torch: the ranks use it too.
"""

from __future__ import annotations

import gc


def pause() -> None:
    """Pause automatic cyclic collection (the imports that follow make long-lived objects)."""
    gc.disable()


def settle() -> None:
    """Freeze what exists now into the permanent generation and resume automatic collection.
    Call it once the process's imports are done, before it forks or starts its real work."""
    gc.freeze()
    gc.enable()
