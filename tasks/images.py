"""Training-image tasks: build (only if missing) and push, with registry credentials from Prefect.

Also the prefect.yaml build step, so ``prefect deploy`` and the ``build-image`` flow compute the
same content-hash tag for the same inputs (both call ``stoker.images.build.build_and_push``).
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.blocks.system import Secret
from prefect.cache_policies import NO_CACHE
from pydantic import ValidationError

from stoker.config import validate
from stoker.images.build import (
    ImageResult,
    RegistryCredentials,
    RegistryCredentialsMissingError,
    build_and_push,
    credentials_from_env,
)
from stoker.images.spec import ImageRequest


def registry_credentials(secret_block: str | None) -> RegistryCredentials | None:
    """Credentials from a Prefect Secret block (JSON ``{"username", "password"}``), else the
    environment (``STOKER_REGISTRY_USERNAME`` / ``STOKER_REGISTRY_PASSWORD``), else None.

    Raises:
        RegistryCredentialsMissingError: the block does not hold both fields (names the block
            and the fields, never the values).
        ValueError: no Secret block of that name (Prefect's error).
    """
    if not secret_block:
        return credentials_from_env()
    value = Secret.load(secret_block).get()
    try:
        return RegistryCredentials.model_validate(value)
    except ValidationError as e:
        fields = sorted({str(item["loc"][0]) for item in e.errors() if item["loc"]})
        raise RegistryCredentialsMissingError(
            f"Secret block {secret_block!r} must hold JSON with username and password; "
            f"missing or invalid: {', '.join(fields) or 'the whole value'}") from None


@task(name="build-image", cache_policy=NO_CACHE)
def build_image(request: ImageRequest) -> ImageResult:
    """Return the training image for ``request``, building and pushing it only if the registry
    lacks its content-hash tag. Build and push output goes to the task log."""
    logger = get_run_logger()
    credentials = registry_credentials(request.registry_secret_block)
    result = build_and_push(request.spec(), credentials, on_log=logger.info)
    logger.info("image %s (%s), %s", result.ref, result.digest,
                "built and pushed" if result.built else "unchanged: not rebuilt")
    return result


def prefect_build_step(**fields) -> dict[str, str]:
    """A prefect.yaml build step: the same build as the ``build-image`` flow.

    Takes the fields of ``ImageRequest`` as keyword arguments (from prefect.yaml).

    Returns:
        ``image`` (``registry/repository:tag``), ``image_name``, ``tag`` (content hash),
        ``digest`` and ``pinned_image`` (``registry/repository@digest``), for templates such as
        ``{{ build-training-image.pinned_image }}``.

    Raises:
        stoker.config.ConfigError: an unknown or invalid field (named).
        stoker.images.build.ImageError: see ``build_and_push``.
    """
    request = validate(ImageRequest, fields, prefix="build step: ")
    result = build_and_push(request.spec(), registry_credentials(request.registry_secret_block),
                            on_log=print)
    return {"image": result.ref, "image_name": result.ref.rsplit(":", 1)[0], "tag": result.tag,
            "digest": result.digest, "pinned_image": result.pinned_ref}
