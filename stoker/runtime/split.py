"""The sizes of the train/validation split and whether a global batch fits its training part.

One arithmetic for both sides: the ranks (``stoker.runtime.data.split_indices``, the Trainer)
and the orchestrator, which checks the pulled dataset before any job is queued or any training
process starts (``stoker.orchestration.batch_fit``). Imports no torch.
"""

from __future__ import annotations


def split_sizes(n: int, val_fraction: float) -> tuple[int, int]:
    """How ``n`` samples split: ``(n_train, n_val)``, at least one held out for validation.

    Args:
        n: samples in the dataset.
        val_fraction: share held out (``train.val_fraction``), in (0, 1).

    Returns:
        Training and validation sample counts; ``n_train`` may be 0 for a tiny dataset.
    """
    n_val = max(1, round(n * val_fraction))
    return n - n_val, n_val


def steps_per_epoch(n_train: int, global_batch_size: int) -> int:
    """Optimizer steps in one pass over the training split (the last partial batch is dropped:
    every step takes a whole global batch, so the data order does not depend on the world size).
    """
    return n_train // global_batch_size


def batch_exceeds_split(global_batch_size: int, grad_accum_steps: int, n_train: int,
                        world_size: int, dataset: str) -> str | None:
    """The one-line refusal of a global batch larger than the training split (an epoch would
    have no step), or None when it fits.

    Args:
        global_batch_size: ``train.global_batch_size``, samples per optimizer step, all ranks.
        grad_accum_steps: ``train.grad_accum_steps``.
        n_train: samples in the training split.
        world_size: processes over all nodes.
        dataset: how the message names the dataset (and what its split holds out).

    Returns:
        The message naming ``train.global_batch_size``, the split size and the world size.
    """
    if steps_per_epoch(n_train, global_batch_size) > 0:
        return None
    shards = world_size * grad_accum_steps
    each = (f": {global_batch_size // shards} per process" + (
        f" and micro-batch (grad_accum_steps {grad_accum_steps})" if grad_accum_steps > 1 else "")
        if global_batch_size % shards == 0 else "")
    largest = n_train - n_train % shards
    advice = (f"give at most {largest}" + (f" (a multiple of {shards})" if shards > 1 else "")
              if largest else f"the split holds fewer samples than the {shards} shards of a "
              "step: add data or lower train.val_fraction")
    return (f"train.global_batch_size: {global_batch_size} samples per step (world size "
            f"{world_size}{each}) is more than the {n_train} samples of the training split of "
            f"{dataset}, so an epoch has no step; {advice}")
