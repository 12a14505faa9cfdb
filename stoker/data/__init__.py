"""Datasets: pull a DVC-tracked folder at a pinned revision, the demo repository, git helpers."""
