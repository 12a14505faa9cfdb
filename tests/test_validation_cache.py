"""The pull step's validation at real size: headers only, in a pool, cached by the DVC hash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from data_repos import make_repo

from stoker.config import load_pipeline_config
from stoker.data.pull import DatasetError, pull_dataset

pytestmark = pytest.mark.integration

THREE = {"one": 4, "two": 4, "three": 4}


def _config(repo: Path, work: Path, rev: str):
    return load_pipeline_config(None, [f"work_dir={work}", f"data.repo_url={repo}",
                                       f"data.rev={rev}", "data.path=data/images"])


@pytest.fixture()
def counted(monkeypatch) -> dict[str, int]:
    """Counts the files the validation inspects and the images Pillow fully decodes."""
    from PIL import ImageFile

    import stoker.data.validate as validate

    counts = {"inspected": 0, "decoded": 0}
    inspect, load = validate._inspect, ImageFile.ImageFile.load

    def counting_inspect(file):
        counts["inspected"] += 1
        return inspect(file)

    def counting_load(self):
        counts["decoded"] += 1
        return load(self)

    monkeypatch.setattr(validate, "_inspect", counting_inspect)
    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    return counts


def _truncated_copy(source: Path, target: Path) -> None:
    """A PNG cut in the middle of its pixel data: its header still reads."""
    data = source.read_bytes()
    target.write_bytes(data[:len(data) // 2])


def test_warm_pull_step_reads_no_file_and_first_reads_no_pixel(tmp_path, counted):
    from stoker.data.prepare import prepare_dataset
    from stoker.data.validate import verdict_path

    repo = make_repo(tmp_path / "user", {"v1": THREE}, mode="RGB")
    first = prepare_dataset(_config(repo, tmp_path / "work", "v1"), log=lambda _: None)
    assert counted == {"inspected": 12, "decoded": 0}  # headers + structure, no pixel
    assert (first.summary.counts, first.summary.channels) == ((4, 4, 4), 3)
    again = prepare_dataset(_config(repo, tmp_path / "work", "v1"), log=lambda _: None)
    assert counted == {"inspected": 12, "decoded": 0}  # the verdict of this hash: no file read
    assert again.summary == first.summary
    # A verdict torn by a crash mid-write is not trusted: the folder is checked again.
    verdict = verdict_path(Path(first.ref.local_path), first.ref.md5)
    verdict.write_text(verdict.read_text()[:40])
    third = prepare_dataset(_config(repo, tmp_path / "work", "v1"), log=lambda _: None)
    assert counted == {"inspected": 24, "decoded": 0} and third.summary == first.summary
    assert json.loads(verdict.read_text())["md5"] == first.ref.md5  # written whole again


def test_changed_dataset_is_validated_again_and_a_truncated_file_is_named(tmp_path, counted):
    """A verdict is only read for the hash it names: a v1 verdict copied to v2's name (a
    different dataset with a truncated file) is not trusted."""
    from dvc.repo import Repo

    from stoker.data.git import git
    from stoker.data.prepare import prepare_dataset
    from stoker.data.validate import verdict_path

    repo = make_repo(tmp_path / "user", {"v1": THREE})
    images = repo / "data" / "images"
    _truncated_copy(images / "two" / "000.png", images / "two" / "cut.png")
    with Repo(str(repo)) as dvc:
        dvc.add(str(images))
        dvc.push()
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "a truncated file")
    git(repo, "tag", "v2")
    work = tmp_path / "work"
    v1 = prepare_dataset(_config(repo, work, "v1"), log=lambda _: None).ref
    v2 = pull_dataset(str(repo), "v2", "data/images", work / "datasets")
    assert v2.md5 != v1.md5
    shutil.copy(verdict_path(Path(v1.local_path), v1.md5),
                verdict_path(Path(v2.local_path), v2.md5))  # a forged "valid" for v2
    with pytest.raises(DatasetError) as info:
        prepare_dataset(_config(repo, work, "v2"), log=lambda _: None)
    message = str(info.value)
    assert "\n" not in message and "1 problem(s)" in message
    assert "two/cut.png: not a readable image" in message
    assert counted["decoded"] == 0  # found by the structure check, not by decoding
    assert counted["inspected"] == 12 + 13


def test_validation_writes_the_training_file_list(tmp_path, monkeypatch):
    """The first attempt of a training lists and probes nothing: the pull step left the list."""
    from stoker.data.prepare import prepare_dataset
    from stoker.runtime import data, imagefolder

    repo = make_repo(tmp_path / "user", {"v1": THREE}, mode="RGB")
    prepared = prepare_dataset(_config(repo, tmp_path / "work", "v1"), log=lambda _: None)

    def no_scan(*args, **kwargs):
        raise AssertionError("the folder was listed again at training start")

    monkeypatch.setattr(imagefolder, "scan_image_folder", no_scan)
    splits = data.image_folder(prepared.ref.local_path, 0, 0.25)
    assert splits.input_shape == (3, 8, 8) and splits.classes == ("one", "three", "two")
    assert len(splits.train) + len(splits.val) == 12


def test_jpegs_are_checked_by_their_end_marker_and_a_cut_one_is_named(tmp_path, counted):
    """A complete JPEG is not decoded (its end-of-image marker is there); one cut short after
    a valid header has none: it is decoded to be sure, fails, and is named."""
    from data_repos import write_images
    from PIL import Image

    from stoker.data.validate import validate_image_folder

    write_images(tmp_path / "png", {"cat": 3, "dog": 3}, size=96, mode="RGB")
    for png in sorted((tmp_path / "png").rglob("*.png")):
        target = tmp_path / "jpg" / png.parent.name / f"{png.stem}.jpg"
        target.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(png) as image:
            image.save(target, quality=90)
    counted["decoded"] = 0  # the conversion above decoded the PNGs
    summary = validate_image_folder(tmp_path / "jpg")
    assert summary.counts == (3, 3) and summary.channels == 3
    assert counted == {"inspected": 6, "decoded": 0}
    _truncated_copy(tmp_path / "jpg" / "dog" / "001.jpg", tmp_path / "jpg" / "dog" / "cut.jpg")
    with pytest.raises(DatasetError, match=r"1 problem\(s\).*dog/cut.jpg: not a readable image"):
        validate_image_folder(tmp_path / "jpg")
    assert counted["decoded"] == 1  # only the cut one
