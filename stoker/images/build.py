"""Content-addressed training images: build through the Docker Engine only what is not pushed.

``build_and_push(spec)`` hashes everything that determines the image (``stoker.images.spec``), asks
the registry whether ``<registry>/<repository>:<hash>`` exists and, if it does, returns its digest
without building. Otherwise it checks the base image, builds through the Engine API (output passed
line by line to ``on_log``), pushes, and returns reference, digest and size. Every failure raises
at once (no retries) with an error naming the daemon, tag or registry. No Prefect here: the
``build-image`` task and flow wrap these functions.

Registry credentials come from the caller (``RegistryCredentials``), from the environment
(``STOKER_REGISTRY_USERNAME`` / ``STOKER_REGISTRY_PASSWORD``), or else from Docker's own
``~/.docker/config.json``; they are never logged or put in an error message.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from urllib.parse import urlsplit, urlunsplit

import docker
import docker.errors
import requests
from docker.auth import resolve_repository_name
from docker.utils import parse_repository_tag
from pydantic import BaseModel, ConfigDict, SecretStr

from stoker import __version__
from stoker.images.spec import ImageSpec, content_hash, image_ref, image_tag, write_context
from stoker.images.stream import ANSI, build_cause, engine_error, shortened
from stoker.tracking.lineage import code_version

USERNAME_ENV = "STOKER_REGISTRY_USERNAME"
PASSWORD_ENV = "STOKER_REGISTRY_PASSWORD"
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
PROBE_TIMEOUT_S = 10.0
# Pull/push statuses repeated for every chunk of every layer: not worth a log line each.
_PROGRESS = {"Preparing", "Waiting", "Pushing", "Downloading", "Extracting",
             "Verifying Checksum", "Pulling fs layer"}


class ImageError(RuntimeError):
    """Base class of the errors below; the message names the daemon, image or registry."""


class DockerUnavailableError(ImageError):
    """The Docker daemon does not answer."""


class BaseImageNotFoundError(ImageError):
    """The base image is neither present locally nor found in its registry."""


class RegistryUnreachableError(ImageError):
    """The registry does not answer."""


class RegistryCredentialsMissingError(ImageError):
    """The registry requires credentials and none were given."""


class RegistryAuthError(ImageError):
    """The registry rejected the credentials given."""


class ImageBuildError(ImageError):
    """The Docker build failed (a Dockerfile step exited non-zero)."""


class PushRejectedError(ImageError):
    """The registry refused the push."""


class RegistryCredentials(BaseModel):
    """A registry login. The password is a SecretStr: printing the object shows ``**********``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    username: str
    password: SecretStr

    def auth_config(self, registry: str) -> dict[str, str]:
        """The Engine API's auth config for ``registry`` (sent in a header, never logged)."""
        return {"username": self.username, "password": self.password.get_secret_value(),
                "serveraddress": registry}


def credentials_from_env(env: dict[str, str] | None = None) -> RegistryCredentials | None:
    """Credentials from ``STOKER_REGISTRY_USERNAME`` and ``STOKER_REGISTRY_PASSWORD``.

    Returns:
        The credentials, or None when neither variable is set.

    Raises:
        RegistryCredentialsMissingError: only one of the two is set (names the missing one).
    """
    env = os.environ if env is None else env
    username, password = env.get(USERNAME_ENV), env.get(PASSWORD_ENV)
    if not username and not password:
        return None
    if not username or not password:
        missing = USERNAME_ENV if not username else PASSWORD_ENV
        raise RegistryCredentialsMissingError(f"{missing} is not set (the other one is)")
    return RegistryCredentials(username=username, password=password)


@dataclass(frozen=True)
class ImageResult:
    """A training image in the registry.

    Attributes:
        ref: ``<registry>/<repository>:<tag>``; the tag is the content hash (32 hex characters).
        digest: manifest digest in the registry (``sha256:...``).
        content_hash: the full sha256 of the build inputs (64 hex characters).
        built: False when the registry already held the tag and nothing was built.
        size_bytes: uncompressed image size reported by the Engine; None when the image was
            found in the registry and is not present on this engine.
        duration_s: seconds the call took.
    """

    ref: str
    digest: str
    content_hash: str
    built: bool
    size_bytes: int | None
    duration_s: float

    @property
    def tag(self) -> str:
        return self.ref.rsplit(":", 1)[1]

    @property
    def pinned_ref(self) -> str:
        """``<registry>/<repository>@<digest>``: pulls exactly this image, whatever the tag."""
        return f"{self.ref.rsplit(':', 1)[0]}@{self.digest}"

    def lineage_tags(self) -> dict[str, str]:
        """Tags for the MLflow run and model version: which image trained it."""
        return {"stoker.image": self.ref, "stoker.image_digest": self.digest,
                "stoker.image_content_hash": self.content_hash}

    def to_dict(self) -> dict:
        return {**asdict(self), "tag": self.tag, "pinned_ref": self.pinned_ref}


def connect(docker_host: str | None = None, timeout_s: float = 3600.0) -> docker.APIClient:
    """An Engine API client, after a ping that fails fast.

    Args:
        docker_host: daemon URL (``unix:///var/run/docker.sock``, ``tcp://127.0.0.1:2375``);
            None: ``DOCKER_HOST`` and the other ``DOCKER_*`` variables, else the default socket.
        timeout_s: socket read timeout of the returned client, in seconds (builds can be silent
            for minutes while a large wheel installs).

    Raises:
        DockerUnavailableError: the daemon does not answer within 10 s (names the URL).
    """
    where = docker_host or os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST
    kwargs = {"base_url": docker_host} if docker_host else docker.utils.kwargs_from_env()
    try:
        probe = docker.APIClient(timeout=PROBE_TIMEOUT_S, **kwargs)
        probe.ping()
        probe.close()
        return docker.APIClient(timeout=timeout_s, **kwargs)
    except (docker.errors.DockerException, requests.RequestException) as e:
        raise DockerUnavailableError(f"Docker daemon at {where} is not reachable: {e}") from None


def registry_of(ref: str) -> str:
    """The registry host of an image reference (``docker.io`` for ``nvidia/cuda:...``)."""
    repository, _ = parse_repository_tag(ref)
    return resolve_repository_name(repository)[0]


def _is_auth_failure(error: docker.errors.APIError | str) -> bool:
    text = str(error).lower()
    status = getattr(error, "status_code", None)
    return status in (401, 403) or any(
        word in text for word in ("no basic auth credentials", "unauthorized",
                                  "authentication required", "denied"))


def _auth_error(registry: str, credentials: RegistryCredentials | None,
                detail: str) -> ImageError:
    if credentials is None:
        return RegistryCredentialsMissingError(
            f"registry {registry} requires credentials ({detail}): set {USERNAME_ENV} and "
            f"{PASSWORD_ENV}, give a Prefect Secret block, or `docker login {registry}`")
    return RegistryAuthError(
        f"registry {registry} rejected the credentials of user {credentials.username!r} "
        f"({detail})")


def registry_digest(api: docker.APIClient, ref: str,
                    credentials: RegistryCredentials | None = None) -> str | None:
    """The manifest digest of ``ref`` in its registry, asked through the daemon.

    Returns:
        ``sha256:...``, or None when the registry answers that the tag does not exist.

    Raises:
        RegistryCredentialsMissingError, RegistryAuthError: the registry wants (other) credentials.
        RegistryUnreachableError: the registry does not answer (names it and the cause).
    """
    registry = registry_of(ref)
    auth = credentials.auth_config(registry) if credentials else None
    try:
        found = api.inspect_distribution(ref, auth_config=auth)
    except docker.errors.NotFound:
        return None
    except docker.errors.APIError as e:
        if _is_auth_failure(e):
            raise _auth_error(registry, credentials, e.explanation or str(e)) from None
        raise RegistryUnreachableError(
            f"registry {registry} did not answer for {ref}: {e.explanation or e}") from None
    return found["Descriptor"]["digest"]


def ensure_base_image(api: docker.APIClient, base_image: str,
                      credentials: RegistryCredentials | None = None,
                      on_log: Callable[[str], None] = print) -> None:
    """Make sure the build can start FROM ``base_image``: present locally, else pulled now.

    Pulling before the build gives a missing tag its own error (instead of a failed build step)
    and lets a base in a private registry use ``credentials``.

    Args:
        credentials: login for the base's registry (None: Docker's config file, or anonymous).

    Raises:
        BaseImageNotFoundError: not on this engine and the registry does not have it (or does
            not answer); names the tag, its registry and the registry's answer.
    """
    try:
        api.inspect_image(base_image)
        return
    except docker.errors.ImageNotFound:
        pass
    registry = registry_of(base_image)
    auth = credentials.auth_config(registry) if credentials else None
    try:
        api.inspect_distribution(base_image, auth_config=auth)
        repository, tag = parse_repository_tag(base_image)
        on_log(f"pulling base image {base_image}")
        for chunk in api.pull(repository, tag=tag, stream=True, decode=True, auth_config=auth):
            if (error := engine_error(chunk)) is not None:
                raise docker.errors.APIError(error)
            for line in _lines(chunk):
                on_log(line)
    except docker.errors.APIError as e:
        raise BaseImageNotFoundError(
            f"base image {base_image}: not on this engine and not found in registry {registry} "
            f"({e.explanation or e})") from None


def build(api: docker.APIClient, spec: ImageSpec, ref: str, labels: dict[str, str],
          on_log: Callable[[str], None]) -> str:
    """Build ``spec`` as ``ref`` through the Engine API, passing each output line to ``on_log``.

    Returns:
        The image id (``sha256:...``).

    Raises:
        ImageBuildError: a step failed. Its first line names the image, the Engine's error
            (a long step command cut to 80 characters) and the output line that says why
            (pip's ``ERROR: ...``, apt's ``E: ...``); the last 15 output lines follow.
    """
    image_id = None
    recent: deque[str] = deque(maxlen=15)
    with tempfile.TemporaryFile(prefix="stoker-context-") as context:
        write_context(spec, context)
        context.seek(0)
        try:
            # Engines without a default bridge (--bridge=none, rootless) build on the host network.
            stream = api.build(fileobj=context, custom_context=True, tag=ref,
                               buildargs=spec.build_args(), labels=labels, network_mode="host",
                               rm=True, forcerm=True, decode=True)
            for chunk in stream:
                if (error := engine_error(chunk)) is not None:
                    cause = build_cause(list(recent))
                    tail = "\n".join(recent)
                    raise ImageBuildError(f"build of {ref} failed: {shortened(error)}"
                                          + (f" ({cause})" if cause else "")
                                          + f"\n{tail}")
                for line in _lines(chunk):
                    recent.append(line)
                    on_log(line)
                image_id = chunk.get("aux", {}).get("ID", image_id)
        except docker.errors.APIError as e:
            raise ImageBuildError(f"build of {ref} failed: {e.explanation or e}") from None
    if image_id is None:
        raise ImageBuildError(f"build of {ref} ended without an image id")
    return image_id


def push(api: docker.APIClient, ref: str, credentials: RegistryCredentials | None,
         on_log: Callable[[str], None]) -> str:
    """Push ``ref`` and return its manifest digest.

    Raises:
        PushRejectedError: the registry refused the push (names image, registry and reason).
        RegistryCredentialsMissingError, RegistryAuthError: the registry wants (other) credentials.
    """
    registry = registry_of(ref)
    repository, tag = parse_repository_tag(ref)
    auth = credentials.auth_config(registry) if credentials else None
    digest = None
    for chunk in api.push(repository, tag=tag, stream=True, decode=True, auth_config=auth):
        if (error := engine_error(chunk)) is not None:
            if _is_auth_failure(error):
                raise _auth_error(registry, credentials, error)
            raise PushRejectedError(f"registry {registry} rejected the push of {ref}: {error}")
        for line in _lines(chunk):
            on_log(line)
        digest = chunk.get("aux", {}).get("Digest", digest)
    if digest is None:
        raise PushRejectedError(f"registry {registry}: push of {ref} returned no digest")
    return digest


def build_labels(spec: ImageSpec, hash_hex: str) -> dict[str, str]:
    """OCI labels that are not build inputs: source, revision, creation time, content hash."""
    code = code_version(spec.source_root)
    return {
        "org.opencontainers.image.source": _source_url(spec),
        "org.opencontainers.image.revision": code["git_commit"],
        "org.opencontainers.image.created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "org.opencontainers.image.version": image_tag(hash_hex),
        "io.stoker.version": __version__,
        "io.stoker.git-dirty": code["git_dirty"],
        "io.stoker.content-hash": hash_hex,
    }


def build_and_push(spec: ImageSpec, credentials: RegistryCredentials | None = None,
                   on_log: Callable[[str], None] = print, docker_host: str | None = None,
                   ) -> ImageResult:
    """Return the registry image for ``spec``, building and pushing it only if it is missing.

    Args:
        spec: what to build and where to push it.
        credentials: registry login; None: the environment (see ``credentials_from_env``), else
            Docker's config file.
        on_log: receives each line of build and push output.
        docker_host: daemon URL; None: ``DOCKER_HOST`` or the default socket.

    Returns:
        The image's reference, digest and (when built or present locally) size.

    Raises:
        ImageError: one of its subclasses DockerUnavailableError, RegistryUnreachableError,
            RegistryCredentialsMissingError, RegistryAuthError, BaseImageNotFoundError,
            ImageBuildError, PushRejectedError (see each).
        ConfigError: a build input is missing.
    """
    started = time.monotonic()
    credentials = credentials or credentials_from_env()
    hash_hex = content_hash(spec)
    ref = image_ref(spec, hash_hex)
    api = connect(docker_host)
    try:
        digest = registry_digest(api, ref, credentials)
        if digest is not None:
            on_log(f"{ref} is already in the registry ({digest}): nothing to build")
            return ImageResult(ref, digest, hash_hex, False, _local_size(api, ref, digest),
                               time.monotonic() - started)
        same_registry = registry_of(spec.entry.base_image) == spec.registry
        ensure_base_image(api, spec.entry.base_image, credentials if same_registry else None,
                          on_log)
        on_log(f"building {ref} from {spec.entry.base_image}")
        build(api, spec, ref, build_labels(spec, hash_hex), on_log)
        digest = push(api, ref, credentials, on_log)
        size = api.inspect_image(ref)["Size"]
        on_log(f"pushed {ref} ({digest}, {size / 1e6:.0f} MB)")
        return ImageResult(ref, digest, hash_hex, True, size, time.monotonic() - started)
    finally:
        api.close()


def _lines(chunk: dict) -> Iterator[str]:
    """The output lines of one Engine chunk, colour codes removed and blank ones dropped (the
    legacy builder's colour resets came through as empty lines in the log and the tail)."""
    if "stream" in chunk:
        plain = (ANSI.sub("", line).rstrip() for line in chunk["stream"].splitlines())
        yield from (line for line in plain if line.strip())
    elif chunk.get("status") and chunk["status"] not in _PROGRESS:  # pull and push
        yield f"{chunk.get('id', '')} {chunk['status']}".strip()


def _local_size(api: docker.APIClient, ref: str, digest: str) -> int | None:
    try:
        image = api.inspect_image(ref)
    except docker.errors.ImageNotFound:
        return None
    repo_digests = image.get("RepoDigests") or []
    return image["Size"] if any(d.endswith(digest) for d in repo_digests) else None


def _source_url(spec: ImageSpec) -> str:
    """The checkout's ``origin`` remote, else its local path as a file URL."""
    try:
        out = subprocess.run(["git", "remote", "get-url", "origin"], cwd=spec.source_root,
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        out = None
    if out is not None and out.returncode == 0 and out.stdout.strip():
        return without_userinfo(out.stdout.strip())
    return spec.source_root.resolve().as_uri()


def without_userinfo(url: str) -> str:
    """``url`` without ``user:token@`` (a remote URL may carry a token; labels are public)."""
    parts = urlsplit(url)
    if parts.scheme and "@" in parts.netloc:
        return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
    return url
