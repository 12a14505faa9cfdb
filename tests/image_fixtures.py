"""Session fixtures for tests that need the training image: the real images/Dockerfile built on
a local stand-in base, pushed to the registry on 127.0.0.1:5000 once per session and shared by
the image tests and the docker launcher tests (a cached session takes seconds)."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from pathlib import Path

import docker.errors
import pytest
from image_support import (
    CACHE_TAG,
    ENTRY,
    delete_repository,
    docker_client,
    ensure_standin_base,
    ensure_wheelhouse,
    require_registry,
)

from stoker.images.build import build_and_push
from stoker.images.spec import ImageSpec

SESSION = uuid.uuid4().hex[:10]


def git_head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()


def _tags(engine, image_id: str) -> list[str]:
    try:
        return engine.images.get(image_id).tags
    except docker.errors.ImageNotFound:
        return []


def _image_id(engine, ref: str) -> str | None:
    try:
        return engine.images.get(ref).id
    except docker.errors.ImageNotFound:
        return None


@pytest.fixture(scope="session")
def engine():
    client = docker_client()
    require_registry()
    yield client
    client.close()


@pytest.fixture(scope="session")
def standin_base(engine) -> str:
    return ensure_standin_base(engine)


@pytest.fixture(scope="session")
def wheelhouse(request) -> Path:
    return ensure_wheelhouse(request.config.cache.mkdir("stoker-image-wheelhouse"), ENTRY)


@pytest.fixture(scope="session")
def spec(standin_base, wheelhouse) -> ImageSpec:
    return ImageSpec.from_matrix(ENTRY, base_image=standin_base,
                                 repository=f"stoker-test/train-{SESSION}",
                                 pip_install_from="wheelhouse", wheelhouse=wheelhouse)


@pytest.fixture(scope="session")
def built(engine, spec):
    """The real images/Dockerfile, built and pushed once for this module.

    Yields (result, build log lines, the git commit checked out when the build started).
    """
    lines: list[str] = []
    head = git_head()
    result = build_and_push(spec, on_log=lines.append)
    previous = _image_id(engine, CACHE_TAG)
    engine.images.get(result.ref).tag(CACHE_TAG)
    if previous and previous != engine.images.get(CACHE_TAG).id and not _tags(engine, previous):
        with contextlib.suppress(docker.errors.APIError):  # e.g. still used by a container
            engine.images.remove(previous)
    yield result, lines, head
    delete_repository(spec.registry, spec.repository)
    if _image_id(engine, result.ref):
        engine.images.remove(result.ref)




@pytest.fixture(scope="session")
def training_image(built):
    """The built training image (``stoker.images.build.ImageResult``)."""
    return built[0]


@pytest.fixture(scope="session")
def docker_engine(engine):
    return engine
