"""Start-up and registration do not scale with the dataset: no pass over its files per attempt."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_repos import write_images

from stoker.runtime.data import image_folder

MANY = {"apple": 30, "bicycle": 30, "cloud": 30}


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} at the start of a later attempt")
    return refuse


@pytest.mark.parametrize("pulled", [True, False], ids=["pulled-dvc-folder", "own-folder"])
def test_a_later_attempt_lists_no_file_and_opens_no_image(tmp_path, monkeypatch, pulled):
    """The first attempt lists the folder once (cached by the DVC hash, or in the job folder);
    every later attempt starts from that list: no listing of the class folders, no header."""
    from PIL import Image

    from stoker.runtime import imagefolder

    root = tmp_path / ("0123456789abcdef0123456789abcdef" if pulled else "mine")
    write_images(root, MANY, mode="RGB")
    job = tmp_path / "job"
    first = image_folder(str(root), 0, 0.2, job_dir=str(job))  # auto size and channels: probed
    with monkeypatch.context() as patch:
        patch.setattr(imagefolder, "image_files", _refuse("a class folder listed"))
        patch.setattr(imagefolder, "_probe", _refuse("a header read"))
        patch.setattr(Image, "open", _refuse("an image opened"))
        later = image_folder(str(root), 0, 0.2, job_dir=str(job))
    assert later.input_shape == first.input_shape == (3, 8, 8)
    assert len(later.train) + len(later.val) == 90 and later.classes == tuple(sorted(MANY))


def test_registration_input_example_reads_four_files(tmp_path, monkeypatch):
    from PIL import Image

    from stoker.runtime import data
    from stoker.tracking.registry import input_example

    write_images(tmp_path / "ds", MANY, mode="RGB")
    opened, listed = [], []
    real_open, real_files = Image.open, data.image_files

    def counting_open(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    def counting_files(folder):
        listed.append(folder.name)
        return real_files(folder)

    monkeypatch.setattr(Image, "open", counting_open)
    monkeypatch.setattr(data, "image_files", counting_files)
    ref = type("Ref", (), {"local_path": str(tmp_path / "ds")})()
    example = input_example(ref, {"input_shape": [3, 8, 8], "model": "small_cnn",
                                  "classes": sorted(MANY)})
    assert example.shape == (4, 3, 8, 8)
    assert len(opened) == 4 and listed == ["apple"]  # one class folder listed, four files read
