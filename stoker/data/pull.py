"""Pull a DVC-tracked dataset at a pinned git revision into a content-addressed local folder.

Layout under ``datasets_dir``::

    .repos/<sha1 of repo url>/       git clone of the data repository (DVC workspace)
    .dvc-cache/                      DVC cache shared by all clones (so warm pulls are free)
    <md5 of the DVC directory>/      the materialized dataset, read-only by convention
    <md5>.json                       its record (repository, revision, commit, hash, files)

A dataset folder appears only once it is complete (staged, then renamed), so training never sees a
partial dataset. A second pull of the same content hash returns at once without contacting DVC.
A cold pull reads a local DVC remote directly (copying its objects), or fetches any other remote
into the DVC cache and hard-links (or copies) the cached files into the staging folder; every
staged file is checked against the md5 listed by the ``.dvc`` file's directory
manifest before the folder is published under that hash. Pulls through one clone are serialised by
a file lock (``.repos/<key>.lock``), so concurrent pulls of different revisions each get theirs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from stoker.data.git import git
from stoker.data.remote import (
    check_reachable,
    is_local,
    original_remotes,
    probe_remote,
    remote_names,
    resolve_repo_url,
)
from stoker.data.untrusted import option_like
from stoker.runtime import private
from stoker.runtime.records import read_json, write_json

LOCK_TIMEOUT_S = 3600.0  # a cold pull of a large dataset holds the clone's lock this long at most


class DatasetError(RuntimeError):
    """The dataset cannot be pulled or used: bad repository, revision or path, an unreachable
    remote, files missing from the remote, or content that fails validation."""


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


def clone_key(repo_url: str) -> str:
    """Folder name of the clone of ``repo_url`` (already resolved) under ``.repos``."""
    return hashlib.sha1(repo_url.encode()).hexdigest()[:16]


def _clone(repo_url: str, datasets_dir: Path) -> Path:
    """Return an up-to-date clone of ``repo_url`` (cloned once, fetched afterwards)."""
    key = clone_key(repo_url)
    clone = datasets_dir / ".repos" / key
    if (clone / ".git").is_dir():
        try:
            git(clone, "fetch", "-q", "--tags", "--force", "origin")
        except RuntimeError as e:
            raise DatasetError(f"data.repo_url {repo_url}: cannot fetch: {_reason(e)}") from None
        return clone
    private.make_dir(clone.parent, narrow_existing=False)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=clone.parent))
    try:
        git(clone.parent, "clone", "-q", "--no-checkout", "--", repo_url, str(staging))
    except RuntimeError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise DatasetError(f"data.repo_url {repo_url}: cannot clone: {_reason(e)}") from None
    staging.rename(clone)
    return clone


MAX_LISTED = 10  # tracked paths named in a "no such data.path" error


def _tracked_paths(clone: Path, commit: str) -> list[str]:
    """The paths ``<path>.dvc`` files track at ``commit`` (sorted; [] when git cannot list)."""
    try:
        names = git(clone, "ls-tree", "-r", "-z", "--name-only", commit).split("\0")
    except RuntimeError:
        return []
    return sorted(n.removesuffix(".dvc") for n in names
                  if n.endswith(".dvc") and not n.startswith(".dvc/") and "/.dvc/" not in n)


def _dvc_out(clone: Path, commit: str, path: str) -> dict:
    """Read the single output entry of ``<path>.dvc`` at ``commit``."""
    try:
        text = git(clone, "show", f"{commit}:{path}.dvc")
    except RuntimeError:
        tracked = _tracked_paths(clone, commit)
        hint = (f"DVC tracks {', '.join(tracked[:MAX_LISTED])}"
                + (f" and {len(tracked) - MAX_LISTED} more" if len(tracked) > MAX_LISTED else "")
                + " there") if tracked else "nothing there is tracked by DVC (no .dvc file)"
        raise DatasetError(f"data.path {path}: no {path}.dvc at commit {commit[:12]}; {hint}"
                           ) from None
    outs = (yaml.safe_load(text) or {}).get("outs") or []
    if len(outs) != 1 or "md5" not in outs[0]:
        raise DatasetError(f"{path}.dvc at {commit[:12]}: expected one output with an md5 hash")
    return outs[0]


def _missing_files(dvc_repo, target: str) -> list[str]:
    """Paths that the remote lacks, per ``dvc status --cloud``."""
    status = dvc_repo.status(targets=[target], cloud=True)
    return sorted(p for p, state in status.items() if state in ("deleted", "missing"))


def _manifest(cache_dir: Path, md5_dir: str) -> dict[str, str]:
    """relpath -> md5 from the cached ``.dir`` object, or {} when it is not cached."""
    obj = _cache_object(cache_dir, md5_dir)
    if not obj.is_file():
        return {}
    return {entry["relpath"]: entry["md5"] for entry in json.loads(obj.read_text())}


def _cache_object(cache_dir: Path, md5: str) -> Path:
    return cache_dir / "files" / "md5" / md5[:2] / md5[2:]


def _configure_clone(dvc_repo, clone: Path, repo_url: str, cache_dir: Path) -> None:
    """Shared cache dir; relative local remotes resolved as in the original repository."""
    with dvc_repo.config.edit("local") as conf:
        conf["cache"]["dir"] = str(cache_dir)
        conf["remote"] = {name: {"url": url}
                          for name, url in original_remotes(clone, repo_url).items()}


def _remote_url(dvc_repo, remote: str | None) -> tuple[str | None, str | None]:
    name = remote or dvc_repo.config["core"].get("remote")
    url = (dvc_repo.config["remote"].get(name) or {}).get("url") if name else None
    if remote and url is None:
        raise DatasetError(f"data.remote {remote!r}: no such DVC remote in the repository")
    return name, url


def _fetch(clone: Path, repo_url: str, ref: DatasetRef, remote: str | None,
           cache_dir: Path) -> tuple[Path, bool]:
    """Make the dataset's objects available locally; returns (object store, linkable).

    A local remote in DVC 3 layout is read directly (its objects are copied, never linked:
    the remote is the user's); any other remote is fetched into the shared DVC cache, whose
    read-only objects are hard-linked. Nothing is checked out into the clone.
    """
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    target = str(clone / f"{ref.path}.dvc")
    with Repo(str(clone)) as dvc:
        _configure_clone(dvc, clone, repo_url, cache_dir)
    with Repo(str(clone)) as dvc:  # re-read the local config just written
        name, url = _remote_url(dvc, remote)
        where = f"{repo_url}@{ref.rev} ({ref.commit[:12]}) {ref.path}"
        problem = check_reachable(name, url)
        if problem:
            raise DatasetError(f"{where}: {problem}")
        if is_local(url) and _cache_object(Path(url), ref.md5).is_file():
            manifest = _manifest(Path(url), ref.md5)
            missing = [f"{ref.path.rstrip('/')}/{relpath}" for relpath, md5 in manifest.items()
                       if not _cache_object(Path(url), md5).is_file()]
            if missing:
                raise _missing_error(where, ref, name, url, missing, manifest)
            return Path(url), False
        try:
            dvc.fetch(targets=[target], remote=remote)
        except DvcException as e:
            if problem := probe_remote(dvc, name, url, ref.md5):
                raise DatasetError(f"{where}: {problem}") from e
            missing = _missing_files(dvc, target)
            if not missing:
                raise DatasetError(f"{where}: dvc fetch from remote {name!r} ({url}) failed: "
                                   f"{e}") from e
            raise _missing_error(where, ref, name, url, missing,
                                 _manifest(cache_dir, ref.md5)) from e
        if not _cache_object(cache_dir, ref.md5).is_file() and (
                problem := probe_remote(dvc, name, url, ref.md5)):
            raise DatasetError(f"{where}: {problem}")  # fetch only logged it
    return cache_dir, True


def _missing_error(where: str, ref: DatasetRef, name: str, url: str, missing: list[str],
                   hashes: dict[str, str]) -> DatasetError:
    prefix = ref.path.rstrip("/") + "/"
    named = [f"{p} (md5 {hashes.get(p.removeprefix(prefix), 'unknown')})" for p in missing]
    return DatasetError(
        f"{where}: {len(missing)} file(s) of {ref.path} ({ref.md5}) missing from the DVC "
        f"remote {name!r} ({url}): " + ", ".join(named[:20]) + (" ..." if len(named) > 20 else ""))


def _file_md5(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _copy_md5(source: Path, target: Path) -> str:
    """Copy ``source`` to ``target`` and return the md5 of what was copied (one read)."""
    digest = hashlib.md5()
    with source.open("rb") as src, target.open("wb") as dst:
        for block in iter(lambda: src.read(1 << 20), b""):
            digest.update(block)
            dst.write(block)
    return digest.hexdigest()


def _materialise(source: Path, target: Path, link: bool) -> str:
    """Hard-link (``link``; copy where the file system can't) or copy; returns the md5."""
    private.make_dir(target.parent, narrow_existing=False)
    if link:
        try:
            os.link(source, target)  # a read-only cache object: sharing it is safe
            return _file_md5(target)
        except OSError:
            pass  # another file system, or no hard links there
    return _copy_md5(source, target)


def _stage(objects: Path, ref: DatasetRef, staging: Path, link: bool) -> None:
    """Materialise the objects of ``ref`` in ``staging`` and verify each md5.

    Raises:
        DatasetError: the manifest is absent, or a file is missing or differs from its md5.
    """
    if not _cache_object(objects, ref.md5).is_file():
        raise DatasetError(f"{ref.path}@{ref.rev}: manifest {ref.md5} not in {objects}")
    if _file_md5(_cache_object(objects, ref.md5)) != ref.md5.removesuffix(".dir"):
        raise DatasetError(f"{ref.path}@{ref.rev}: the manifest {ref.md5} in {objects} does not "
                           "match its own hash (a damaged DVC cache or remote)")
    manifest = _manifest(objects, ref.md5)
    escaping = [r for r in manifest if Path(r).is_absolute() or ".." in Path(r).parts]
    if escaping:
        raise DatasetError(f"{ref.path}@{ref.rev}: manifest {ref.md5} lists paths outside the "
                           f"dataset folder: {escaping[:5]}")
    bad = []
    for relpath, md5 in manifest.items():
        source = _cache_object(objects, md5)
        if not source.is_file():
            bad.append(f"{relpath} (md5 {md5}: not in {objects})")
        elif _materialise(source, staging / relpath, link) != md5:
            bad.append(f"{relpath} (expected md5 {md5})")
    if bad:
        raise DatasetError(f"{ref.path}@{ref.rev} ({ref.md5}): {len(bad)} file(s) do not match "
                           "the .dvc manifest: " + ", ".join(bad[:20]))


def _publish(objects: Path, link: bool, ref: DatasetRef, datasets_dir: Path) -> None:
    """Stage, verify, then rename into place (the lock is held: no other pull of this clone)."""
    final = Path(ref.local_path)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=datasets_dir))
    try:
        _stage(objects, ref, staging, link)
        if final.exists():  # a folder without its record: an interrupted earlier publish
            shutil.rmtree(final)
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    # Atomically (fsync, rename): the record marks the dataset complete; a torn one is pulled again.
    write_json(datasets_dir / f"{final.name}.json", asdict(ref))


def _check_remote_name(clone: Path, commit: str, remote: str, repo_url: str, rev: str) -> None:
    """``data.remote`` names a remote of the repository's ``.dvc/config`` at ``commit``.

    Raises:
        DatasetError: naming the remote, the repository, the revision and the remotes it has.
    """
    try:
        names = remote_names(git(clone, "show", f"{commit}:.dvc/config"))
    except RuntimeError:
        names = set()  # no .dvc/config at that commit: no remote at all
    if remote not in names:
        has = ", ".join(sorted(names)) or "none"
        raise DatasetError(f"data.remote {remote!r}: no such DVC remote in {repo_url} at "
                           f"{rev} (its remotes: {has})")


def _reason(error: RuntimeError) -> str:
    """git's own message of a failed git command (not the command line and temporary folders)."""
    return getattr(error, "reason", None) or str(error)


def is_git_repository(folder: Path) -> bool:
    """Whether ``folder`` itself is a git repository that ``git clone`` takes: it holds ``.git``
    (a directory, or a file of a worktree) or is a bare repository. A plain folder inside
    another repository is not one (git looks no further up, as clone does)."""
    if (folder / ".git").exists():
        return True
    try:
        git(folder, "rev-parse", "--resolve-git-dir", str(folder))
    except RuntimeError:
        return False
    return True


def check_local_rev(repo_url: str, rev: str, path: str) -> str | None:
    """Before any pull: for a repository on this machine, ``rev`` resolves to a commit and
    ``<path>.dvc`` exists there (read from the repository itself: nothing is cloned). A remote
    repository is left to the pull.

    Returns:
        The dataset's DVC hash (``<md5>.dir``) for a repository on this machine, else None.

    Raises:
        DatasetError: naming ``data.rev`` or ``data.path``, as the pull would.
    """
    out = local_dvc_out(repo_url, rev, path)
    return None if out is None else str(out["md5"])


def local_dvc_out(repo_url: str, rev: str, path: str) -> dict | None:
    """The output entry of ``<path>.dvc`` at ``rev`` (``md5``, ``nfiles``: an upper bound of
    the dataset's images, every file counted), read from a repository on this machine without
    a pull; None for a remote repository.

    Raises:
        DatasetError: naming ``data.rev`` or ``data.path``, as the pull would.
    """
    if (refused := option_like({"data.repo_url": repo_url, "data.rev": rev,
                                "data.path": path})) is not None:
        raise DatasetError(refused)
    repo = Path(repo_url)
    if "://" in repo_url or not (repo / ".git").exists():
        return None
    return _dvc_out(repo, _commit_of(repo, rev, repo_url), path)


def _commit_of(repo: Path, rev: str, repo_url: str) -> str:
    """The commit ``rev`` names in the git repository ``repo`` (a clone of ``repo_url``).

    Raises:
        DatasetError: naming ``data.rev`` and the repository.
    """
    try:
        return git(repo, "rev-parse", "--verify", "--end-of-options", f"{rev}^{{commit}}")
    except RuntimeError:
        raise DatasetError(f"data.rev {rev!r}: not found in {repo_url}") from None


def pull_dataset(
    repo_url: str, rev: str, path: str, datasets_dir: Path, remote: str | None = None
) -> DatasetRef:
    """Pull ``path`` at ``rev`` from the data repository through DVC.

    Args:
        repo_url: git URL or local path of a repository whose ``path`` is tracked by DVC; a
            relative path is resolved against the current directory.
        rev: tag, branch or commit; resolved to a commit and recorded.
        path: DVC-tracked directory, relative to the repository root.
        datasets_dir: local folder for clones, the DVC cache and materialized datasets.
        remote: DVC remote to pull from; None uses the repository's default remote.

    Returns:
        DatasetRef of the complete local copy.

    Raises:
        DatasetError: the repository cannot be cloned, ``rev`` or ``path`` does not exist, the
            remote is unreachable (named) or lacks files (each missing path and its md5 named),
            or a pulled file differs from the ``.dvc`` manifest. Nothing is left at the dataset's
            final location in that case.
    """
    from filelock import FileLock, Timeout

    if (refused := option_like({"data.repo_url": repo_url, "data.rev": rev, "data.path": path,
                                "data.remote": remote})) is not None:
        raise DatasetError(refused)
    repo_url = resolve_repo_url(repo_url)
    datasets_dir = datasets_dir.resolve()
    private.make_dir(datasets_dir / ".repos", narrow_existing=False)
    lock = FileLock(str(datasets_dir / ".repos" / f"{clone_key(repo_url)}.lock"))
    try:
        with lock.acquire(timeout=LOCK_TIMEOUT_S):
            return _pull_locked(repo_url, rev, path, datasets_dir, remote)
    except Timeout:
        raise DatasetError(f"data.repo_url {repo_url}: another pull held {lock.lock_file} for "
                           f"{LOCK_TIMEOUT_S:.0f} s") from None


def _pull_locked(repo_url: str, rev: str, path: str, datasets_dir: Path,
                 remote: str | None) -> DatasetRef:
    clone = _clone(repo_url, datasets_dir)
    commit = _commit_of(clone, rev, repo_url)

    out = _dvc_out(clone, commit, path)
    md5_dir = str(out["md5"])
    final = datasets_dir / md5_dir.removesuffix(".dir")
    ref = DatasetRef(
        repo_url=repo_url, rev=rev, commit=commit, path=path, md5=md5_dir,
        nfiles=int(out.get("nfiles", 0)), size_bytes=int(out.get("size", 0)),
        local_path=str(final),
    )
    if remote:  # named also when the data is cached: a typo must not pass unnoticed
        _check_remote_name(clone, commit, remote, repo_url, rev)
    if final.is_dir() and read_json(datasets_dir / f"{final.name}.json") is not None:
        return ref  # content-addressed: same hash, same files

    git(clone, "checkout", "-q", "--force", "--detach", commit)  # .dvc files only: no data
    cache_dir = datasets_dir / ".dvc-cache"
    objects, link = _fetch(clone, repo_url, ref, remote, cache_dir)
    _publish(objects, link, ref, datasets_dir)
    return ref
