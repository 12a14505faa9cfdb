import json
import threading
import time

import pytest
import torch

from stoker.runtime.checkpoint import MARKER, Checkpointer, CheckpointError


def state(step: int) -> dict:
    return {"model": {"w": torch.full((4,), float(step))}, "step": step}


def save_all_ranks(location, step, world_size=2, async_save=False):
    """Save one checkpoint from ``world_size`` checkpointers (ranks) concurrently."""
    ckpts = [Checkpointer(location, r, world_size, keep_latest_k=2, async_save=async_save)
             for r in range(world_size)]
    threads = [threading.Thread(target=c.save, args=(step, state(step) if c.rank == 0 else None,
                                                     {"rng": c.rank}))
               for c in ckpts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in ckpts:
        c.wait()
    return ckpts


def test_commit_latest_and_retention(tmp_path):
    for step in (10, 20, 30):
        save_all_ranks(str(tmp_path), step)
    ckpt = Checkpointer(str(tmp_path), 1, 2)
    assert ckpt.committed_steps() == [20, 30]  # keep_latest_k=2 purged step 10
    loaded = ckpt.load_latest()
    assert loaded.step == 30 and loaded.rank_state == {"rng": 1}
    assert torch.equal(loaded.shared["model"]["w"], torch.full((4,), 30.0))
    marker = json.loads((tmp_path / "step-000000030" / MARKER).read_text())
    assert set(marker["files"]) == {"shared.pt", "rank-00000.pt", "rank-00001.pt"}


def test_uncommitted_checkpoint_is_never_chosen(tmp_path):
    save_all_ranks(str(tmp_path), 10)
    save_all_ranks(str(tmp_path), 20)
    (tmp_path / "step-000000020" / MARKER).unlink()  # killed before the commit
    (tmp_path / "step-000000020" / "shared.pt").write_bytes(b"half")
    warnings = []
    loaded = Checkpointer(str(tmp_path), 0, 2).load_latest(warn=warnings.append)
    assert loaded.step == 10
    assert "step-000000020" in warnings[0]
    # killed or refused by a full disk: the reader cannot tell (trial: "interrupted save" only)
    assert "no COMMITTED marker (its save did not finish: interrupted, or refused by the " \
        "storage)" in warnings[0]


def test_corrupt_committed_checkpoint_falls_back_with_reason(tmp_path):
    save_all_ranks(str(tmp_path), 10)
    save_all_ranks(str(tmp_path), 20)
    shard = tmp_path / "step-000000020" / "rank-00001.pt"
    shard.write_bytes(shard.read_bytes()[:-3] + b"xyz")
    warnings = []
    loaded = Checkpointer(str(tmp_path), 0, 2).load_latest(warn=warnings.append)
    assert loaded.step == 10  # every rank rejects step 20, not only rank 1
    assert "rank-00001.pt: its bytes do not match their xxh3_128 digest in COMMITTED" in warnings[0]


def test_other_world_size_gets_no_rank_state(tmp_path):
    save_all_ranks(str(tmp_path), 10, world_size=2)
    loaded = Checkpointer(str(tmp_path), 0, 3).load_latest()
    assert loaded.step == 10 and loaded.world_size == 2 and loaded.rank_state is None


def test_async_save_blocks_only_for_the_host_copy(tmp_path):
    ckpts = save_all_ranks(str(tmp_path), 10, world_size=1, async_save=True)
    assert ckpts[0].committed_steps() == [10]


def test_missing_rank_file_leaves_checkpoint_uncommitted(tmp_path):
    ckpt = Checkpointer(str(tmp_path), 0, 2, commit_timeout_s=0.2)
    ckpt.save(10, state(10), {"rng": 0})  # the commit waits in the background
    with pytest.raises(CheckpointError, match="rank 1 did not write"):
        ckpt.wait()
    assert ckpt.committed_steps() == []
    assert Checkpointer(str(tmp_path), 0, 2).load_latest(warn=lambda m: None) is None


def test_a_synchronous_save_returns_once_serialized_and_commits_in_the_background(tmp_path):
    """Without async_save the loop waits for the serialization alone: the fsync, the wait for
    the other ranks' digests, the commit and the purge do not hold it. The live tensors may
    change once ``save`` returns; the checkpoint keeps the values they had."""
    rank0, rank1 = (Checkpointer(str(tmp_path), r, 2, commit_timeout_s=60) for r in (0, 1))
    live = state(10)
    started = time.monotonic()
    rank0.save(10, live, {"rng": 0})  # rank 1 has written nothing yet
    assert time.monotonic() - started < 30  # it did not wait for rank 1 (commit timeout 60 s)
    live["model"]["w"].fill_(-1.0)  # the next optimizer.step
    assert rank0.committed_steps() == []
    rank1.save(10, None, {"rng": 1})
    rank1.wait()
    rank0.wait()
    assert rank0.committed_steps() == [10]
    loaded = Checkpointer(str(tmp_path), 0, 2).load_latest()
    assert torch.equal(loaded.shared["model"]["w"], torch.full((4,), 10.0))


def test_a_synchronous_save_that_cannot_serialize_raises_at_once_and_commits_nothing(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle this")

    ckpt = Checkpointer(str(tmp_path), 0, 1)
    with pytest.raises(TypeError, match="cannot pickle this"):  # not the file system: as it is
        ckpt.save(10, {"model": Unpicklable()}, {"rng": 0})
    ckpt.wait()
    assert ckpt.committed_steps() == []
    assert Checkpointer(str(tmp_path), 0, 1).load_latest(warn=lambda m: None) is None


def test_a_full_disk_is_one_named_error_and_leaves_no_temporary_files(tmp_path, monkeypatch):
    """ENOSPC while serializing (torch's zip writer then raises its own RuntimeError with the
    OSError as context) or at the background fsync: one CheckpointError naming the step's
    folder, the cause and checkpoint_dir; no ``*.tmp-*`` file left; nothing committed."""
    import errno
    import os

    from stoker.runtime import staging

    real_write = staging.HashingWriter.write

    def full(self, data):  # the disk fills up 1000 bytes into a file (rank 0's shared.pt)
        if self.size_bytes > 1000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    big = {"model": {"w": torch.randn(64, 64)}}
    monkeypatch.setattr(staging.HashingWriter, "write", full)
    ckpt = Checkpointer(str(tmp_path), 0, 1)
    with pytest.raises(CheckpointError) as info:
        ckpt.save(5, big, {"rng": 0})
    message = str(info.value)
    assert "step-000000005" in message and "No space left on device" in message, message
    assert "checkpoint_dir" in message and "\n" not in message
    monkeypatch.setattr(staging.HashingWriter, "write", real_write)

    def fsync_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync_full)
    ckpt.save(6, big, {"rng": 0})  # serialized; the fsync fails in the background
    with pytest.raises(CheckpointError, match=r"step-000000006: rank 0 could not write it "
                                              r"\(No space left on device\)"):
        ckpt.wait()
    assert [p.name for p in tmp_path.rglob("*") if ".tmp-" in p.name] == []
    assert ckpt.committed_steps() == []



def test_a_digest_record_the_disk_has_no_room_for_leaves_no_temporary_file(tmp_path,
                                                                        monkeypatch):
    """Rank 1's state file fits on the disk, its small digest record then does not: the
    record's ``*.tmp-<pid>`` stayed (the full-disk test failed that way under load, when rank
    0's files filled the disk a moment later than usual). A failed small write deletes its
    temporary file too."""
    import errno

    from stoker.runtime import checkpoint_files
    from stoker.runtime.checkpoint import DIGEST_SUFFIX

    real_sync = checkpoint_files.sync

    def sync(f):
        if DIGEST_SUFFIX + ".tmp-" in str(getattr(f, "path", "")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_sync(f)

    monkeypatch.setattr(checkpoint_files, "sync", sync)
    ckpt = Checkpointer(str(tmp_path), 1, 2)
    ckpt.save(5, None, {"rng": 0})
    with pytest.raises(CheckpointError, match="No space left on device"):
        ckpt.wait()
    assert [p.name for p in tmp_path.rglob("*") if ".tmp-" in p.name] == []

def test_a_save_removes_its_own_rank_s_temporaries_left_by_an_earlier_process(tmp_path):
    """A save of a step that a killed or refused attempt also tried: its ``*.tmp-<pid>`` files
    of this rank are removed (they would stay inside the committed folder); another rank's
    are left to that rank."""
    folder = tmp_path / "step-000000005"
    folder.mkdir()
    for name in ("rank-00000.pt.tmp-99999", "shared.pt.tmp-99999", "rank-00001.pt.tmp-99999"):
        (folder / name).write_bytes(b"x" * 100)
    ckpt = Checkpointer(str(tmp_path), 0, 1)
    listed_in: list[str] = []  # the folder's listing (a request in a bucket): not the loop's
    listing = ckpt.fs.ls
    ckpt.fs.ls = lambda *a, **k: (listed_in.append(threading.current_thread().name),
                                  listing(*a, **k))[1]
    try:
        ckpt.save(5, state(5), {"rng": 0})
        ckpt.wait()
    finally:
        del ckpt.fs.ls
    assert sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name) == [
        "rank-00001.pt.tmp-99999"]
    assert ckpt.committed_steps() == [5]
    assert listed_in and threading.main_thread().name not in listed_in, listed_in


def test_fsspec_url_location():
    location = "memory://stoker-test/ckpts"
    save_all_ranks(location, 5, world_size=1)
    loaded = Checkpointer(location, 0, 1).load_latest()
    assert loaded.step == 5 and loaded.path.endswith("step-000000005")


def test_retention_also_keeps_the_best_by_metric(tmp_path):
    accuracy = {10: 0.80, 20: 0.95, 30: 0.90, 40: 0.85, 50: 0.70}
    for step, value in accuracy.items():
        ckpt = Checkpointer(str(tmp_path), 0, 1, keep_latest_k=2,
                            keep_best=("val_accuracy", "max"))
        ckpt.save(step, state(step), {"rng": 0}, metrics={"val_accuracy": value})
        ckpt.wait()
    assert ckpt.committed_steps() == [20, 40, 50]  # latest two plus the best (step 20)
    assert ckpt.best_step() == 20
    low = Checkpointer(str(tmp_path), 0, 1, keep_best=("val_accuracy", "min"))
    assert low.best_step() == 50


def test_files_are_hashed_with_xxh3_128_and_written_without_the_zip_crc(tmp_path):
    """Issue 45: a save's digest is xxh3-128 (named in COMMITTED and in each rank's record) and
    torch's zip writer skips its per-record CRC-32 (the digest covers every byte); the files
    load as before, and torch's process-wide CRC option is left as it was."""
    import zipfile

    from stoker.runtime import digest

    save_all_ranks(str(tmp_path), 10)
    folder = tmp_path / "step-000000010"
    marker = json.loads((folder / MARKER).read_text())
    assert marker["hash"] == "xxh3_128"
    for name, recorded in marker["files"].items():
        assert len(recorded) == 32 and digest.of((folder / name).read_bytes()) == recorded
        with zipfile.ZipFile(folder / name) as archive:
            assert [i.CRC for i in archive.infolist()] == [0] * len(archive.infolist()), name
    record = json.loads((folder / "rank-00001.pt.digest").read_text())
    assert record == {"file": "rank-00001.pt", "hash": "xxh3_128",
                      "digest": marker["files"]["rank-00001.pt"], "step": 10}
    assert torch.serialization.get_crc32_options() is True
    loaded = Checkpointer(str(tmp_path), 1, 2).load_latest()
    assert loaded.step == 10 and loaded.rank_state == {"rng": 1}
    assert torch.equal(loaded.shared["model"]["w"], torch.full((4,), 10.0))


def test_a_checkpoint_written_with_sha256_before_still_loads(tmp_path):
    """A COMMITTED without ``hash`` (every checkpoint before xxh3-128) is read as sha256: a job
    resumes from it after an upgrade."""
    import hashlib

    save_all_ranks(str(tmp_path), 10)
    folder = tmp_path / "step-000000010"
    marker = json.loads((folder / MARKER).read_text())
    del marker["hash"]
    marker["files"] = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest()
                       for n in marker["files"]}
    (folder / MARKER).write_text(json.dumps(marker))
    loaded = Checkpointer(str(tmp_path), 0, 2).load_latest()
    assert loaded.step == 10 and loaded.rank_state == {"rng": 0}


@pytest.mark.parametrize("name", ["md5", "x'; rm -rf /", 7])
def test_an_unknown_digest_in_committed_sets_the_step_aside_by_name(tmp_path, name):
    """The digest's name comes from a file in a shared folder: anything but a known one is an
    unusable step, set aside with the name in its reason, and the previous one is loaded."""
    save_all_ranks(str(tmp_path), 10)
    save_all_ranks(str(tmp_path), 20)
    path = tmp_path / "step-000000020" / MARKER
    marker = json.loads(path.read_text())
    marker["hash"] = name
    path.write_text(json.dumps(marker))
    warnings = []
    loaded = Checkpointer(str(tmp_path), 0, 2).load_latest(warn=warnings.append)
    assert loaded.step == 10
    assert f"COMMITTED: unknown digest {str(name)!r} (known: sha256, xxh3_128)" in warnings[0]


def big_state(step: int, n: int) -> dict:
    return {"model": {"w": torch.full((n,), float(step))}, "step": step}


def test_a_purged_shared_file_is_overwritten_by_the_next_save_not_reallocated(tmp_path):
    """Rank 0 keeps a purged step's shared.pt as the spare and its next save overwrites that
    file in place (its cached pages, no new ones; see checkpoint_files.retire), cut to the new
    length: the smaller state saved into the larger spare loads and verifies."""
    ckpt = Checkpointer(str(tmp_path), 0, 1, keep_latest_k=1)
    spare = tmp_path / ".spare-shared.pt"
    ckpt.save(1, big_state(1, 50_000), {"rng": 0})
    ckpt.save(2, big_state(2, 50_000), {"rng": 0})
    ckpt.wait()
    assert ckpt.committed_steps() == [2] and spare.is_file()
    inode = spare.stat().st_ino
    ckpt.save(3, big_state(3, 10), {"rng": 0})
    ckpt.wait()
    written = tmp_path / "step-000000003" / "shared.pt"
    assert written.stat().st_ino == inode  # the spare's file, renamed
    assert written.stat().st_mode & 0o777 == 0o600
    assert written.stat().st_size < 10_000  # cut to what the small state wrote
    assert spare.is_file()  # step 2's, kept in turn
    loaded = Checkpointer(str(tmp_path), 0, 1).load_latest()  # digests verified
    assert loaded.step == 3 and torch.equal(loaded.shared["model"]["w"], torch.full((10,), 3.0))


@pytest.mark.parametrize("planted", ["symlink", "hardlink", "fifo", "folder"])
def test_a_spare_planted_in_a_shared_folder_is_never_written_through(tmp_path, planted):
    """The checkpoint folder may be shared: a spare that is a link to another file is
    dropped, the file behind it keeps its bytes, and the save writes a new file. A folder
    there is left where it is (trial: it was moved into the step and the save failed, exit
    74), a FIFO deleted."""
    import os

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(str(root), 0, 1, keep_latest_k=1)
    spare = root / ".spare-shared.pt"
    if planted == "symlink":
        spare.symlink_to(victim)
    elif planted == "hardlink":
        spare.hardlink_to(victim)
    elif planted == "fifo":
        os.mkfifo(spare)
    else:
        spare.mkdir()
        (spare / "inner").write_bytes(b"theirs")
    ckpt.save(1, big_state(1, 1000), {"rng": 0})
    ckpt.wait()
    assert victim.read_bytes() == b"precious"
    if planted == "folder":
        assert (spare / "inner").read_bytes() == b"theirs"
    else:
        assert not spare.exists() and not spare.is_symlink()
    assert sorted(p.name for p in (root / "step-000000001").iterdir()) == [
        "COMMITTED", "rank-00000.pt", "shared.pt"]
    assert Checkpointer(str(root), 0, 1).load_latest().step == 1


def test_a_completed_job_drops_its_spare(tmp_path):
    """Trial: every finished job kept its spare forever (disk, no use)."""
    ckpt = Checkpointer(str(tmp_path), 0, 1, keep_latest_k=1)
    for step in (1, 2):
        ckpt.save(step, big_state(step, 1000), {"rng": 0})
    ckpt.wait()
    assert (tmp_path / ".spare-shared.pt").is_file()
    ckpt.drop_spare()
    assert not (tmp_path / ".spare-shared.pt").exists()
    assert Checkpointer(str(tmp_path), 0, 1).load_latest().step == 2


def test_only_rank_0_on_the_local_disk_keeps_a_spare(tmp_path):
    assert Checkpointer(str(tmp_path), 1, 2).spare is None  # its rank file is small
    assert Checkpointer("memory://spare-test", 0, 1).spare is None
