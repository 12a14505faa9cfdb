"""Overlapped checkpoint staging (issue 17): the host copy taken at the right time into reused
buffers, hashes computed while writing, rank 0 committing from the ranks' own digests, and a stop
during a background copy still committing."""

from __future__ import annotations

import copy
import json
import os
import signal
import threading
import time

import pytest
import torch

from stoker.runtime import digest
from stoker.runtime.checkpoint import MARKER, Checkpointer, CheckpointError
from stoker.runtime.distributed import DistEnv
from stoker.runtime.preemption import StopFlag
from stoker.runtime.spec import RunSpec
from stoker.runtime.trainer import Trainer

SINGLE = DistEnv(0, 0, 1, torch.device("cpu"), None)


def tensors(obj, prefix=""):
    """{path: tensor} of every tensor in a nested state."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) \
        if isinstance(obj, list | tuple) else ()
    found = {}
    for key, value in items:
        found.update(tensors(value, f"{prefix}/{key}"))
    return found


def assert_bitwise(a, b) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        x, y = ta[key].contiguous(), tb[key].contiguous()
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), key


def model_and_optimizer(width: int = 64):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer


def forward_backward(model, optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(16, model[0].in_features)).square().mean().backward()


def slow_copy(ckpt: Checkpointer, monkeypatch, delay_s: float, before=lambda: None) -> None:
    """Make the host copy start ``delay_s`` late, so the training thread gets ahead of it."""
    stage = ckpt.staging._stager.stage

    def slow(state, non_blocking=False):
        time.sleep(delay_s)
        before()
        return stage(state, non_blocking=non_blocking)

    monkeypatch.setattr(ckpt.staging._stager, "stage", slow)


def test_deferred_copy_holds_the_weights_after_step_n(tmp_path, monkeypatch):
    model, optimizer = model_and_optimizer()
    forward_backward(model, optimizer)
    optimizer.step()  # step N = 1
    reference = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    sync = Checkpointer(str(tmp_path / "sync"), 0, 1)
    sync.save(1, reference, {"rng": 0})
    sync.wait()

    ckpt = Checkpointer(str(tmp_path / "async"), 0, 1, async_save=True)
    slow_copy(ckpt, monkeypatch, 0.3)
    ckpt.save(1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, {"rng": 0},
              defer_copy=True)
    assert ckpt.last_blocking_s < 0.2  # the loop did not wait for the copy
    model.eval()  # (BatchNorm buffers frozen here; the trainer clones them instead)
    forward_backward(model, optimizer)  # step N+1's forward/backward overlaps the copy
    assert ckpt.wait_staged() > 0.1  # it had not finished: the step waits for it
    optimizer.step()  # the weights of step N+1
    assert not torch.equal(model[0].weight, reference["model"]["0.weight"])
    ckpt.wait()

    saved = Checkpointer(str(tmp_path / "async"), 0, 1).load_step(1).shared
    assert_bitwise(saved, reference)
    assert_bitwise(saved, Checkpointer(str(tmp_path / "sync"), 0, 1).load_step(1).shared)


def test_staging_buffers_are_reused_across_saves(tmp_path):
    model, optimizer = model_and_optimizer()
    ckpt = Checkpointer(str(tmp_path), 0, 1, keep_latest_k=5, async_save=True)
    pointers = []
    for step in (1, 2):
        forward_backward(model, optimizer)
        optimizer.step()
        ckpt.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                  {"rng": step}, defer_copy=True)
        ckpt.wait_staged()
        staged = tensors(ckpt.staging.staged)
        pointers.append({k: t.data_ptr() for k, t in staged.items() if t.numel() > 1})
        ckpt.wait()
        saved = Checkpointer(str(tmp_path), 0, 1).load_step(step).shared
        assert_bitwise(saved, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    assert pointers[0] == pointers[1] and len(pointers[0]) >= 6  # weights and both moments

    other, _ = model_and_optimizer(width=32)  # other shapes: other buffers, right contents
    ckpt.save(3, {"model": other.state_dict()}, {"rng": 3})
    ckpt.wait()
    assert tensors(ckpt.staging.staged)["/shared/model/0.weight"].data_ptr() \
        not in pointers[0].values()
    assert_bitwise(Checkpointer(str(tmp_path), 0, 1).load_step(3).shared,
                   {"model": other.state_dict()})


def test_commit_marker_takes_the_ranks_digests_without_reading_their_files(tmp_path,
                                                                          monkeypatch):
    ckpts = [Checkpointer(str(tmp_path), r, 2) for r in range(2)]
    opened: list[tuple[str, str, str]] = []
    fs_open = ckpts[0].fs.open  # one fsspec instance serves both "ranks"

    def spy(path, mode="rb", *args, **kwargs):
        opened.append((threading.current_thread().name, str(path), mode))
        return fs_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(ckpts[0].fs, "open", spy)
    big = {"w": torch.randn(256, 256)}
    threads = [threading.Thread(target=c.save, name=f"rank-{c.rank}",
                                args=(7, big if c.rank == 0 else None, {"rng": torch.randn(99)}))
               for c in ckpts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in ckpts:
        c.wait()  # the commit runs in the background (thread ckpt-7-rank-0 on rank 0)

    folder = tmp_path / "step-000000007"
    marker = json.loads((folder / MARKER).read_text())
    for name, recorded in marker["files"].items():
        assert digest.of((folder / name).read_bytes(), marker["hash"]) == recorded, name
    assert set(marker["files"]) == {"shared.pt", "rank-00000.pt", "rank-00001.pt"}
    rank0_reads = [p for who, p, mode in opened
                   if who in ("rank-0", "ckpt-7-rank-0") and "r" in mode]
    assert not [p for p in rank0_reads if p.endswith(".pt")], rank0_reads
    assert any(p.endswith("rank-00001.pt.digest") for p in rank0_reads)


def train_job(make_spec, monkeypatch, job: str, delay_s: float = 0.0, **train):
    spec = RunSpec.load(make_spec(job, tracking=False, epochs=1, checkpoint_every_steps=4,
                                  keep_latest_k=10, **train))
    trainer = Trainer(spec, SINGLE, StopFlag())
    if trainer.ckpt.async_save:
        slow_copy(trainer.ckpt, monkeypatch, delay_s)
    outcome = trainer.train()
    trainer.close(outcome)
    return trainer, Checkpointer(spec.checkpoint_location, 0, 1)


@pytest.mark.integration
def test_async_trainer_checkpoints_equal_synchronous_ones_bitwise(make_spec, monkeypatch):
    """The copy overlapping the next step's forward (BatchNorm buffers change there) and
    finishing before its optimizer.step: each checkpoint holds exactly the state a synchronous
    save at that step holds."""
    sync, sync_ckpt = train_job(make_spec, monkeypatch, "sync")
    overlapped, async_ckpt = train_job(make_spec, monkeypatch, "async", delay_s=0.5,
                                       async_checkpoint=True)
    steps = sync_ckpt.committed_steps()
    assert len(steps) >= 5 and async_ckpt.committed_steps() == steps
    assert overlapped.timings["checkpoint"] > 0
    for step in steps:
        a, b = sync_ckpt.load_step(step), async_ckpt.load_step(step)
        for key in ("model", "optimizer", "scheduler", "scaler", "step"):
            assert_bitwise({key: a.shared[key]}, {key: b.shared[key]})
        assert_bitwise(a.rank_state, b.rank_state)
    assert_bitwise(sync.module.state_dict(), overlapped.module.state_dict())


@pytest.mark.integration
def test_sigterm_during_a_background_copy_still_commits(make_spec, monkeypatch):
    spec = RunSpec.load(make_spec("stop", tracking=False, epochs=1, checkpoint_every_steps=4,
                                  keep_latest_k=10, async_checkpoint=True))
    previous = signal.getsignal(signal.SIGTERM)
    stop = StopFlag().install((signal.SIGTERM,))
    try:
        trainer = Trainer(spec, SINGLE, stop)
        signalled = []

        def sigterm_once() -> None:  # runs in the writer thread, before the copy of step 4
            if not signalled:
                signalled.append(trainer.step)
                os.kill(os.getpid(), signal.SIGTERM)

        slow_copy(trainer.ckpt, monkeypatch, 0.2, before=sigterm_once)
        outcome = trainer.train()
        trainer.close(outcome)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert outcome == "preempted" and signalled == [4]
    ckpt = Checkpointer(spec.checkpoint_location, 0, 1)
    assert ckpt.committed_steps() == [4, 5]  # the one copying, then the stop checkpoint
    loaded = ckpt.load_latest()
    assert loaded.step == trainer.step == 5
    assert_bitwise(loaded.shared["model"], trainer.module.state_dict())
    assert_bitwise(loaded.shared["optimizer"], trainer.optimizer.state_dict())


def test_a_torn_or_foreign_digest_record_is_not_committed(tmp_path):
    """Rank 0 trusts only a whole record for this file at this step: a torn one, or one left by
    another step, is waited on like a missing one and the step stays uncommitted."""
    folder = tmp_path / "step-000000009"
    folder.mkdir()
    record = folder / "rank-00001.pt.digest"
    for content in ('{"file": "rank-00001.pt", "sha2', json.dumps(
            {"file": "rank-00001.pt", "hash": "xxh3_128", "digest": "0" * 32, "step": 8})):
        record.write_text(content)
        ckpt = Checkpointer(str(tmp_path), 0, 2, commit_timeout_s=0.3)
        ckpt.save(9, {"w": torch.ones(3)}, {"rng": 0})
        with pytest.raises(CheckpointError, match="rank 1 did not write .*rank-00001.pt.digest"):
            ckpt.wait()
        assert ckpt.committed_steps() == []
    for rank, shared in ((1, None), (0, {"w": torch.ones(3)})):  # rank 1's record replaces it
        ckpt = Checkpointer(str(tmp_path), rank, 2)
        ckpt.save(9, shared, {"rng": rank})
        ckpt.wait()
    assert Checkpointer(str(tmp_path), 1, 2).load_latest().rank_state == {"rng": 1}
