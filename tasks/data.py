"""Dataset task: pull the dataset through DVC, validate it, check it fits the registered model."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from stoker.config import PipelineConfig
from stoker.data.prepare import prepare_dataset
from stoker.data.pull import DatasetRef
from stoker.orchestration.batch_fit import check_batch_fits
from stoker.tracking.registry import Lineage, check_lineage


@task(name="pull-dataset", cache_policy=NO_CACHE)
def pull(config: PipelineConfig) -> DatasetRef:
    """Pull ``config.data`` at its pinned revision (the demo repository if no ``data.repo_url``
    is set) and validate it; refuse, before training, a global batch larger than its training
    split and a dataset whose classes or image shape differ from the registered model's
    champion."""
    say = get_run_logger().info
    prepared = prepare_dataset(config, say)
    check_batch_fits(config, prepared)  # a batch larger than the data: before any job exists
    shape = prepared.input_shape(config.train.channels, config.train.image_size)
    if shape is not None:
        check_lineage(config.tracking_uri(), config.registered_model(),
                      Lineage(prepared.summary.classes, shape), say=say)
    return prepared.ref
