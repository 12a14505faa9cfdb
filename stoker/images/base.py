"""A minimal Debian base image made with debootstrap, for hosts that reach no image registry.

Air-gapped hosts (and this project's tests) cannot pull ``debian:bookworm-slim`` or ``nvidia/cuda``.
``ensure_debian_base`` builds an equivalent of ``debian:<suite>-slim`` from Debian's package mirror
with ``debootstrap --variant=minbase`` and imports it into the Docker Engine with ``docker import``.
The image is made once: a tag that already exists is reused.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import docker
import docker.errors
from docker.utils import parse_repository_tag


class DebianBaseError(RuntimeError):
    """debootstrap is missing or failed; the message names the suite, mirror and cause."""


DEFAULT_MIRROR = "http://deb.debian.org/debian"


def ensure_debian_base(client: docker.DockerClient, tag: str, suite: str = "bookworm",
                       mirror: str = DEFAULT_MIRROR, include: tuple[str, ...] = (),
                       timeout_s: float = 900.0) -> str:
    """Return the image id of ``tag``, creating it from a debootstrapped ``suite`` if missing.

    Args:
        client: Docker client connected to the engine that should hold the image.
        tag: image reference to create, e.g. ``stoker-test/base:bookworm``.
        suite: Debian suite (``bookworm``).
        mirror: Debian mirror URL; its ``sources.list`` entry stays in the image for ``apt-get``.
        include: extra Debian packages to install (``debootstrap --include``).
        timeout_s: limit for debootstrap, in seconds (a first run takes one to three minutes).

    Returns:
        The image id (``sha256:...``).

    Raises:
        DebianBaseError: debootstrap is not installed, or it failed (its last output lines).
    """
    try:
        return client.images.get(tag).id
    except docker.errors.ImageNotFound:
        pass
    if shutil.which("debootstrap") is None:
        raise DebianBaseError(f"debootstrap is not installed: cannot create base image {tag}")
    with tempfile.TemporaryDirectory(prefix="stoker-debootstrap-") as tmp:
        root = Path(tmp) / "root"
        command = ["debootstrap", "--variant=minbase"]
        if include:
            command.append(f"--include={','.join(include)}")
        command += [suite, str(root), mirror]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise DebianBaseError(
                f"debootstrap {suite} from {mirror} failed (exit {done.returncode}):\n{tail}")
        # Keep the image small and free of host-specific state, like the official slim images.
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        shutil.rmtree(root / "var/lib/apt/lists", ignore_errors=True)
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(root), "-c", "."],
                               stdout=subprocess.PIPE)
        try:
            repository, name_tag = parse_repository_tag(tag)
            client.api.import_image_from_stream(
                tar.stdout, repository=repository, tag=name_tag or "latest",
                changes=['CMD ["/bin/bash"]', "ENV LANG=C.UTF-8"])
        finally:
            tar.stdout.close()
            tar.wait()
    return client.images.get(tag).id
