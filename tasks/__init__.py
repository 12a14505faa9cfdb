"""Prefect tasks: thin wrappers over plain functions in ``stoker``, one module per capability."""
