"""CI's constraints file (.ci/constraints.txt) agrees with pyproject.toml.

CI installs with ``pip install --constraint .ci/constraints.txt``; a requirement changed in
pyproject.toml without `make constraints` would otherwise fail there, after minutes of pip, with
a resolver message that names neither file.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def pins() -> dict[str, str]:
    found = {}
    for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f".ci/constraints.txt: {line!r} is not an exact pin (name==version)"
            found[canonicalize_name(name)] = version
    return found


def installed_requirements() -> list[Requirement]:
    """What `make install` asks for: the dependencies and the Makefile's default EXTRAS."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = re.search(r"^EXTRAS \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert extras, "Makefile: no `EXTRAS ?= ...` line"
    reqs = list(project["dependencies"])
    for extra in extras.group(1).split(","):
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def test_every_requirement_is_pinned_to_a_version_in_its_range():
    pinned = pins()
    for req in installed_requirements():
        name = canonicalize_name(req.name)
        if name == "torch":  # installed first, from the CPU build or the machine's CUDA build
            assert name not in pinned
            continue
        assert name in pinned, (
            f".ci/constraints.txt has no pin for {req.name}: run make constraints")
        assert req.specifier.contains(pinned[name], prereleases=True), (
            f".ci/constraints.txt pins {req.name}=={pinned[name]}, outside pyproject.toml's "
            f"{req}: run make constraints")


def test_ci_installs_with_the_constraints_file():
    assert "CONSTRAINTS=${CONSTRAINTS:-.ci/constraints.txt}" in (ROOT / ".ci" / "run").read_text()
    assert "--constraint $(CONSTRAINTS)" in (ROOT / "Makefile").read_text()


def test_make_install_uses_the_lock_by_default_with_progress(tmp_path):
    """New-user finding: `make run` spent 19.5 of its 24 minutes in a silent pip resolving the
    open ranges; the lock was used by CI only. `make install` (no variable set) now installs
    the locked set with uv, shown as it goes, and falls back to pip with the same lock."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("CONSTRAINTS", "UV", "MAKEFLAGS")}
    plan = subprocess.run(["make", "-n", "install", f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    assert plan.count("--constraint .ci/constraints.txt") == 2, plan  # uv, and pip's fallback
    assert re.search(r"/uv pip install --compile-bytecode --python \S+ --constraint "
                     r"\.ci/constraints\.txt -e", plan)
    assert "-m compileall -q stoker flows tasks" in plan
    install_lines = [line for line in plan.splitlines() if "-e \".[" in line]
    assert install_lines and all("--quiet" not in line for line in install_lines), plan


@pytest.fixture(scope="module")
def module_resource() -> object:
    """Stands for a module's expensive shared fixture (a Prefect server, a trained job)."""
    return object()


def test_the_tests_of_a_module_scoped_fixture_share_one_xdist_worker(module_resource, request):
    """`make test` runs `--dist loadgroup`, and tests/conftest.py groups the tests of a module
    with a module-scoped fixture so that one worker makes it once. With pytest 9.2 and
    pytest-xdist 3.8 the group was silently dropped (pytest-dev/pytest-xdist#1386), and so it
    was when conftest's hook ran after xdist's: every module's server was started on both
    workers."""
    # on a worker, xdist keeps `--dist loadgroup` as this option (and `dist` reads "no")
    if not os.environ.get("PYTEST_XDIST_WORKER") or not getattr(request.config.option,
                                                                 "loadgroup", False):
        pytest.skip("runs under pytest-xdist --dist loadgroup only (as `make test` runs it)")
    assert request.node.nodeid.endswith("@test_constraints.py"), request.node.nodeid


@pytest.mark.parametrize("module", ["mlflow", "prefect", "typer", "pydantic", "dvc",
                                    "stoker.cli"])
def test_make_install_leaves_bytecode_for_what_every_stoker_process_imports(module):
    """`make install` compiles the environment (uv --compile-bytecode, compileall for Stoker):
    where PYTHONDONTWRITEBYTECODE is set (this project's CI), a module without its .pyc is
    compiled from source by every process that imports it (stoker predict spent 5.5 of its 9.9
    CPU-s so). Run on the environment `make install` made, as CI's is."""
    import importlib.util

    origin = importlib.util.find_spec(module).origin
    cached = Path(importlib.util.cache_from_source(origin))
    assert cached.is_file(), f"{origin}: no bytecode at {cached} (make install compiles it)"
