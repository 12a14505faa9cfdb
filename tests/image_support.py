"""Helpers for the image tests: real Docker Engine, real registries and a real MLflow server.

Tests that need the engine skip with a reason when it does not answer, and fail instead when
CI=true (CI starts the engine and the registry with .ci/start-services.sh).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REGISTRY = os.environ.get("STOKER_TEST_REGISTRY", "127.0.0.1:5000")
# STOKER_TEST_BASE picks another tag, e.g. to time a first run without disturbing the cached one.
STANDIN_BASE = os.environ.get("STOKER_TEST_BASE", "stoker-test/base:bookworm")
# Keeps the last build's layers (per base) so the next session's build is served from the cache.
CACHE_TAG = f"stoker-test/train-cache:{STANDIN_BASE.rsplit(':', 1)[-1]}"
ENTRY = "cpu-py311"  # Debian 12 + CPU torch: what the stand-in base and a CPU wheel can build
MANIFEST_TYPES = ", ".join([
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.index.v1+json",
])


def skip_or_fail(reason: str) -> None:
    """Skip the test, or fail it under CI=true, where every service must be there."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: required)")
    pytest.skip(reason)


def docker_client():
    """A Docker SDK client for the local engine, or skip/fail with the reason."""
    import docker
    import requests

    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except (docker.errors.DockerException, requests.RequestException) as e:
        skip_or_fail(f"no Docker Engine reachable: {e}")
    return client


def ensure_standin_base(client) -> str:
    """Stands in for the public base images (unreachable here): Debian 12, like debian:*-slim.
    Made once with debootstrap (one to three minutes), then reused by its tag."""
    from stoker.images.base import DebianBaseError, ensure_debian_base

    try:
        ensure_debian_base(client, STANDIN_BASE)
    except DebianBaseError as e:
        skip_or_fail(f"cannot make the stand-in base image: {e}")
    return STANDIN_BASE


def local_cpu_torch_wheel(version: str) -> Path | None:
    """A CPU build of torch for this Python, from PIP_FIND_LINKS (or /opt/wheels)."""
    folders = os.environ.get("PIP_FIND_LINKS", "").split() + ["/opt/wheels"]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in folders:
        path = Path(folder.removeprefix("file://"))
        found = sorted(path.glob(f"torch-{version}+cpu-{tag}-{tag}-*.whl")) if path.is_dir() else []
        if found:
            return found[-1]
    return None


def ensure_wheelhouse(folder: Path, entry_name: str) -> Path:
    """Wheels for ``entry_name`` in ``folder``, filled once per lock and torch wheel.

    Inside builds no package index is reachable here, so the image installs from these; torch
    is the local CPU wheel (no index serves it to the build).
    """
    import hashlib

    from stoker.images.spec import SOURCE_ROOT, load_matrix
    from stoker.images.wheelhouse import fill_wheelhouse

    entry = load_matrix().entry(entry_name)
    if f"{sys.version_info.major}.{sys.version_info.minor}" != entry.python:
        skip_or_fail(f"the {entry_name} image needs Python {entry.python} wheels; "
                     f"this is Python {sys.version.split()[0]}")
    wheel = local_cpu_torch_wheel(entry.torch)
    if wheel is None:
        skip_or_fail(f"no local CPU wheel of torch {entry.torch} (PIP_FIND_LINKS, /opt/wheels)")
    lock = SOURCE_ROOT / "images/requirements-runtime.txt"
    key = hashlib.sha256(lock.read_bytes() + wheel.name.encode()).hexdigest()[:16]
    marker = folder / f".filled-{key}"
    if not marker.exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        fill_wheelhouse(folder, entry.model_copy(update={"torch_index_url": None}),
                        torch=str(wheel), on_log=lambda line: None)
        marker.touch()
    return folder


def require_registry(registry: str = REGISTRY) -> str:
    try:
        httpx.get(f"http://{registry}/v2/", timeout=5).raise_for_status()
    except httpx.HTTPError as e:
        skip_or_fail(f"no registry at {registry}: {e}")
    return registry


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, timeout_s: float, accept: tuple[int, ...] = (200,)) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code in accept:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


@contextlib.contextmanager
def extra_registry(tmp: Path, htpasswd: str | None = None,
                   readonly: bool = False) -> Iterator[str]:
    """A second real registry (Debian's docker-registry) on a free loopback port.

    Args:
        htpasswd: ``user:bcrypt-hash`` line: the registry then requires that login.
        readonly: refuse every push (storage maintenance read-only mode).
    """
    binary = "docker-registry"
    if subprocess.run(["which", binary], capture_output=True).returncode != 0:
        skip_or_fail(f"{binary} is not installed")
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    lines = ["version: 0.1", "storage:", "  filesystem:", f"    rootdirectory: {tmp / 'data'}"]
    if readonly:
        lines += ["  maintenance:", "    readonly:", "      enabled: true"]
    lines += ["http:", f"  addr: 127.0.0.1:{port}"]
    if htpasswd:
        (tmp / "htpasswd").write_text(htpasswd + "\n")
        lines += ["auth:", "  htpasswd:", "    realm: stoker-test", f"    path: {tmp / 'htpasswd'}"]
    (tmp / "config.yml").write_text("\n".join(lines) + "\n")
    log = (tmp / "registry.log").open("w")
    proc = subprocess.Popen([binary, "serve", str(tmp / "config.yml")], stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/v2/", 30, accept=(200, 401))
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def manifest_digest(registry: str, repository: str, tag: str) -> str | None:
    """The registry's own answer (HTTP API v2) for a tag's manifest digest."""
    response = httpx.head(f"http://{registry}/v2/{repository}/manifests/{tag}",
                          headers={"Accept": MANIFEST_TYPES}, timeout=10)
    if response.status_code == 404:
        return None
    response.raise_for_status()
    return response.headers["Docker-Content-Digest"]


def delete_repository(registry: str, repository: str) -> None:
    """Delete every manifest of ``repository`` (the registry runs with delete enabled)."""
    response = httpx.get(f"http://{registry}/v2/{repository}/tags/list", timeout=10)
    if response.status_code != 200:
        return
    for tag in response.json().get("tags") or []:
        digest = manifest_digest(registry, repository, tag)
        if digest:
            httpx.delete(f"http://{registry}/v2/{repository}/manifests/{digest}", timeout=10)


def make_image_folder(root: Path, classes: int = 2, per_class: int = 10) -> Path:
    """A tiny ImageFolder: ``per_class`` 8x8 grayscale PNGs per class, classes far apart."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in range(classes):
        folder = root / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = (rng.random((8, 8)) * 80 + label * 150).astype(np.uint8)
            Image.fromarray(pixels, "L").save(folder / f"{i:03d}.png")
    return root
