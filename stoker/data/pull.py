"""Pull a DVC-tracked dataset at a pinned git revision into a content-addressed local folder.

Layout under ``datasets_dir``::

    .repos/<sha1 of repo url>/       git clone of the data repository (DVC workspace)
    .dvc-cache/                      DVC cache shared by all clones (so warm pulls are free)
    <md5 of the DVC directory>/      the materialized dataset, read-only by convention
    <md5>.json                       its record (repository, revision, commit, hash, files)

A dataset folder appears only once it is complete (staged, then renamed), so training never sees a
partial dataset. A second pull of the same content hash returns at once without contacting DVC.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from stoker.data.git import git
from stoker.runtime.records import read_json, write_json


class DatasetError(RuntimeError):
    """The dataset cannot be pulled: bad revision or path, or files missing from the remote."""


@dataclass(frozen=True)
class DatasetRef:
    """A dataset pulled at a pinned revision.

    Attributes:
        repo_url: git URL or path of the data repository.
        rev: revision as asked (tag, branch or commit).
        commit: the full git commit ``rev`` resolved to.
        path: DVC-tracked directory inside the repository.
        md5: DVC content hash of the directory (``<md5>.dir``), from the ``.dvc`` file.
        nfiles: number of files in the directory.
        size_bytes: total size of the files, from the ``.dvc`` file.
        local_path: absolute path of the materialized dataset.
    """

    repo_url: str
    rev: str
    commit: str
    path: str
    md5: str
    nfiles: int
    size_bytes: int
    local_path: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def _clone(repo_url: str, datasets_dir: Path) -> Path:
    """Return an up-to-date clone of ``repo_url`` (cloned once, fetched afterwards)."""
    key = hashlib.sha1(repo_url.encode()).hexdigest()[:16]
    clone = datasets_dir / ".repos" / key
    if (clone / ".git").is_dir():
        git(clone, "fetch", "-q", "--tags", "--force", "origin")
        return clone
    clone.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=clone.parent))
    try:
        git(clone.parent, "clone", "-q", "--no-checkout", repo_url, str(staging))
    except RuntimeError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise DatasetError(f"data.repo_url {repo_url}: cannot clone: {e}") from None
    staging.rename(clone)
    return clone


def _dvc_out(clone: Path, commit: str, path: str) -> dict:
    """Read the single output entry of ``<path>.dvc`` at ``commit``."""
    try:
        text = git(clone, "show", f"{commit}:{path}.dvc")
    except RuntimeError:
        raise DatasetError(
            f"data.path {path}: no {path}.dvc at commit {commit[:12]}; is it tracked by DVC?"
        ) from None
    outs = (yaml.safe_load(text) or {}).get("outs") or []
    if len(outs) != 1 or "md5" not in outs[0]:
        raise DatasetError(f"{path}.dvc at {commit[:12]}: expected one output with an md5 hash")
    return outs[0]


def _missing_files(dvc_repo, target: str) -> list[str]:
    """Paths (with their md5 where known) that the remote lacks, per ``dvc status --cloud``."""
    status = dvc_repo.status(targets=[target], cloud=True)
    missing = sorted(p for p, state in status.items() if state in ("deleted", "missing"))
    return missing


def _manifest(cache_dir: Path, md5_dir: str) -> dict[str, str]:
    """relpath -> md5 from the cached ``.dir`` object, or {} when it is not cached."""
    obj = cache_dir / "files" / "md5" / md5_dir[:2] / md5_dir[2:]
    if not obj.is_file():
        return {}
    return {entry["relpath"]: entry["md5"] for entry in json.loads(obj.read_text())}


def pull_dataset(
    repo_url: str, rev: str, path: str, datasets_dir: Path, remote: str | None = None
) -> DatasetRef:
    """Pull ``path`` at ``rev`` from the data repository through DVC.

    Args:
        repo_url: git URL or local path of a repository whose ``path`` is tracked by DVC.
        rev: tag, branch or commit; resolved to a commit and recorded.
        path: DVC-tracked directory, relative to the repository root.
        datasets_dir: local folder for clones, the DVC cache and materialized datasets.
        remote: DVC remote to pull from; None uses the repository's default remote.

    Returns:
        DatasetRef of the complete local copy.

    Raises:
        DatasetError: the repository cannot be cloned, ``rev`` or ``path`` does not exist, or the
            remote lacks files (the message names each missing path and its md5). Nothing is left
            at the dataset's final location in that case.
    """
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    datasets_dir = datasets_dir.resolve()
    datasets_dir.mkdir(parents=True, exist_ok=True)
    clone = _clone(repo_url, datasets_dir)
    try:
        commit = git(clone, "rev-parse", "--verify", f"{rev}^{{commit}}")
    except RuntimeError:
        raise DatasetError(f"data.rev {rev!r}: not found in {repo_url}") from None

    out = _dvc_out(clone, commit, path)
    md5_dir = str(out["md5"])
    md5 = md5_dir.removesuffix(".dir")
    final = datasets_dir / md5
    ref = DatasetRef(
        repo_url=repo_url,
        rev=rev,
        commit=commit,
        path=path,
        md5=md5_dir,
        nfiles=int(out.get("nfiles", 0)),
        size_bytes=int(out.get("size", 0)),
        local_path=str(final),
    )
    record = datasets_dir / f"{md5}.json"
    if final.is_dir() and read_json(record) is not None:  # a torn record: pulled again
        return ref  # content-addressed: same hash, same files

    git(clone, "checkout", "-q", "--force", "--detach", commit)
    cache_dir = datasets_dir / ".dvc-cache"
    target = str(clone / f"{path}.dvc")
    with Repo(str(clone)) as dvc:
        with dvc.config.edit("local") as conf:
            conf["cache"]["dir"] = str(cache_dir)
        dvc.config.load()  # re-read so the cache dir applies to this instance
    with Repo(str(clone)) as dvc:
        try:
            dvc.pull(targets=[target], remote=remote, force=True)
        except DvcException as e:
            missing = _missing_files(dvc, target)
            if not missing:
                raise DatasetError(f"{repo_url}@{rev} {path}: dvc pull failed: {e}") from e
            hashes = _manifest(cache_dir, md5_dir)
            prefix = path.rstrip("/") + "/"
            named = [
                f"{p} (md5 {hashes.get(p.removeprefix(prefix), 'unknown')})" for p in missing
            ]
            raise DatasetError(
                f"{repo_url}@{rev} ({commit[:12]}): {len(missing)} file(s) of {path} "
                f"({md5_dir}) missing from the DVC remote {remote or '(default)'}: "
                + ", ".join(named[:20])
                + (" ..." if len(named) > 20 else "")
            ) from e

    staging = Path(tempfile.mkdtemp(prefix=f".{md5}-", dir=datasets_dir))
    try:
        shutil.copytree(clone / path, staging, dirs_exist_ok=True)
        nfiles = sum(1 for p in staging.rglob("*") if p.is_file())
        if ref.nfiles and nfiles != ref.nfiles:
            raise DatasetError(
                f"{path}@{rev}: pulled {nfiles} files, {path}.dvc lists {ref.nfiles}"
            )
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    write_json(record, asdict(ref))  # atomically: the record marks the dataset complete
    return ref
