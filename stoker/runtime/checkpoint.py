"""Atomic, verifiable checkpoints on a local folder or any fsspec URL.

Layout::

    <location>/step-000000120/shared.pt         model, optimizer, scheduler, scaler, step, config
    <location>/step-000000120/rank-00000.pt     per-rank state (RNG), one file per rank
    <location>/step-000000120/COMMITTED         JSON: step, world size, digest of every file

Every file is written under a temporary name, fsynced and renamed, hashed while it is written
(xxh3-128, :mod:`stoker.runtime.digest`; ``COMMITTED`` names the digest in ``hash``, and one
without it, written before, is read as sha256); each rank > 0 then publishes its file's digest
in ``rank-<r>.pt.digest``, and ``COMMITTED`` is
written last, by rank 0, from those records (it never reads another rank's file). A step folder
without it (killed mid-write, disk full) is never loaded. "latest" is the highest committed step
whose files match their recorded hashes; a corrupt one is skipped with a warning naming the
reason, and the previous one is used.

On an object store (an ``s3://`` URL, say) the same order holds: the files, then ``COMMITTED``;
a reader sees a step only once its marker exists and trusts it only when the hashes match, so an
upload cut short (files without a marker, a ``.tmp-`` object) is never loaded. Saves to an object
store always run in the background (an async save copies the state into reused host buffers,
a copy the trainer lets overlap its next forward/backward: see ``stoker.runtime.staging``); a
failed upload is retried (``upload_attempts``) and, if the store stays down, logged and given
up: training goes on, and the next save tries again.

Retention (``keep_latest_k``) counts only verified checkpoints at or below the one just written,
never deletes that one, and never touches folders above it. A committed folder found unusable is
moved aside to ``corrupt-step-<step>-<unix time>/`` (with a ``REASON`` file), never deleted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import fsspec
from tenacity import Retrying, stop_after_attempt, wait_exponential

# Defined there: the orchestrator names them without importing torch.
from stoker.runtime import CheckpointError, CheckpointWriteError, digest, private
from stoker.runtime.checkpoint_files import (
    Written,
    discard,
    drop_spare,
    retire,
    seal,
    serialize,
    unwritable,
    write_bytes,
)
from stoker.runtime.checkpoint_read import (  # noqa: F401 - re-exported
    MARKER,
    UNFINISHED,
    CheckpointReader,
    Loaded,
)
from stoker.runtime.lease import LeaseLost
from stoker.runtime.peers import PeerGone, PeerWait
from stoker.runtime.staging import HostStaging

log = logging.getLogger(__name__)

SPARE = ".spare-shared.pt"  # a purged step's shared.pt, kept for the next save to overwrite
DIGEST_SUFFIX = ".digest"  # rank-00001.pt.digest: that rank's own digest of its file, for rank 0
_STEP_DIR = re.compile(r"^step-(\d{9})$")


class Checkpointer(CheckpointReader):
    """Saves and finds committed checkpoints for one job.

    Args:
        location: folder path or fsspec URL; created if missing.
        rank, world_size: this process's place in the job.
        keep_latest_k: committed checkpoints kept after each commit (older ones are deleted).
        keep_best: (metric, "max"|"min"): also keep the committed checkpoint whose ``metrics``
            (given to ``save``, recorded in COMMITTED) has the best value of that metric.
        async_save: serialize and write in a background thread after a host copy into
            reused buffers; ``wait()`` joins it. Without it, ``save`` serializes in the
            caller's thread and only the fsync, the commit and the purge run in the background.
            With ``save(..., defer_copy=True)`` the copy runs in that thread too, and the
            caller calls ``wait_staged()`` before the tensors change.
        commit_timeout_s: how long rank 0 waits for the other ranks' files before giving up.
        upload_attempts: tries per save on an object store (exponential backoff from 1 s).

    Attributes a runtime may set after construction: ``fence`` (called by rank 0 right before
    each ``COMMITTED`` write; raises ``stoker.runtime.lease.LeaseLost`` when this run no
    longer owns the job, so the step stays uncommitted) and ``on_give_up`` (called with the step
    and the reason when a save to an object store is given up after ``upload_attempts``),
    and ``peer_gone`` (called with a rank while rank 0 waits for that rank's digest; returns
    why the rank is gone, or None: see :func:`stoker.runtime.peers.local_peer_gone`).
    """

    def __init__(self, location: str, rank: int, world_size: int, keep_latest_k: int = 3,
                 async_save: bool = False, commit_timeout_s: float = 120.0,
                 keep_best: tuple[str, str] | None = None, upload_attempts: int = 4):
        self.fs, self.root = fsspec.core.url_to_fs(location)
        # An object store: saves go to the background and survive the store being down.
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.remote = protocol not in ("file", "local", "memory")
        self.upload_attempts = upload_attempts
        self.failed_saves: list[int] = []  # steps given up after upload_attempts (remote only)
        self.fence: Callable[[], None] | None = None
        self.peer_gone: Callable[[int], str | None] | None = None
        self.on_give_up: Callable[[int, str], None] | None = None
        self.root = self.root.rstrip("/")
        self.rank = rank
        self.world_size = world_size
        self.keep_latest_k = keep_latest_k
        self.keep_best = keep_best
        self.async_save = async_save or self.remote
        self.commit_timeout_s = commit_timeout_s
        self._pending: threading.Thread | None = None
        self._verified: set[int] = set()  # steps this process wrote or verified
        self._error: BaseException | None = None
        self._error_step = 0  # the step whose background part raised _error
        self.last_blocking_s = 0.0
        self.staging = HostStaging() if self.async_save else None
        # Rank 0's purged shared.pt, kept for its next save to overwrite (local disk only).
        self.spare = (f"{self.root}/{SPARE}"
                      if rank == 0 and private.local_path(self.fs, self.root) else None)
        private.fs_make_dir(self.fs, self.root)

    # -- paths --------------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return f"{self.root}/step-{step:09d}"

    def _steps(self) -> list[tuple[int, bool]]:
        """(step, committed) for every step folder, ascending."""
        found = []
        self.fs.invalidate_cache(self.root)  # another node or rank may have written since
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:  # an object store has no empty "folders"
            entries = []
        for entry in entries:
            match = _STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if match:
                step = int(match.group(1))
                found.append((step, self.fs.exists(f"{self.step_dir(step)}/{MARKER}")))
        return sorted(found)

    def step_folders(self) -> list[tuple[int, bool]]:
        """(step, committed) for every ``step-*`` folder, ascending."""
        return self._steps()

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending."""
        return [step for step, committed in self._steps() if committed]

    # -- writing (file primitives: stoker.runtime.checkpoint_files) ---------------------------
    def unwritable(self, step: int, error: BaseException) -> CheckpointWriteError | None:
        """The one-line error for a save of ``step`` that the file system refused (see
        :func:`stoker.runtime.checkpoint_files.unwritable`); None for any other error."""
        return unwritable(self.step_dir(step), self.rank, error)

    def save(self, step: int, shared: dict[str, Any] | None, rank_state: dict[str, Any],
             metrics: dict[str, float] | None = None, *, defer_copy: bool = False) -> None:
        """Save this rank's part of checkpoint ``step``; rank 0 also writes ``shared`` and commits.

        Every rank calls it at the same step. Without ``async_save`` it returns once this rank's
        files are serialized from the live tensors (nothing is copied first): they may change
        from then on. Making the files durable (fsync), the commit (rank 0, from every rank's
        digest) and the purge run in a background thread; ``wait()`` joins it (the next save
        and the end of an attempt do). With ``async_save`` the state is copied into reused host
        buffers and serialized in that thread too; the loop is blocked for the copy, or, with
        ``defer_copy``, not even for that.

        Args:
            defer_copy: (async only) take the host copy in the background thread as well: the
                caller must call ``wait_staged()`` before any tensor in ``shared`` or
                ``rank_state`` changes (the trainer does so before its next
                ``optimizer.step``), and must not mutate the containers meanwhile.

        Raises:
            CheckpointError: an earlier save's background part failed (``wait()`` raises it
                too), or the file system refused this save's serialization (a full disk: a
                ``CheckpointWriteError``, the one line of :meth:`unwritable`). Any other error
                while serializing propagates as it is. Either way the step stays uncommitted
                and no temporary file stays.
        """
        started = time.perf_counter()
        self.wait()  # the previous save is written: its staging buffers are free again
        state = {"shared": shared, "rank": rank_state}
        metrics = dict(metrics or {})
        if self.staging is None:
            # The loop waits for the serialization alone (the live tensors hold still until
            # their bytes are in the files); making them durable (fsync), the commit and the
            # purge run in the background, as an async save's do.
            try:
                written = self._serialize_step(step, shared, rank_state)
            except Exception as e:
                if (refused := self.unwritable(step, e)) is not None:
                    raise refused from e
                raise
            self._in_background(step, lambda: self._commit_step(step, written, metrics),
                                undo=lambda: discard(self.fs, written))
        else:
            ready = self.staging.begin()
            if not defer_copy:
                state, ready = self.staging.copy(state, ready), None
            self._in_background(
                step, lambda: self._stage_and_write(step, state, metrics, ready, defer_copy),
                undo=self.staging.cancel)
        self.last_blocking_s = time.perf_counter() - started

    def drop_spare(self) -> None:
        """Delete rank 0's spare ``shared.pt`` (see :func:`retire`): the job completed and
        saves no more, so it would only take disk."""
        if self.spare is not None:
            drop_spare(self.fs, self.spare)

    def wait_staged(self) -> float:
        """Block until the last save's host copy no longer reads the live tensors (call before
        they change: the next ``optimizer.step``). Returns the seconds blocked (0 when the copy
        had finished). On a GPU the compute stream waits for the copy, not the host."""
        return self.staging.wait() if self.staging is not None else 0.0

    def _in_background(self, step: int, work: Callable[[], None],
                       undo: Callable[[], None]) -> None:
        """Run ``work`` in the save's own thread (``ckpt-<step>-rank-<r>``, joined by
        :meth:`wait`, which raises its error in the training thread); ``undo`` when the thread
        cannot start (the error is then raised here)."""
        def guarded() -> None:
            try:
                work()
            except BaseException as e:  # re-raised in the training thread by wait()
                self._error, self._error_step = e, step

        self._pending = threading.Thread(target=guarded, name=f"ckpt-{step}-rank-{self.rank}",
                                         daemon=True)
        try:
            self._pending.start()
        except BaseException:
            self._pending = None
            undo()
            raise

    def _stage_and_write(self, step: int, state: dict, metrics: dict, ready: Any,
                         copy_here: bool) -> None:
        """An async save's background part: the host copy (``copy_here``, deferred), then the
        whole write of the step, retried when the store is remote."""
        if copy_here:
            state = self.staging.copy(state, ready)
        self.staging.settle()
        write = self._write_step_retried if self.remote else self._write_step
        write(step, state["shared"], state["rank"], metrics)

    def _write_step_retried(self, step: int, shared: dict | None, rank_state: dict,
                            metrics: dict) -> None:
        """Upload step ``step``, retrying; give it up (logged, no error) if the store stays
        down: the step stays uncommitted, so no reader trusts what part of it got there."""
        try:
            for attempt in Retrying(stop=stop_after_attempt(self.upload_attempts),
                                    wait=wait_exponential(multiplier=1, max=8), reraise=True):
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        log.warning("checkpoint %s: upload try %d of %d", self.step_dir(step),
                                    attempt.retry_state.attempt_number, self.upload_attempts)
                    self._write_step(step, shared, rank_state, metrics)
        except CheckpointError:
            raise  # a rank missing is no store outage: as on a local disk
        except Exception as e:  # botocore/aiohttp/OSError: the store is unreachable
            self.failed_saves.append(step)
            reason = f"{type(e).__name__}: {str(e)[:200]}"
            log.error("checkpoint %s not saved after %d tries (%s); training goes on, the "
                      "next save tries again", self.step_dir(step), self.upload_attempts, reason)
            if self.on_give_up is not None:
                self.on_give_up(step, reason)

    def _write_step(self, step: int, shared: dict | None, rank_state: dict,
                    metrics: dict | None = None) -> None:
        self._commit_step(step, self._serialize_step(step, shared, rank_state), metrics)

    def _serialize_step(self, step: int, shared: dict | None,
                        rank_state: dict) -> list[Written]:
        """This rank's files of ``step`` serialized (rank 0: its rank file, then ``shared.pt``),
        not yet durable: :meth:`_commit_step` finishes them."""
        folder = self.step_dir(step)
        private.fs_make_dir(self.fs, folder)
        written = [serialize(self.fs, f"{folder}/rank-{self.rank:05d}.pt", rank_state)]
        if self.rank == 0:
            try:
                written.append(serialize(self.fs, f"{folder}/shared.pt", shared, self.spare))
            except BaseException:
                discard(self.fs, written)
                raise
        return written

    def _remove_stale_temporaries(self, folder: str) -> None:
        """Delete this rank's ``*.tmp-<pid>`` files in ``folder`` that another process left (a
        save of the same step killed or refused in an earlier attempt); other ranks' are
        theirs."""
        own = [f"rank-{self.rank:05d}.pt", f"rank-{self.rank:05d}.pt{DIGEST_SUFFIX}"]
        if self.rank == 0:
            own += ["shared.pt", MARKER]
        mine = f".tmp-{os.getpid()}"
        try:
            entries = self.fs.ls(folder, detail=False)
        except (FileNotFoundError, OSError):
            return
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if any(name.startswith(f"{o}.tmp-") for o in own) and not name.endswith(mine):
                with contextlib.suppress(Exception):
                    self.fs.rm(entry)

    def _commit_step(self, step: int, written: list[Written],
                     metrics: dict | None = None) -> None:
        """Make this rank's files durable; rank > 0 publishes its digest, rank 0 commits from
        every rank's digest and purges. First it deletes what an earlier process of this rank
        left in the folder (a listing: in a bucket a request, off the training thread here)."""
        folder = self.step_dir(step)
        self._remove_stale_temporaries(folder)
        rank_file = f"rank-{self.rank:05d}.pt"
        digests: list[str] = []
        try:
            for w in written:
                digests.append(seal(self.fs, w))
        except BaseException:
            discard(self.fs, written[len(digests):])
            raise
        if self.rank != 0:
            # Rank 0 commits from this record: it never reads this rank's file.
            record = {"file": rank_file, "hash": digest.WRITTEN, "digest": digests[0],
                      "step": step}
            write_bytes(self.fs, f"{folder}/{rank_file}{DIGEST_SUFFIX}",
                        json.dumps(record).encode())
            return
        hashes = {"shared.pt": digests[1], rank_file: digests[0],
                  **self._rank_digests(folder, step)}
        marker = {"step": step, "world_size": self.world_size, "hash": digest.WRITTEN,
                  "files": hashes, "metrics": metrics or {}, "time": time.time()}
        if self.fence is not None:  # a node that lost the job commits nothing more
            try:
                self.fence()
            except LeaseLost as e:  # not an outage: never retried
                raise CheckpointError(f"{folder}: left uncommitted: {e}") from e
        write_bytes(self.fs, f"{folder}/{MARKER}", json.dumps(marker, indent=1).encode())
        self._verified.add(step)
        self._purge(step)

    def _rank_digests(self, folder: str, step: int) -> dict[str, str]:
        """{file name: digest} of ranks 1.. from their digest records, waiting for each up to
        ``commit_timeout_s``. A record that does not parse or names another file or step is
        waited on like a missing one (it may be a leftover the rank is about to replace).

        Raises:
            PeerGone: a rank is gone (``peer_gone`` says so) or wrote no record within
                ``commit_timeout_s``; a long wait is said in one line first (``PeerWait``).
        """
        waiting = PeerWait(f"checkpoint {folder}", self.commit_timeout_s, self.peer_gone)
        digests = {}
        for r in range(1, self.world_size):
            name = f"rank-{r:05d}.pt"
            path = f"{folder}/{name}{DIGEST_SUFFIX}"
            while (digest := self._read_digest(path, name, step)) is None:
                self.fs.invalidate_cache(folder)  # an object store's listing is cached
                waiting.check(r, f"its digest {name}{DIGEST_SUFFIX}")
                time.sleep(0.02)
            digests[name] = digest
        return digests

    def _read_digest(self, path: str, name: str, step: int) -> str | None:
        try:
            with self.fs.open(path, "rb") as f:
                record = json.loads(f.read())
        except (FileNotFoundError, ValueError):
            return None
        ok = (isinstance(record, dict) and record.get("file") == name
              and record.get("step") == step and record.get("hash") == digest.WRITTEN
              and isinstance(record.get("digest"), str))
        return record["digest"] if ok else None

    def wait(self) -> None:
        """Block until the pending async save (if any) is done; re-raise its error (a
        ``CheckpointWriteError`` when the file system refused it, ``PeerGone`` as it is, else
        ``CheckpointError``)."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, PeerGone):  # as it is: an infrastructure failure, not a save's
                raise error
            if (refused := self.unwritable(self._error_step, error)) is not None:
                raise refused from error
            raise CheckpointError(f"checkpoint save failed: {error}") from error

    def _purge(self, latest: int) -> None:
        """Keep the newest ``keep_latest_k`` verified steps at or below ``latest`` (always
        ``latest`` itself) and the best one; drop older ones and stale partial ones. Folders
        above ``latest`` are left alone; unusable committed ones are moved aside."""
        steps = self._steps()
        usable: list[int] = []
        for step in reversed([s for s, c in steps if c and s <= latest]):
            if len(usable) < self.keep_latest_k and self._usable(step):
                usable.append(step)
        keep = set(usable) | {latest}
        best = self.best_step([s for s, c in self._steps() if c and s <= latest])
        if best is not None:
            keep.add(best)
        for step, _ in steps:
            if step < latest and step not in keep and self.fs.exists(self.step_dir(step)):
                if self.spare is not None:  # the next save overwrites it (see retire)
                    retire(self.fs, f"{self.step_dir(step)}/shared.pt", self.spare)
                self.fs.rm(self.step_dir(step), recursive=True)
                self._verified.discard(step)

