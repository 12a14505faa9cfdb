"""What a training image is made of: a matrix entry, its build context, and its content hash.

No Docker here. The build context is exactly the set of files that the content hash covers (the
Dockerfile, the build-time check, the dependency lock, the runtime sources and an optional
wheelhouse), so an image tagged with the hash was built from precisely those inputs.
"""

from __future__ import annotations

import ast
import hashlib
import re
import tarfile
from pathlib import Path
from typing import IO, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from stoker.config import ConfigError, _Frozen, refuse_option_like, validate

SOURCE_ROOT = Path(__file__).resolve().parents[2]
IMAGES_DIR = "images"
MATRIX_FILE = f"{IMAGES_DIR}/matrix.yaml"
# Files taken from images/ into the root of the build context.
IMAGE_FILES = ("Dockerfile", "verify_image.py", "requirements-runtime.txt")
# The runtime package; the Stoker modules it imports (stoker/config.py, ...) are found by
# reading its import statements (runtime_sources), so a new import cannot be left out.
RUNTIME_PACKAGE = "stoker/runtime"
WHEELHOUSE_DIR = "wheelhouse"
# Bump when the layout of the build context changes, so that old tags are not reused.
CONTEXT_FORMAT = "stoker-image-context/1"
TAG_HEX_CHARS = 32  # 128 bits of the sha256: unique in practice, short enough to read

_MAJOR_MINOR = re.compile(r"^\d+\.\d+$")
_REGISTRY = re.compile(r"^[A-Za-z0-9.-]+(:\d+)?$")
_REPOSITORY = re.compile(r"^[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*$")


class MatrixEntry(_Frozen):
    """One supported CUDA x PyTorch x Python combination (an entry of images/matrix.yaml)."""

    base_image: str = Field(description="Image to build FROM (CUDA runtime with cuDNN, or Debian).")
    cuda: str | None = Field(description="CUDA major.minor the image needs; null: CPU only.")
    python: str = Field(description="Python major.minor, from the base's distribution packages.")
    torch: str = Field(description="PyTorch version, e.g. 2.13.0.")
    torch_index_url: str | None = Field(
        None, description="Extra package index serving this torch build; null: PyPI only.")

    @field_validator("cuda", "python")
    @classmethod
    def _major_minor(cls, value: str | None) -> str | None:
        if value is not None and not _MAJOR_MINOR.match(value):
            raise ValueError("must be major.minor, e.g. 12.8")
        return value

    @field_validator("base_image", "torch")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value


class Matrix(_Frozen):
    """The version matrix: named entries and the name of the default one."""

    default: str
    entries: dict[str, MatrixEntry]

    @model_validator(mode="after")
    def _default_exists(self) -> Matrix:
        if self.default not in self.entries:
            raise ValueError(f"default {self.default!r} is not one of {sorted(self.entries)}")
        return self

    def entry(self, name: str | None = None) -> MatrixEntry:
        """The entry called ``name`` (None: the default).

        Raises:
            ConfigError: no entry has that name (the message lists the names).
        """
        name = name or self.default
        if name not in self.entries:
            raise ConfigError(f"matrix entry {name!r}: not found; entries: {sorted(self.entries)}")
        return self.entries[name]


def load_matrix(path: Path | None = None) -> Matrix:
    """Read and validate the version matrix (default: images/matrix.yaml of this checkout).

    Raises:
        ConfigError: the file is missing or not YAML, or a field is invalid (named, e.g.
            ``entries.cu128.cuda: must be major.minor, e.g. 12.8, got '12'``).
    """
    path = path or SOURCE_ROOT / MATRIX_FILE
    if not path.is_file():
        raise ConfigError(f"image matrix {path}: not found")
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"image matrix {path}: not valid YAML: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"image matrix {path}: must hold a mapping with default and entries")
    return validate(Matrix, values)


class ImageSpec(_Frozen):
    """Everything that determines one training image, plus where it is pushed.

    ``registry`` and ``repository`` only name the image; the tag is the content hash of the rest.
    """

    registry: str = Field("127.0.0.1:5000", description="Registry host[:port] to push to.")
    repository: str = Field("stoker/train", description="Repository inside the registry.")
    entry: MatrixEntry = Field(description="CUDA, Python and PyTorch versions and the base.")
    pip_install_from: Literal["index", "wheelhouse"] = Field(
        "index", description="Install Python packages from the package indexes, or only from "
        "the wheelhouse folder (no index: air-gapped builds).")
    wheelhouse: Path | None = Field(
        None, description="Folder of wheels for pip_install_from=wheelhouse (see "
        "stoker.images.wheelhouse.fill_wheelhouse).")
    source_root: Path = Field(SOURCE_ROOT, description="Checkout holding images/ and stoker/.")

    @field_validator("registry")
    @classmethod
    def _host(cls, value: str) -> str:
        refuse_option_like(value, "docker", "a registry is host[:port], e.g. 127.0.0.1:5000")
        if not _REGISTRY.match(value):
            raise ValueError("must be host[:port] without scheme or path, e.g. 127.0.0.1:5000")
        return value

    @field_validator("repository")
    @classmethod
    def _repository(cls, value: str) -> str:
        if not _REPOSITORY.match(value):
            raise ValueError("must be a lower-case path without tag or digest, e.g. stoker/train")
        return value

    @model_validator(mode="after")
    def _wheelhouse_given(self) -> ImageSpec:
        if self.pip_install_from == "wheelhouse":
            if self.wheelhouse is None:
                raise ValueError("wheelhouse: required when pip_install_from is 'wheelhouse'")
            if not self.wheelhouse.is_dir():
                raise ValueError(f"wheelhouse: {self.wheelhouse} is not a folder")
        return self

    @classmethod
    def from_matrix(cls, entry: str | None = None, base_image: str | None = None,
                    matrix_path: Path | None = None, **fields) -> ImageSpec:
        """The spec for a matrix entry (None: the default), optionally on another base image.

        Raises:
            ConfigError: unknown entry, or an invalid field (named).
        """
        chosen = load_matrix(matrix_path).entry(entry)
        if base_image:
            chosen = chosen.model_copy(update={"base_image": base_image})
        return validate(cls, {"entry": chosen, **fields}, prefix="image.")

    def build_args(self) -> dict[str, str]:
        """The Dockerfile's build arguments (``STOKER_*`` and ``BASE_IMAGE``)."""
        return {
            "BASE_IMAGE": self.entry.base_image,
            "STOKER_PYTHON_VERSION": self.entry.python,
            "STOKER_TORCH_VERSION": self.entry.torch,
            "STOKER_CUDA_VERSION": self.entry.cuda or "none",
            "STOKER_TORCH_INDEX_URL": self.entry.torch_index_url or "",
            "STOKER_PIP_INSTALL_FROM": self.pip_install_from,
        }

    def context_files(self) -> list[tuple[str, Path]]:
        """(name in the build context, file) for every file of the context, sorted by name.

        Raises:
            ConfigError: a required file is missing from ``source_root``.
        """
        root = self.source_root
        files = [(name, root / IMAGES_DIR / name) for name in IMAGE_FILES]
        files += [(p.relative_to(root).as_posix(), p) for p in runtime_sources(root)]
        if self.pip_install_from == "wheelhouse":
            files += [(f"{WHEELHOUSE_DIR}/{p.name}", p) for p in self.wheelhouse.iterdir()
                      if p.is_file() and not p.name.startswith(".")]
        missing = [str(path) for _, path in files if not path.is_file()]
        if missing:
            raise ConfigError(f"image sources missing under {root}: {', '.join(missing)}")
        return sorted(files)


def runtime_sources(root: Path) -> list[Path]:
    """The runtime package's files plus every Stoker module they import, transitively.

    Reads ``import stoker.x`` / ``from stoker.x import y`` / ``from stoker import x`` anywhere
    in the files (also inside functions), so lazy imports are included too.

    Raises:
        ConfigError: an imported Stoker module has no file under ``root``.
    """
    package = root / "stoker"
    found = {package / "__init__.py"}
    found.update(p for p in (root / RUNTIME_PACKAGE).rglob("*.py") if "__pycache__" not in p.parts)
    pending = sorted(found)
    while pending:
        path = pending.pop()
        for module in _stoker_imports(path, package):
            parts = module.split(".")[1:]
            candidates = [package.joinpath(*parts).with_suffix(".py"),
                          package.joinpath(*parts, "__init__.py")] if parts else []
            target = next((c for c in candidates if c.is_file()), None)
            if parts and target is None:
                raise ConfigError(f"{path}: imports {module}, which has no file under {root}")
            if target is not None and target not in found:
                found.add(target)
                pending.append(target)
    return sorted(found)


def _stoker_imports(path: Path, package: Path) -> set[str]:
    """Dotted names of the ``stoker`` modules that ``path`` imports (``package``: stoker/)."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(a.name for a in node.names if a.name.split(".")[0] == "stoker")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "stoker":  # `from stoker import x`: x is a module or a name
                modules.update(f"stoker.{a.name}" for a in node.names
                               if (package / f"{a.name}.py").is_file()
                               or (package / a.name / "__init__.py").is_file())
            elif node.module.split(".")[0] == "stoker":
                modules.add(node.module)
        elif isinstance(node, ast.ImportFrom):  # relative: from .x import y, from .. import x
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            prefix = ".".join(("stoker", *base.relative_to(package).parts))
            if node.module:
                modules.add(f"{prefix}.{node.module}")
            else:
                modules.update(f"{prefix}.{a.name}" for a in node.names
                               if (base / f"{a.name}.py").is_file()
                               or (base / a.name / "__init__.py").is_file())
    return modules


def content_hash(spec: ImageSpec) -> str:
    """sha256 (hex, 64 characters) over everything that determines the image.

    Covers the context format version, the build arguments (sorted), and each context file in
    name order: its name and bytes, except wheels, which count by name and size (a wheel's file
    name fixes its project, version and platform; hashing gigabytes of CUDA wheels would take
    seconds). Registry, repository, labels and file times are not covered.

    Raises:
        ConfigError: a required file is missing.
    """
    digest = hashlib.sha256(f"{CONTEXT_FORMAT}\n".encode())
    for key, value in sorted(spec.build_args().items()):
        digest.update(f"arg {key}={value}\n".encode())
    for name, path in spec.context_files():
        if name.startswith(f"{WHEELHOUSE_DIR}/"):
            digest.update(f"wheel {name} {path.stat().st_size}\n".encode())
            continue
        data = path.read_bytes()
        digest.update(f"file {name} {len(data)}\n".encode())
        digest.update(data)
    return digest.hexdigest()


def image_tag(hash_hex: str) -> str:
    """The image tag for a content hash: its first 32 hex characters."""
    return hash_hex[:TAG_HEX_CHARS]


def image_ref(spec: ImageSpec, hash_hex: str) -> str:
    """``<registry>/<repository>:<tag>`` for the content hash ``hash_hex``."""
    return f"{spec.registry}/{spec.repository}:{image_tag(hash_hex)}"


def write_context(spec: ImageSpec, out: IO[bytes]) -> None:
    """Write the build context of ``spec`` to ``out`` as an uncompressed tar.

    Entries are normalised (owner root, mode 0644/0755, time 0) so the same inputs give the same
    bytes; the ``wheelhouse/`` folder is always present (empty unless installing from it).

    Raises:
        ConfigError: a required file is missing.
    """
    files = spec.context_files()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        folders = {WHEELHOUSE_DIR}
        for name, _ in files:
            parts = name.split("/")[:-1]
            folders.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        for folder in sorted(folders):
            tar.addfile(_info(folder, tarfile.DIRTYPE, 0o755, 0))
        for name, path in files:
            with path.open("rb") as data:
                tar.addfile(_info(name, tarfile.REGTYPE, 0o644, path.stat().st_size), data)


def _info(name: str, kind: bytes, mode: int, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.mtime = kind, mode, size, 0
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


class ImageRequest(_Frozen):
    """What a user asks for: a matrix entry, where to push it, and how to install packages.

    The parameter model of the ``build-image`` flow and of the prefect.yaml build step; plain
    strings so that Prefect's UI draws a form. The registry password is never a field: give the
    name of a Prefect Secret block, or set STOKER_REGISTRY_USERNAME / STOKER_REGISTRY_PASSWORD.
    """

    matrix_entry: str | None = Field(None, description="images/matrix.yaml entry; empty: default.")
    registry: str = Field("127.0.0.1:5000", description="Registry host[:port] to push to.")
    repository: str = Field("stoker/train", description="Repository inside the registry.")
    base_image: str | None = Field(None, description="Build FROM this instead of the entry's base.")
    pip_install_from: Literal["index", "wheelhouse"] = Field(
        "index", description="Install from the package indexes, or only from the wheelhouse.")
    wheelhouse: str | None = Field(
        None, description="Wheelhouse folder, for pip_install_from=wheelhouse.")
    registry_secret_block: str | None = Field(
        None, description="Prefect Secret block holding {\"username\": ..., \"password\": ...}.")

    @field_validator("registry", "base_image")
    @classmethod
    def _not_an_option(cls, value: str | None, info) -> str | None:
        # Named when the form or command line is read, not when the build starts.
        return refuse_option_like(value, "docker", "a registry is host[:port], e.g. "
                                  "127.0.0.1:5000" if info.field_name == "registry" else
                                  "an image reference starts with its registry or name")

    def spec(self) -> ImageSpec:
        """The image spec this request resolves to.

        Raises:
            ConfigError: unknown matrix entry or an invalid field (named).
        """
        return ImageSpec.from_matrix(
            self.matrix_entry, base_image=self.base_image, registry=self.registry,
            repository=self.repository, pip_install_from=self.pip_install_from,
            wheelhouse=Path(self.wheelhouse) if self.wheelhouse else None)
