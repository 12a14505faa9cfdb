"""Training-image inputs: the version matrix, the build context and its content hash (no Docker)."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from image_support import ENTRY

from stoker.config import ConfigError
from stoker.images.spec import (
    SOURCE_ROOT,
    ImageRequest,
    ImageSpec,
    content_hash,
    image_ref,
    load_matrix,
    write_context,
)


@pytest.fixture
def source_copy(tmp_path) -> Path:
    """A copy of the files that make the image, so tests can edit them."""
    for part in ("images", "stoker"):
        shutil.copytree(SOURCE_ROOT / part, tmp_path / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _spec(root: Path, **fields) -> ImageSpec:
    return ImageSpec.from_matrix(ENTRY, matrix_path=root / "images/matrix.yaml",
                                 source_root=root, **fields)


def test_hash_is_stable_and_ignores_names_times_and_caches(source_copy):
    spec = _spec(source_copy)
    first = content_hash(spec)
    assert len(first) == 64 and content_hash(spec) == first
    # Where the image goes, file times and byte-code caches do not change what it is.
    assert content_hash(spec.model_copy(update={"registry": "r.example:5000",
                                                "repository": "other/name"})) == first
    os.utime(source_copy / "stoker/runtime/trainer.py", (1, 1))
    (source_copy / "stoker/runtime/__pycache__").mkdir()
    (source_copy / "stoker/runtime/__pycache__/trainer.cpython-311.pyc").write_bytes(b"x")
    assert content_hash(spec) == first
    ref = image_ref(spec, first)
    assert ref == f"127.0.0.1:5000/stoker/train:{first[:32]}"


@pytest.mark.parametrize("change", [
    "dockerfile", "lock", "runtime_source", "new_runtime_file", "config", "verify_script",
    "imported_by_config"])
def test_hash_changes_with_every_input_file(source_copy, change):
    spec = _spec(source_copy)
    before = content_hash(spec)
    path = {
        "dockerfile": "images/Dockerfile", "lock": "images/requirements-runtime.txt",
        "runtime_source": "stoker/runtime/launch.py", "new_runtime_file": "stoker/runtime/x.py",
        "config": "stoker/config.py", "verify_script": "images/verify_image.py",
        "imported_by_config": "stoker/tracking/pricing.py",
    }[change]
    target = source_copy / path
    target.write_text((target.read_text() if target.exists() else "") + "\n# changed\n")
    assert content_hash(spec) != before


@pytest.mark.parametrize("update", [
    {"base_image": "debian:trixie-slim"}, {"torch": "2.12.0"}, {"python": "3.12"},
    {"cuda": "12.8"}, {"torch_index_url": "https://example.invalid/simple"}])
def test_hash_changes_with_build_arguments(source_copy, update):
    spec = _spec(source_copy)
    changed = spec.model_copy(update={"entry": spec.entry.model_copy(update=update)})
    assert content_hash(changed) != content_hash(spec)


def test_context_follows_the_runtime_imports(source_copy):
    spec = _spec(source_copy)
    names = {name for name, _ in spec.context_files()}
    assert {"stoker/config.py", "stoker/tracking/pricing.py", "stoker/runtime/trainer.py"} <= names
    assert "stoker/launch/local.py" not in names and "stoker/images/build.py" not in names
    before = content_hash(spec)
    (source_copy / "stoker/launch/local.py").write_text("# not part of the image\n")
    assert content_hash(spec) == before
    # A new import (absolute, `from stoker import`, or relative) brings its module along.
    for statement, module in [("import stoker.jobs.job", "jobs/job"),
                              ("from stoker import ownership", "ownership"),
                              ("from ..tracking.lineage import code_version", "tracking/lineage")]:
        (source_copy / "stoker/runtime/extra.py").write_text(
            f"def f():\n    {statement}\n")
        assert f"stoker/{module}.py" in {name for name, _ in spec.context_files()}
    (source_copy / "stoker/runtime/extra.py").write_text("from stoker.nowhere import x\n")
    with pytest.raises(ConfigError, match="imports stoker.nowhere, which has no file"):
        spec.context_files()


def test_hash_covers_the_wheelhouse_by_name_and_size(source_copy, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "a-1.0-py3-none-any.whl").write_bytes(b"1234")
    spec = _spec(source_copy, pip_install_from="wheelhouse", wheelhouse=wheels)
    before = content_hash(spec)
    assert before != content_hash(_spec(source_copy))
    (wheels / ".marker").write_text("hidden files are not part of the context")
    assert content_hash(spec) == before
    (wheels / "b-2.0-py3-none-any.whl").write_bytes(b"5")
    assert content_hash(spec) != before


def test_context_holds_exactly_the_hashed_files_and_is_reproducible(source_copy):
    spec = _spec(source_copy)
    first, second = io.BytesIO(), io.BytesIO()
    write_context(spec, first)
    write_context(spec, second)
    assert first.getvalue() == second.getvalue()
    with tarfile.open(fileobj=io.BytesIO(first.getvalue())) as tar:
        files = {m.name for m in tar.getmembers() if m.isfile()}
        folders = {m.name for m in tar.getmembers() if m.isdir()}
    assert files == {name for name, _ in spec.context_files()}
    assert {"Dockerfile", "requirements-runtime.txt", "stoker/config.py",
            "stoker/runtime/launch.py"} <= files
    assert "wheelhouse" in folders  # COPY wheelhouse/ needs it even when empty


def test_matrix_default_and_build_arguments():
    matrix = load_matrix()
    default = matrix.entry()
    assert default is matrix.entries[matrix.default] and default.cuda is not None
    assert "cudnn-runtime" in default.base_image
    args = ImageSpec(entry=default).build_args()
    assert args["BASE_IMAGE"] == default.base_image
    assert args["STOKER_CUDA_VERSION"] == default.cuda
    assert args["STOKER_PYTHON_VERSION"] == default.python
    assert args["STOKER_TORCH_VERSION"] == default.torch
    assert ImageSpec(entry=matrix.entry(ENTRY)).build_args()["STOKER_CUDA_VERSION"] == "none"


def test_matrix_and_request_errors_name_the_field(tmp_path):
    bad = tmp_path / "matrix.yaml"
    bad.write_text("default: a\nentries:\n  a: {base_image: x, cuda: '12', python: '3.11', "
                   "torch: '2.13.0'}\n")
    with pytest.raises(ConfigError, match=r"entries\.a\.cuda: must be major\.minor"):
        load_matrix(bad)
    bad.write_text("default: b\nentries:\n  a: {base_image: x, cuda: null, python: '3.11', "
                   "torch: '2.13.0'}\n")
    with pytest.raises(ConfigError, match="default 'b' is not one of"):
        load_matrix(bad)
    with pytest.raises(ConfigError, match="matrix entry 'nope': not found"):
        ImageRequest(matrix_entry="nope").spec()
    with pytest.raises(ConfigError, match="wheelhouse: required"):
        ImageRequest(pip_install_from="wheelhouse").spec()
    with pytest.raises(ConfigError, match="image.registry: must be host"):
        ImageSpec.from_matrix(registry="http://127.0.0.1:5000")
    with pytest.raises(ConfigError, match="image.repository: must be a lower-case path"):
        ImageSpec.from_matrix(repository="Stoker/train:v1")
