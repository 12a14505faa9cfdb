import pytest
import torch

from stoker.runtime.data import (
    DataError,
    StepBatchSampler,
    check_divisible,
    epoch_order,
    split_indices,
)


def test_epoch_order_depends_only_on_seed_and_epoch():
    assert torch.equal(epoch_order(100, 1, 3), epoch_order(100, 1, 3))
    assert not torch.equal(epoch_order(100, 1, 3), epoch_order(100, 1, 4))
    assert sorted(epoch_order(100, 1, 3).tolist()) == list(range(100))


def test_split_is_deterministic_and_disjoint():
    train, val = split_indices(1797, 0.2, seed=0)
    again_train, again_val = split_indices(1797, 0.2, seed=0)
    assert torch.equal(train, again_train) and torch.equal(val, again_val)
    assert len(val) == 359 and len(train) == 1438
    assert not set(train.tolist()) & set(val.tolist())


def step_samples(world: int, accum: int, start: int, global_batch: int = 48, n: int = 500):
    """Per step, the set of samples all ranks see together."""
    per_rank = [list(StepBatchSampler(n, 7, 2, start, global_batch, accum, r, world))
                for r in range(world)]
    steps = []
    for s in range(len(per_rank[0]) // accum):
        seen = []
        for r in range(world):
            for micro in per_rank[r][s * accum:(s + 1) * accum]:
                seen.extend(micro)
        steps.append(seen)
    return steps


@pytest.mark.parametrize(("world", "accum"), [(1, 1), (2, 1), (3, 1), (2, 2), (4, 3)])
def test_every_world_size_sees_the_same_global_batches(world, accum):
    reference = step_samples(1, 1, start=0)
    steps = step_samples(world, accum, start=0)
    assert [sorted(s) for s in steps] == [sorted(s) for s in reference]
    assert all(len(s) == len(set(s)) == 48 for s in steps)  # no sample twice in a step


def test_resuming_mid_epoch_continues_the_same_order():
    full = step_samples(2, 1, start=0)
    resumed_other_world = step_samples(3, 1, start=4)
    assert [sorted(s) for s in resumed_other_world] == [sorted(s) for s in full[4:]]


def test_indivisible_world_size_is_refused_by_name():
    check_divisible(64, 1, 2)
    with pytest.raises(DataError, match=r"train.global_batch_size=64 .* world size 3"):
        check_divisible(64, 1, 3)
