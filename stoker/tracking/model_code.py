"""The code a registered model ships: the Stoker modules its loader imports, not the package.

A Stoker model is logged "from code" (``stoker/tracking/pyfunc_code.py``) with Stoker's code as
``code_paths``. Shipping the whole package (133 files, 1.4 MB, the launchers, the cost guard and
the CLI included) cost an artifact upload per file on every registration: against a tracking
server with basic auth, one request each (0.6-1.6 s apiece under load, issue 45's trial). Only
the modules the loader can import are shipped: the closure of ``stoker`` imports of the loader
file, its lazy (function-level) imports included, and the packages above each module (their
``__init__.py`` runs on import). No Prefect.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

PACKAGE = "stoker"


def _module_file(root: Path, name: str) -> Path | None:
    """The file of module ``name`` (``stoker.x.y``) under ``root`` (the folder holding the
    ``stoker`` package): ``x/y.py`` or ``x/y/__init__.py``; None when neither exists."""
    parts = name.split(".")
    path = root.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(root: Path, path: Path) -> set[str]:
    """Names of the ``stoker`` modules ``path`` imports anywhere in its body (``import a.b``,
    ``from a import b`` with ``b`` a module or a name, relative imports resolved)."""
    package = _module_name(root, path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {n for n in names if n == PACKAGE or n.startswith(PACKAGE + ".")}


def model_code_files(entry: Path, root: Path) -> list[Path]:
    """Every file of the ``stoker`` package under ``root`` that loading ``entry`` can import.

    Args:
        entry: the model's loader file (``pyfunc_code.py``), which need not be in the package.
        root: the folder that holds the ``stoker`` package folder.

    Returns:
        The files, sorted; each package's ``__init__.py`` above a listed module included.
    """
    found: set[Path] = set()
    todo = [entry]
    while todo:
        for name in _imported(root, todo.pop()):
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):  # the packages above run on import
                path = _module_file(root, ".".join(parts[:depth]))
                if path is not None and path not in found:
                    found.add(path)
                    todo.append(path)
    return sorted(found)


def stage_model_code(entry: Path, package_dir: Path, dst: Path) -> Path:
    """Copy the files of :func:`model_code_files` into ``dst/<package>`` (their layout kept);
    returns that folder, to pass as ``code_paths``.

    Args:
        entry: the model's loader file.
        package_dir: the installed ``stoker`` package folder (``Path(stoker.__file__).parent``).
        dst: an empty folder.
    """
    root = package_dir.parent
    for path in model_code_files(entry, root):
        target = dst / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return dst / package_dir.name
