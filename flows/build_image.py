"""Build the training image for a matrix entry, unless the registry already holds it."""

from __future__ import annotations

from prefect import flow

from stoker.images.spec import ImageRequest
from tasks.images import build_image
from tasks.stopping import untagged_task_runs

DEFAULT_REQUEST = ImageRequest()


@flow(name="build-image", log_prints=True)
def build_image_flow(request: ImageRequest = DEFAULT_REQUEST) -> dict:
    """Content-addressed build: returns image, digest and whether anything was built."""
    with untagged_task_runs():
        image = build_image(request)
    return image.to_dict()
