"""The streaming ImageFolder: files listed once and cached, decoded per sample in workers, RGB at a
configured size, and augmentation seeded by (seed, epoch, sample) so that resume stays exact."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from streaming_support import make_rgb_folder
from torch.utils.data import DataLoader

from stoker.launch.local import LocalLauncher
from stoker.runtime.data import DataError, StepBatchSampler, image_folder
from stoker.runtime.imagefolder import list_cache_path


@pytest.fixture(scope="module")
def rgb_folder(tmp_path_factory) -> Path:
    return make_rgb_folder(tmp_path_factory.mktemp("rgb") / "data", per_class=48)


AUGMENTED = {"image_size": 12, "crop_scale": (0.5, 1.0), "hflip": True}


def global_batches(splits, epoch: int, start_step: int, world: int, workers: int,
                   batch: int = 8) -> list[torch.Tensor]:
    """Each step's global batch (rank shards concatenated) as one rank set would load it."""
    shards = []
    for rank in range(world):
        sampler = StepBatchSampler(len(splits.train), 0, epoch, start_step, batch, 1, rank, world)
        shards.append([x for x, _ in DataLoader(splits.train.for_epoch(epoch),
                                                batch_sampler=sampler, num_workers=workers)])
    return [torch.cat(parts) for parts in zip(*shards, strict=True)]


def test_augmented_pixels_do_not_depend_on_workers_world_size_or_resume_step(rgb_folder, tmp_path):
    splits = image_folder(str(rgb_folder), 0, 0.2, **AUGMENTED, job_dir=str(tmp_path))
    whole = global_batches(splits, epoch=1, start_step=0, world=1, workers=0)
    resumed = global_batches(splits, epoch=1, start_step=3, world=2, workers=2)
    assert len(resumed) == len(whole) - 3
    for a, b in zip(whole[3:], resumed, strict=True):
        assert torch.equal(a, b)
    # Augmentation is random per epoch, and off for validation.
    other_epoch = global_batches(splits, epoch=2, start_step=0, world=1, workers=0)
    assert not torch.equal(whole[0], other_epoch[0])
    assert torch.equal(splits.val[0][0], splits.val.for_epoch(5)[0][0])


def test_rgb_mixed_sizes_resized_and_listed_once(rgb_folder, tmp_path):
    splits = image_folder(str(rgb_folder), 0, 0.2, image_size=16, job_dir=str(tmp_path))
    assert splits.input_shape == (3, 16, 16) and splits.classes == ("c0", "c1")
    x, y = splits.train[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y in (0, 1)
    cache = list_cache_path(rgb_folder, tmp_path)
    listing = json.loads(cache.read_text())
    assert [len(c["files"]) for c in listing["classes"]] == [48, 48] and listing["colour"]
    # A torn cache (a crash mid-write) is listed again, not trusted.
    cache.write_text(cache.read_text()[:50])
    assert len(image_folder(str(rgb_folder), 0, 0.2, image_size=16,
                            job_dir=str(tmp_path)).train) == len(splits.train)
    assert json.loads(cache.read_text()) == listing
    normalised = image_folder(str(rgb_folder), 0, 0.2, image_size=16, mean=(0.5,) * 3,
                              std=(0.25,) * 3, job_dir=str(tmp_path))
    assert torch.allclose(normalised.train[0][0], (x - 0.5) / 0.25)


def test_mixed_sizes_without_image_size_and_bad_mean_are_named(rgb_folder, tmp_path):
    with pytest.raises(DataError, match="different sizes; set train.image_size"):
        image_folder(str(rgb_folder), 0, 0.2, job_dir=str(tmp_path))
    with pytest.raises(DataError, match="train.image_mean has 1 value"):
        image_folder(str(rgb_folder), 0, 0.2, image_size=8, mean=(0.5,), job_dir=str(tmp_path))


def test_pulled_dataset_lists_beside_itself(tmp_path):
    root = make_rgb_folder(tmp_path / ("0123456789abcdef0123456789abcdef"), per_class=2)
    assert list_cache_path(root, None) == tmp_path / "0123456789abcdef0123456789abcdef.files.json"


@pytest.mark.integration
def test_workers_and_random_augmentation_resume_bitwise_exact_and_at_another_world_size(
        rgb_folder, tmp_path):
    from conftest import Preemptor, events
    from test_runtime import assert_bitwise_equal, final_weights

    from stoker.config import TrainConfig
    from stoker.runtime.spec import RunSpec

    def run(job: str, preempt_at: int | None, worlds: tuple[int, ...] = (2, 2, 2)
            ) -> tuple[Path, list[int]]:
        job_dir = tmp_path / job
        job_dir.mkdir()
        train = TrainConfig(epochs=3, global_batch_size=8, checkpoint_every_steps=5,
                            num_workers=2, image_size=12, random_resized_crop=(0.5, 1.0),
                            horizontal_flip=True, lr=3e-3)
        RunSpec(train=train, data_dir=str(rgb_folder), job_dir=str(job_dir)).dump(
            job_dir / "spec.yaml")
        codes = []
        for attempt, world in enumerate(worlds):
            launcher = LocalLauncher(world, shutdown_grace_s=20, python=sys.executable)
            if preempt_at and attempt == 0:
                Preemptor(launcher, job_dir, at_step=preempt_at).start()
            codes.append(launcher.run(job_dir / "spec.yaml"))
            if codes[-1] == 0:
                break
        return job_dir / "spec.yaml", codes

    reference, codes = run("reference", None)
    assert codes == [0]
    result = json.loads((reference.parent / "result.json").read_text())
    assert result["input_shape"] == [3, 12, 12] and result["total_steps"] == 27
    assert result["metrics"]["val_accuracy"] > 0.5  # RGB mixed-size images are learnt
    resumed, codes = run("resumed", preempt_at=13)  # mid-epoch 2 (9 steps per epoch)
    assert codes == [75, 0]
    assert_bitwise_equal(final_weights(resumed), final_weights(reference))
    # Resumed at world size 1 (same global batches, one rank): every step runs exactly once.
    other, codes = run("other-world", preempt_at=13, worlds=(2, 1))
    assert codes == [75, 0]
    steps = [e["step"] for e in events(other.parent) if e["event"] == "step"]
    assert steps == list(range(1, 28))
    assert json.loads((other.parent / "result.json").read_text())["world_size"] == 1


def test_pull_step_accepts_mixed_sizes_once_image_size_is_set(rgb_folder):
    from stoker.data.prepare import PreparedDataset
    from stoker.data.pull import DatasetError
    from stoker.data.validate import validate_image_folder

    summary = validate_image_folder(rgb_folder)
    assert (summary.height, summary.width, summary.channels) == (None, None, 3)
    ref = type("Ref", (), {"local_path": str(rgb_folder), "path": "data/colours", "rev": "v1",
                           "repo_url": "/home/me/colours"})()
    prepared = PreparedDataset(ref, summary)
    with pytest.raises(DatasetError, match="set train.image_size") as info:
        prepared.input_shape("auto")
    # QA: the message named the md5 folder and no file; now the dataset and one file per size
    message = str(info.value)
    assert message.startswith("dataset data/colours@v1 of /home/me/colours: images have "
                              "different sizes ("), message
    examples = message.split(" (", 1)[1].split(")", 1)[0].split("; ")
    assert len(examples) == 2 and examples[0].split(":")[0] != examples[1].split(":")[0]
    for example in examples:
        size, name = example.split(" px: ")
        width, height = map(int, size.split("x"))
        with Image.open(rgb_folder / name) as image:
            assert image.size == (width, height)
    assert prepared.input_shape("auto", 24) == (3, 24, 24)


def test_explicit_size_and_channels_list_names_without_reading_files(rgb_folder, tmp_path,
                                                                     monkeypatch):
    from stoker.runtime import imagefolder

    def no_probe(file):
        raise AssertionError(f"{file}: header read although size and channels are configured")

    with monkeypatch.context() as patch:
        patch.setattr(imagefolder, "_probe", no_probe)
        splits = image_folder(str(rgb_folder), 0, 0.2, 3, image_size=12, job_dir=str(tmp_path))
    assert splits.input_shape == (3, 12, 12) and len(splits.train) + len(splits.val) == 96
    # Auto channels later on the same cache: the headers are read then, once.
    assert image_folder(str(rgb_folder), 0, 0.2, image_size=12,
                        job_dir=str(tmp_path)).input_shape == (3, 12, 12)


def test_small_dataset_without_workers_decodes_each_file_once(tmp_path, monkeypatch):
    from stoker.runtime import imagefolder

    same_size = make_rgb_folder(tmp_path / "same", per_class=48, sides=(16, 17))
    opened = []
    original = imagefolder.open_image
    monkeypatch.setattr(imagefolder, "open_image", lambda path, c: opened.append(path)
                        or original(path, c))
    splits = image_folder(str(same_size), 0, 0.2, **AUGMENTED, job_dir=str(tmp_path))
    first = global_batches(splits, epoch=0, start_step=0, world=1, workers=0)
    again = global_batches(splits, epoch=0, start_step=0, world=1, workers=0)
    second = global_batches(splits, epoch=1, start_step=0, world=1, workers=0)
    # Each file opened once: a repeated epoch and a new one (re-augmented) decode nothing again.
    assert len(opened) == len(set(opened)) > len(first) * 8
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], second[0])


def test_file_names_beyond_ascii(tmp_path):
    from PIL import Image

    for name in ("café", "日本"):
        (tmp_path / "data" / name).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (6, 6), (i * 40, 0, 0)).save(tmp_path / "data" / name / f"ü{i}.png")
    splits = image_folder(str(tmp_path / "data"), 0, 0.3, job_dir=str(tmp_path / "job"))
    assert splits.classes == ("café", "日本") and splits.input_shape == (3, 6, 6)
    assert [splits.train[i][0].shape for i in range(len(splits.train))] == [(3, 6, 6)] * 4


def test_sample_random_is_a_function_of_seed_epoch_and_index_alone():
    """Each sample's draws come from (seed, epoch, index) alone, in [0, 1) and [a, b], also past
    the first block of eight words (a crop that needed several tries)."""
    from stoker.runtime.imagefolder import SampleRandom

    def draws(seed: int, epoch: int, index: int, n: int = 20) -> list[float]:
        rng = SampleRandom(seed, epoch, index)
        return [rng.random() for _ in range(n)]

    assert draws(0, 1, 7) == draws(0, 1, 7)
    assert len({tuple(draws(*key)) for key in [(0, 1, 7), (1, 1, 7), (0, 2, 7), (0, 1, 8),
                                                (0, 17, 1), (0, 1, 71)]}) == 6
    values = [v for i in range(500) for v in draws(3, 0, i)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert 0.48 < sum(values) / len(values) < 0.52  # 10,000 uniform draws: sd of the mean 0.003
    ints = [SampleRandom(3, 0, i).randint(2, 5) for i in range(2000)]
    assert set(ints) == {2, 3, 4, 5}
    assert all(400 < ints.count(k) < 600 for k in range(2, 6))
    rng = SampleRandom(3, 0, 1)
    assert 1.0 <= rng.uniform(1.0, 3.0) < 3.0
