"""Loaded by every Python process started with this folder first on ``PYTHONPATH``
(tests/test_startup_gc.py): records each full (generation 2) cyclic collection and each
``gc.freeze()`` call, in order, and writes them with the process's final state as
``<GC_PROBE_DIR>/<pid>.json`` when the process ends (normally or through ``os._exit``).
A forked child starts with its parent's records."""

import atexit
import gc
import json
import os
import sys

_OUT = os.environ.get("GC_PROBE_DIR")
_events: list[str] = []


def _on_collection(phase: str, info: dict) -> None:
    if phase == "stop" and info["generation"] == 2:
        _events.append("full collection")


def _freeze(real=gc.freeze) -> None:
    _events.append("freeze")
    real()


def _dump() -> None:
    if not _OUT:
        return
    record = {"argv": sys.argv, "events": _events, "enabled": gc.isenabled(),
              "frozen": gc.get_freeze_count()}
    with open(os.path.join(_OUT, f"{os.getpid()}.json"), "w") as f:
        json.dump(record, f)


def _exit(code: int, real=os._exit) -> None:
    _dump()
    real(code)


if _OUT:
    gc.callbacks.append(_on_collection)
    gc.freeze = _freeze
    os._exit = _exit
    atexit.register(_dump)
