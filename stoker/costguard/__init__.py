"""The cost guard: find idle GPUs and stalled jobs through NVML and progress signals, and stop
Stoker-owned resources that waste them (never anything without Stoker's ownership mark).

Layers: ``nvml`` reads GPUs, ``signals`` reads job progress, ``inventory`` lists Stoker-owned
resources, ``decide`` judges (pure), ``actions`` stops, ``sweep`` ties them together, ``report``
renders. No Prefect here: ``tasks/cost_guard.py`` and ``flows/cost_guard.py`` wrap it.
"""
