"""Right after the pull: a global batch larger than the dataset's training split is refused
before any job is queued or any training process starts (the ranks would find it only after a
Slurm queue wait or a container start). Same split arithmetic as the ranks
(:mod:`stoker.runtime.split`); the ranks check again at launch."""

from __future__ import annotations

from stoker.config import ConfigError, PipelineConfig
from stoker.data.prepare import PreparedDataset, dataset_name
from stoker.launch.supervisor import nodes, nproc
from stoker.runtime.split import batch_exceeds_split, split_sizes


def check_batch_fits(config: PipelineConfig, prepared: PreparedDataset) -> None:
    """Refuse ``train.global_batch_size`` when it is larger than the training split of the
    pulled dataset. Only for the built-in image_folder factory: a custom factory's split is
    known to its ranks alone (they check it).

    Args:
        config: the pipeline config (batch, accumulation, val_fraction, world size).
        prepared: the pulled and validated dataset (its per-class image counts).

    Raises:
        ConfigError: one line naming train.global_batch_size, the training split's size (and
            the dataset's) and the world size.
    """
    if prepared.summary is None:
        return
    train = config.train
    n = sum(prepared.summary.counts)
    n_train, n_val = split_sizes(n, train.val_fraction)
    dataset = (f"{dataset_name(prepared.ref)} ({n} images; train.val_fraction="
               f"{train.val_fraction:g} holds out {n_val})")
    problem = batch_exceeds_split(train.global_batch_size, train.grad_accum_steps, n_train,
                                  nproc(config) * nodes(config), dataset)
    if problem is not None:
        raise ConfigError(problem)
