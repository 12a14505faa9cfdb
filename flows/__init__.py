"""Prefect flows: tables of contents over ``tasks``."""
