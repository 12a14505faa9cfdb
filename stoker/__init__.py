"""Stoker: resumable, traceable GPU training pipelines on Prefect, DVC, PyTorch and MLflow.

The ``stoker`` package imports no Prefect; ``flows/`` and ``tasks/`` hold the Prefect layer.
"""

__version__ = "0.1.0"
