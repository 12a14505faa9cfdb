"""Tracking: MLflow registry and promotion, lineage, training curves, cost and prices."""
