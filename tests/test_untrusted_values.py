"""Issue 44, point 3: a user value that git or DVC would read as an option is refused in one
line naming its field, before any git command runs (real git, a real demo repository)."""

from __future__ import annotations

import pytest

from stoker.data.pull import DatasetError, check_local_rev, pull_dataset


@pytest.mark.parametrize(("field", "args"), [
    ("data.repo_url", ("--upload-pack=touch {marker}", "v1", "data/digits")),
    ("data.rev", ("{repo}", "--output={marker}", "data/digits")),
    ("data.path", ("{repo}", "v1", "-data")),
])
def test_an_option_like_value_is_refused_naming_its_field(demo_repo, tmp_path, field, args):
    marker = tmp_path / "pwned"
    repo_url, rev, path = (a.format(marker=marker, repo=demo_repo.repo) for a in args)
    for call in (lambda: pull_dataset(repo_url, rev, path, tmp_path / "datasets"),
                 lambda: check_local_rev(repo_url, rev, path)):
        with pytest.raises(DatasetError) as refused:
            call()
        message = str(refused.value)
        assert message.startswith(f"{field} ") and "starts with '-'" in message
        assert len(message.splitlines()) == 1
    assert not marker.exists()
    assert not (tmp_path / "datasets" / ".repos").exists() or not any(
        p for p in (tmp_path / "datasets" / ".repos").iterdir() if p.is_dir())
