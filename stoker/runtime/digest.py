"""The digest that tells a checkpoint file's bytes are the ones written: xxh3-128 (the
``xxhash`` library) for new checkpoints, sha256 still read for checkpoints written before it.

What it protects against: a torn, truncated or bit-flipped file (a node killed mid-write, a
disk or a bucket returning other bytes). What it does not: someone who can write the
checkpoint folder can rewrite ``COMMITTED`` as well, so no digest kept beside the files could
authenticate them; what keeps a planted file from running code is the loader
(:mod:`stoker.runtime.safe_load`), whatever the digest says.

Why xxh3-128 and not sha256: a save hashes every byte on the training thread. Serializing a
151 MB state on this project's 2-core AMD EPYC machine cost the training thread 0.163 CPU-s with
sha256 and torch's zip CRC-32, 0.049 with xxh3-128 and no CRC (least of 5; the serialization
note of ``benchmarks/bench_checkpoint_e2e.py`` in ``benchmarks/RESULTS.md`` measures both). 128
bits leave a random corruption undetected with probability 2^-128.

No Prefect, no torch: the orchestrator imports it too.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import xxhash

WRITTEN = "xxh3_128"  # the digest new checkpoints record (COMMITTED's "hash")
LEGACY = "sha256"  # what a COMMITTED without "hash" used (every checkpoint before it)
_HASHERS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


def known(name: object) -> str:
    """``name`` when it is a digest this module computes.

    Raises:
        ValueError: anything else (the value comes from a file in a shared folder: untrusted).
    """
    if not isinstance(name, str) or name not in _HASHERS:
        raise ValueError(f"unknown digest {str(name)[:40]!r} "
                         f"(known: {', '.join(sorted(_HASHERS))})")
    return name


def new(name: str = WRITTEN) -> Hasher:
    """A fresh hasher of digest ``name`` (``update`` with bytes, then ``hexdigest``).

    Raises:
        ValueError: ``name`` is not a known digest.
    """
    return _HASHERS[known(name)]()


def of(data: bytes | memoryview, name: str = WRITTEN) -> str:
    """The hex digest ``name`` of ``data`` (xxh3-128: 32 hex digits; sha256: 64).

    Raises:
        ValueError: ``name`` is not a known digest.
    """
    hasher = new(name)
    hasher.update(data)
    return hasher.hexdigest()
