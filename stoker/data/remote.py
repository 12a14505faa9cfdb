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

__all__ = ["check_reachable", "is_local", "original_remotes", "relative_remotes",
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
