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
        assert "{value}" not in message  # trial: the advice's placeholder was printed as is
        if field == "data.repo_url":
            assert "give a path (./--upload-pack=" in message
        assert len(message.splitlines()) == 1
    assert not marker.exists()
    assert not (tmp_path / "datasets" / ".repos").exists() or not any(
        p for p in (tmp_path / "datasets" / ".repos").iterdir() if p.is_dir())


@pytest.mark.parametrize("name", ["evil\x1b[2Jname", "two\nlines", "bell\x07"])
def test_a_model_name_with_a_control_character_is_refused_at_validation(name):
    from stoker.config import ConfigError, PipelineConfig, validate

    with pytest.raises(ConfigError) as refused:
        validate(PipelineConfig, {"tracking": {"registered_model": name}})
    message = str(refused.value)
    assert "tracking.registered_model" in message and "control character" in message
    assert name not in message  # shown escaped, never raw


def test_a_class_folder_with_a_control_character_is_refused_by_name(tmp_path):
    from stoker.runtime.data import DataError
    from stoker.runtime.imagefolder import scan_image_folder

    for name in ("ok", "evil\x1b[31m"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.png").write_bytes(b"")
    with pytest.raises(DataError, match=r"class name contains the control character '\\x1b'"):
        scan_image_folder(tmp_path, probe=False)
