"""A user's own data repository: relative paths, relative DVC remotes, concurrent pulls."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from data_repos import make_repo

from stoker.config import load_pipeline_config
from stoker.data.pull import DatasetError, pull_dataset

pytestmark = pytest.mark.integration

THREE = {"one": 4, "two": 4, "three": 4}


@pytest.fixture(scope="module")
def user_repo(tmp_path_factory) -> Path:
    """A repository with a relative remote and two versions of equal file counts."""
    base = tmp_path_factory.mktemp("user")
    return make_repo(base, {"v1": THREE, "v2": THREE})


def test_relative_dvc_remote_resolves_as_in_the_original_repo(user_repo, tmp_path):
    ref = pull_dataset(str(user_repo), "v1", "data/images", tmp_path / "datasets")
    assert sorted(p.name for p in Path(ref.local_path).iterdir()) == ["one", "three", "two"]
    assert sum(1 for _ in Path(ref.local_path).rglob("*.png")) == 12


def test_unreachable_remote_is_named(user_repo, tmp_path):
    (user_repo.parent / "storage").rename(user_repo.parent / "storage-moved")
    try:
        with pytest.raises(DatasetError, match=r"DVC remote 'store' \(.*storage\) is not "
                                               r"reachable"):
            pull_dataset(str(user_repo), "v1", "data/images", tmp_path / "datasets")
    finally:
        (user_repo.parent / "storage-moved").rename(user_repo.parent / "storage")
    assert not [p for p in (tmp_path / "datasets").iterdir() if not p.name.startswith(".")]


@pytest.mark.parametrize("spelling", ["repo", "./repo", "../{parent}/repo"])
def test_relative_repo_url_resolves_against_the_users_directory(user_repo, tmp_path,
                                                                monkeypatch, spelling):
    monkeypatch.chdir(user_repo.parent)
    url = spelling.format(parent=user_repo.parent.name)
    config = load_pipeline_config(None, [f"data.repo_url={url}"])
    assert config.data.repo_url == str(user_repo)  # resolved in the user's process
    monkeypatch.chdir(tmp_path)  # Prefect may run the task elsewhere
    ref = pull_dataset(config.data.repo_url, "v2", "data/images", tmp_path / "datasets")
    assert ref.repo_url == str(user_repo)
    key = hashlib.sha1(str(user_repo).encode()).hexdigest()[:16]  # the clone key
    assert (tmp_path / "datasets" / ".repos" / key).is_dir()
    monkeypatch.chdir(user_repo.parent)  # a direct call resolves against the cwd, too
    assert pull_dataset(url, "v2", "data/images", tmp_path / "datasets") == ref


def test_urls_are_not_resolved():
    for url in ("https://example.com/a/b.git", "git@github.com:o/r.git", "ssh://h/r"):
        assert load_pipeline_config(None, [f"data.repo_url={url}"]).data.repo_url == url


PULL = """
import json, sys
from pathlib import Path
from stoker.data.pull import pull_dataset
refs = [pull_dataset(sys.argv[1], sys.argv[2], "data/images", Path(sys.argv[3]))
        for _ in range(int(sys.argv[4]))]
print(json.dumps([r.local_path for r in refs] + [refs[0].md5]))
"""


def test_concurrent_pulls_of_two_revisions_each_get_theirs(tmp_path):
    base = tmp_path / "user"  # an absolute remote: this test is about concurrency only
    user_repo = make_repo(base, {"v1": THREE, "v2": THREE}, remote=str(base / "storage"))
    datasets = tmp_path / "datasets"
    env = {"PYTHONPATH": str(Path(__file__).parents[1]), "DVC_NO_ANALYTICS": "1",
           "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", PULL, str(user_repo), rev, str(datasets),
                               "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for rev in ("v1", "v2")]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    (p1, md5_1), (p2, md5_2) = results
    assert md5_1 != md5_2 and Path(p1).name == md5_1.removesuffix(".dir")
    for local, md5 in ((p1, md5_1), (p2, md5_2)):
        manifest = json.loads(next((base / "storage").rglob(
            md5.removesuffix(".dir")[2:] + ".dir")).read_text())
        for entry in manifest:
            data = (Path(local) / entry["relpath"]).read_bytes()
            assert hashlib.md5(data).hexdigest() == entry["md5"], (local, entry["relpath"])


def _repo_with(base: Path, extra) -> Path:
    """A repository whose data/images holds THREE plus what ``extra(root)`` adds."""
    from dvc.repo import Repo

    from stoker.data.git import git

    repo = make_repo(base, {"v1": THREE})
    extra(repo / "data" / "images")
    with Repo(str(repo)) as dvc:
        dvc.add(str(repo / "data" / "images"))
        dvc.push()
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "more files")
    git(repo, "tag", "v2")
    return repo


def _config(repo: Path, work: Path):
    return load_pipeline_config(None, [f"work_dir={work}", f"data.repo_url={repo}", "data.rev=v2",
                                       "data.path=data/images"])


def test_hidden_folders_and_files_are_not_classes(tmp_path):
    from stoker.data.prepare import prepare_dataset
    from stoker.runtime.data import load_image_folder

    def litter(root: Path) -> None:
        (root / ".ipynb_checkpoints").mkdir()
        (root / "one" / "000.png").replace(root / ".ipynb_checkpoints" / "x.png")
        (root / "two" / ".DS_Store").write_bytes(b"\0\1junk")

    repo = _repo_with(tmp_path / "user", litter)
    prepared = prepare_dataset(_config(repo, tmp_path / "work"), log=lambda _: None)
    assert prepared.summary.classes == ("one", "three", "two")
    assert prepared.summary.counts == (3, 4, 4)
    images, labels, classes = load_image_folder(Path(prepared.ref.local_path))
    assert classes == ["one", "three", "two"] and labels.tolist() == [0] * 3 + [1] * 4 + [2] * 4


def test_bad_classes_and_files_are_named_in_the_pull_step(tmp_path):
    from stoker.data.prepare import prepare_dataset

    def damage(root: Path) -> None:
        (root / "empty").mkdir()
        (root / "empty" / ".keep").touch()
        (root / "two" / "001.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
        (root / "three" / "notes.txt").write_text("not an image")

    repo = _repo_with(tmp_path / "user", damage)
    work = tmp_path / "work"
    with pytest.raises(DatasetError) as info:
        prepare_dataset(_config(repo, work), log=lambda _: None)
    message = str(info.value)
    assert message.startswith(f"dataset data/images@v2 of {repo}: 3 problem(s)"), message
    assert "class 'empty': empty class" in message
    assert "two/001.png: not a readable image" in message
    assert "three/notes.txt: not a readable image" in message
    assert sorted(p.name for p in work.iterdir()) == ["datasets"]  # no job folder, no run


def test_truly_empty_class_folder_is_an_error(tmp_path):
    from data_repos import write_images

    from stoker.data.validate import validate_image_folder

    write_images(tmp_path, {"a": 2, "b": 2})
    (tmp_path / "c").mkdir()
    with pytest.raises(DatasetError, match="class 'c': empty class"):
        validate_image_folder(tmp_path)


def test_rgb_images_keep_three_channels_unless_configured(tmp_path):
    from data_repos import write_images

    from stoker.data.validate import validate_image_folder
    from stoker.runtime.data import load_image_folder

    write_images(tmp_path, {"red": 2, "blue": 2}, mode="RGB")
    assert validate_image_folder(tmp_path).channels == 3
    assert load_image_folder(tmp_path)[0].shape == (4, 3, 8, 8)
    assert load_image_folder(tmp_path, 1)[0].shape == (4, 1, 8, 8)
    assert load_pipeline_config(None, ["train.channels=1"]).train.channels == 1


def test_registered_model_name_derives_from_the_dataset():
    assert load_pipeline_config().registered_model() == "stoker-digits"  # the demo: unchanged
    own = load_pipeline_config(None, ["data.repo_url=/data/flowers.git", "data.path=img/all"])
    assert own.registered_model() == "flowers-img-all"
    named = load_pipeline_config(None, ["data.repo_url=/d/x", "tracking.registered_model=mine"])
    assert named.registered_model() == "mine"


def test_remote_fetched_through_the_dvc_cache_is_linked_and_verified(user_repo, tmp_path,
                                                                      monkeypatch):
    """Remotes that are not local folders go through ``dvc fetch`` into the shared cache."""
    import stoker.data.pull as pull

    monkeypatch.setattr(pull, "is_local", lambda url: False)
    ref = pull_dataset(str(user_repo), "v1", "data/images", tmp_path / "datasets")
    files = sorted(Path(ref.local_path).rglob("*.png"))
    assert len(files) == 12 and all(f.stat().st_nlink == 2 for f in files)  # cache + dataset
    again = pull_dataset(str(user_repo), "v1", "data/images", tmp_path / "datasets")
    assert again == ref  # warm: the same hash, reused


def test_a_damaged_manifest_is_never_published_under_its_hash(tmp_path):
    base = tmp_path / "user"
    repo = make_repo(base, {"v1": THREE, "v2": THREE})
    dirs = sorted((base / "storage").rglob("*.dir"))
    # v2's manifest replaced by v1's: every listed file exists, the set is v1's.
    v1, v2 = (pull_dataset(str(repo), rev, "data/images", tmp_path / f"probe-{rev}").md5
              for rev in ("v1", "v2"))
    [obj1] = [d for d in dirs if d.name.startswith(v1[2:].removesuffix(".dir"))]
    [obj2] = [d for d in dirs if d.name.startswith(v2[2:].removesuffix(".dir"))]
    obj2.write_bytes(obj1.read_bytes())
    with pytest.raises(DatasetError, match="does not match its own hash"):
        pull_dataset(str(repo), "v2", "data/images", tmp_path / "datasets")
    assert not (tmp_path / "datasets" / v2.removesuffix(".dir")).exists()


def test_remote_on_a_closed_port_is_named_with_its_error(user_repo, tmp_path):
    """A DVC remote that does not answer (issue 46): its name, URL and the error, not a
    missing manifest or missing files."""
    closed = "http://127.0.0.1:9/store"  # port 9 (discard): refused at once
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(user_repo), str(repo)], check=True)
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "far", closed], cwd=repo,
                   check=True, capture_output=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam",
                    "far remote"], cwd=repo, check=True)
    subprocess.run(["git", "tag", "far"], cwd=repo, check=True)
    with pytest.raises(DatasetError) as e:
        pull_dataset(str(repo), "far", "data/images", tmp_path / "datasets", remote="far")
    said = str(e.value)
    assert f"DVC remote 'far' ({closed}) did not answer" in said, said
    assert "refused" in said.lower(), said
    assert "manifest" not in said and "missing from" not in said, said
