"""Real git + DVC: the demo repository, pinned pulls, warm reuse and the missing-data error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stoker.data.demo import DEMO_TAG, ensure_demo_repo
from stoker.data.git import git
from stoker.data.pull import DatasetError, pull_dataset

pytestmark = pytest.mark.integration


def test_demo_repo_is_an_image_folder_tracked_by_dvc(demo_repo):
    files = git(demo_repo.repo, "ls-files").split()
    assert "data/digits.dvc" in files and not any(f.endswith(".png") for f in files)
    assert git(demo_repo.repo, "tag") == DEMO_TAG
    assert ensure_demo_repo(demo_repo.repo.parent).created is False  # idempotent


def test_demo_repo_build_does_not_repeat_dvc_init_message(tmp_path, caplog, capfd):
    import logging

    caplog.set_level(logging.INFO)
    assert ensure_demo_repo(tmp_path).created is True
    out, err = capfd.readouterr()
    said = out + err + caplog.text
    assert "Initialized DVC repository" not in said  # `make run` printed it twice


def test_demo_digits_are_scikit_learns_without_importing_it(tmp_path):
    """The arrays are load_digits()'s (so the demo dataset and its hash are what they were);
    building the repository does not import scikit-learn (~2.5 CPU-s on a first run)."""
    import subprocess
    import sys

    import numpy as np
    from sklearn.datasets import load_digits

    from stoker.data.demo import load_digits_arrays

    images, labels = load_digits_arrays()
    reference = load_digits()
    assert images.dtype == reference.images.dtype and labels.dtype == reference.target.dtype
    assert np.array_equal(images, reference.images)
    assert np.array_equal(labels, reference.target)
    probe = ("import sys; from pathlib import Path; from stoker.data.demo import "
             "ensure_demo_repo; assert ensure_demo_repo(Path(sys.argv[1])).created; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sklearn'))")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "demo")],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_pull_records_revision_and_hash(dataset, demo_repo):
    assert dataset.commit == git(demo_repo.repo, "rev-parse", "v1")
    assert dataset.md5.endswith(".dir") and dataset.nfiles == 1797
    root = Path(dataset.local_path)
    assert sorted(p.name for p in root.iterdir()) == [str(d) for d in range(10)]
    assert sum(1 for _ in root.rglob("*.png")) == 1797
    record = json.loads((root.parent / f"{root.name}.json").read_text())
    assert record["commit"] == dataset.commit and record["md5"] == dataset.md5


def test_warm_pull_reuses_the_dataset(dataset, demo_repo, session_dir, monkeypatch):
    import dvc.repo

    def no_dvc(*args, **kwargs):
        raise AssertionError("a warm pull must not call DVC")

    monkeypatch.setattr(dvc.repo.Repo, "pull", no_dvc)
    again = pull_dataset(str(demo_repo.repo), "v1", "data/digits", session_dir / "datasets")
    assert again == dataset
    named = pull_dataset(str(demo_repo.repo), "v1", "data/digits", session_dir / "datasets",
                         remote="local")
    assert named == dataset
    # QA: data.remote=nope passed unnoticed when the dataset was cached
    with pytest.raises(DatasetError) as info:
        pull_dataset(str(demo_repo.repo), "v1", "data/digits", session_dir / "datasets",
                     remote="nope")
    assert str(info.value) == (f"data.remote 'nope': no such DVC remote in {demo_repo.repo} "
                               "at v1 (its remotes: local)")


def test_missing_remote_file_is_named_before_anything_is_materialized(demo_repo, tmp_path):
    remote = tmp_path / "remote"
    shutil.copytree(demo_repo.remote, remote)
    repo = tmp_path / "repo"
    shutil.copytree(demo_repo.repo, repo)
    # Point the copy at the copied remote, then lose one image from it.
    config = repo / ".dvc" / "config"
    config.write_text(config.read_text().replace(str(demo_repo.remote), str(remote)))
    git(repo, "commit", "-q", "-am", "use copied remote")
    manifest = json.loads(next(remote.rglob("*.dir")).read_text())
    lost = manifest[17]
    (remote / "files" / "md5" / lost["md5"][:2] / lost["md5"][2:]).unlink()

    with pytest.raises(DatasetError) as info:
        pull_dataset(str(repo), "HEAD", "data/digits", tmp_path / "datasets")
    message = str(info.value)
    assert f"data/digits/{lost['relpath']}" in message and lost["md5"] in message
    assert "1 file(s)" in message
    datasets = tmp_path / "datasets"
    assert not any(p.name[0] != "." for p in datasets.iterdir())  # no dataset folder appeared


def test_bad_revision_and_path_are_named(demo_repo, tmp_path):
    with pytest.raises(DatasetError, match="data.rev 'v9': not found"):
        pull_dataset(str(demo_repo.repo), "v9", "data/digits", tmp_path)
    with pytest.raises(DatasetError, match="data.path data/nope: no data/nope.dvc"):
        pull_dataset(str(demo_repo.repo), "v1", "data/nope", tmp_path)
    with pytest.raises(DatasetError, match="cannot clone") as info:
        pull_dataset(str(tmp_path / "no-such-repo"), "v1", "data/digits", tmp_path)
    # git's own reason, not the command line with a temporary clone folder
    assert str(info.value).startswith(f"data.repo_url {tmp_path / 'no-such-repo'}: cannot "
                                      "clone: fatal: ")
    assert ".repos" not in str(info.value)


def test_a_missing_data_path_names_what_dvc_tracks_at_that_commit(tmp_path):
    """A typo in data.path gets the paths DVC does track there (was: "is it tracked by
    DVC?", which left the user to go and look); none at all says so; long lists are cut."""
    from stoker.data.pull import MAX_LISTED, _dvc_out

    repo = tmp_path / "repo"
    (repo / ".dvc").mkdir(parents=True)
    (repo / ".dvc" / "config").write_text("")
    (repo / "README").write_text("no data yet\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "empty")
    empty = git(repo, "rev-parse", "HEAD")
    with pytest.raises(DatasetError) as none:
        _dvc_out(repo, empty, "data/fruit")
    assert str(none.value) == (f"data.path data/fruit: no data/fruit.dvc at commit {empty[:12]}; "
                               "nothing there is tracked by DVC (no .dvc file)")
    for name in ["data/fruits", "data/apples it's", "data/pommes-é",
                 *[f"extra/set{i:02d}" for i in range(11)]]:
        Path(repo, f"{name}.dvc").parent.mkdir(parents=True, exist_ok=True)
        Path(repo, f"{name}.dvc").write_text("outs:\n- md5: 0.dir\n  path: x\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "data")
    commit = git(repo, "rev-parse", "HEAD")
    with pytest.raises(DatasetError) as some:
        _dvc_out(repo, commit, "data/fruit")
    tracked = ["data/apples it's", "data/fruits", "data/pommes-é",
               *[f"extra/set{i:02d}" for i in range(7)]]
    assert len(tracked) == MAX_LISTED
    assert str(some.value) == (f"data.path data/fruit: no data/fruit.dvc at commit "
                               f"{commit[:12]}; DVC tracks {', '.join(tracked)} and 4 more there")
