"""Where a data repository and its DVC remotes live, resolved as the user meant them.

A local repository path is resolved against the user's working directory (the clone runs
elsewhere), and a local DVC remote written relative to the repository (``dvc remote add -d store
../storage``) is resolved against the original repository's ``.dvc`` folder, as ``dvc get`` and
``dvc.api`` do, not against Stoker's clone of it.
"""

from __future__ import annotations

import re
from pathlib import Path

from stoker.config import is_local, resolve_repo_url

__all__ = ["check_reachable", "is_local", "original_remotes", "probe_remote", "relative_remotes",
           "resolve_repo_url"]


def relative_remotes(dvc_config: Path) -> dict[str, str]:
    """Remote name -> URL, for the remotes of a raw ``.dvc/config`` given as relative paths."""
    from configobj import ConfigObj

    if not dvc_config.is_file():
        return {}
    found = {}
    for section, values in ConfigObj(str(dvc_config)).items():
        match = re.fullmatch(r"""\s*['"]?remote\s+"(.+)"['"]?\s*""", section)
        url = values.get("url", "") if isinstance(values, dict) else ""
        if match and url and is_local(url) and not Path(url).expanduser().is_absolute():
            found[match.group(1)] = url
    return found


def remote_names(config_text: str) -> set[str]:
    """The remote names a ``.dvc/config`` text defines (``['remote "storage"']`` sections)."""
    from configobj import ConfigObj, ConfigObjError

    try:
        sections = ConfigObj(config_text.splitlines()).keys()
    except ConfigObjError:
        return set()
    pattern = re.compile(r"""\s*['"]?remote\s+"(.+)"['"]?\s*""")
    return {m.group(1) for m in map(pattern.fullmatch, sections) if m}


def original_remotes(clone: Path, repo_url: str) -> dict[str, str]:
    """Absolute URLs for the clone's relative local remotes, as the original repository resolves
    them (relative to its ``.dvc`` folder). Empty for a repository that is not local: there a
    relative remote has no meaning and is reported as unreachable."""
    if not is_local(repo_url):
        return {}
    base = Path(repo_url) / ".dvc"
    return {name: str((base / url).resolve())
            for name, url in relative_remotes(clone / ".dvc" / "config").items()}


def check_reachable(name: str | None, url: str | None) -> str | None:
    """None if the remote can be tried, else why not (a missing local folder, no remote)."""
    if not name or not url:
        return "no DVC remote: set data.remote or a default remote (dvc remote add -d)"
    if is_local(url) and not Path(url).is_dir():
        return f"DVC remote {name!r} ({url}) is not reachable: no such folder"
    return None


def _causes(error: BaseException) -> list[BaseException]:
    """``error``'s chain of causes (``__cause__``, else ``__context__``), outermost first."""
    chain: list[BaseException] = []
    while error is not None and error not in chain and len(chain) < 10:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def probe_remote(dvc_repo, name: str, url: str, md5: str) -> str | None:
    """Why a DVC remote did not answer for object ``md5``, or None when it answered.

    DVC's fetch logs a remote that cannot be reached and goes on, so the failure would
    surface later as a missing object. This asks the remote for the object through DVC's own
    filesystem and reads the connection error under the "not found" DVC reports.

    Args:
        dvc_repo: an open ``dvc.repo.Repo`` that defines remote ``name``.
        name, url: the remote, as configured.
        md5: the object asked for (a ``.dir`` manifest's hash).

    Returns:
        ``DVC remote 'name' (url) did not answer: <Error>: <message>``, or None.
    """
    remote = dvc_repo.cloud.get_remote(name)
    path = remote.fs.join(remote.path, "files", "md5", md5[:2], md5[2:])
    try:
        remote.fs.info(path)
    except Exception as e:  # noqa: BLE001 - any backend's error is the answer
        chain = _causes(e)
        if isinstance(e, FileNotFoundError) and len(chain) == 1:
            return None  # the remote answered: the object is not there
        deepest = chain[-1]
        words = f"{type(deepest).__name__}: {deepest}"
        if len(chain) > 1 and chain[-2] is not e:
            words = f"{chain[-2]} ({words})"
        return f"DVC remote {name!r} ({url}) did not answer: {words}"
    return None
