"""What ``stoker predict`` says before it answers: which model version answers, and whether the
images can be read by it at all (their channels, their class folders)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")


def answered_by(model_uri: str) -> str:
    """The model version behind ``model_uri`` as one line: name, version, alias and run.

    Args:
        model_uri: an MLflow model URI (``models:/name@alias``, ``models:/name/3``, ``runs:/..``).

    Returns:
        ``model: <name> version <v> (alias <a>), run <run id> (<uri>)``; for a URI that names no
        registered version, ``model: <uri>``.
    """
    from mlflow import MlflowClient

    match = MODELS_URI.match(model_uri)
    if match is None:
        return f"model: {model_uri}"
    client = MlflowClient()
    name, alias = match["name"], match["alias"]
    try:
        version = (client.get_model_version_by_alias(name, alias) if alias
                   else client.get_model_version(name, match["version"]))
    except Exception:  # noqa: BLE001 - only what is said; loading the model already worked
        return f"model: {model_uri}"
    aliases = sorted(set(version.aliases or []) | ({alias} if alias else set()))
    named = f" (alias {', '.join(aliases)})" if aliases else ""
    return f"model: {name} version {version.version}{named}, run {version.run_id} ({model_uri})"


# The most pixels (width x height) an image may have to be decoded: Pillow's own warning
# threshold (PIL.Image.MAX_IMAGE_PIXELS, about 89 M: 1 GiB of RGBA / 4 / 3). Checked from the
# file's header, before its pixels are decoded (a 12000x12000 PNG took 24 s and 1.5 GB).
MAX_IMAGE_PIXELS = 89_478_485


class UnusableImage(ValueError):
    """An image that is refused before decoding (the message names it)."""


def image_header(source, name: str) -> str:
    """The Pillow mode of an image file, read from its header; its pixels are not decoded.

    Args:
        source: a path or a binary file object of an encoded image.
        name: the image, for the message (its path, or ``image row N``).

    Returns:
        The mode (``L``, ``I;16``, ``RGB``, ``P``, ...).

    Raises:
        UnusableImage: not an image Pillow can open, or over ``MAX_IMAGE_PIXELS`` pixels.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # refused below, with the size: no Pillow warning
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(source) as image:
                mode, (width, height) = image.mode, image.size
    except Image.DecompressionBombError as e:  # over twice Pillow's threshold: no size kept
        pixels = re.search(r"\((\d+) pixels\)", str(e))
        size = f"{int(pixels[1]):,} pixels" if pixels else "too many pixels"
        raise UnusableImage(f"{name}: {size}, over the limit of {MAX_IMAGE_PIXELS:,} pixels "
                            "(too large to decode safely)") from e
    except (UnidentifiedImageError, OSError) as e:
        raise UnusableImage(f"{name}: not a readable image "
                            f"({str(e).splitlines()[0][:200]})") from e
    if width * height > MAX_IMAGE_PIXELS:
        raise UnusableImage(f"{name}: {width}x{height} = {width * height:,} pixels, over the "
                            f"limit of {MAX_IMAGE_PIXELS:,} pixels (too large to decode safely)")
    return mode


def channel_mismatch(mode: str, channels: int, model: str) -> str | None:
    """Why an image of Pillow mode ``mode`` does not fit a model of ``channels``, or None.

    Args:
        mode: the image's mode as opened (``L``, ``I;16``, ``RGB``, ``P``, ...).
        channels: the model's input channels (1 or 3).
        model: the model, for the message.

    Returns:
        ``a colour (3 channels) image, but <model> takes 1 channel (gray)`` or the converse.
    """
    from stoker.runtime.listing import GRAY_MODES

    colour = mode not in GRAY_MODES
    if colour == (channels == 3):
        return None
    has = "colour (3 channels)" if colour else "gray (1 channel)"
    wants = "3 channels" if channels == 3 else "1 channel (gray)"
    return f"a {has} image, but {model} takes {wants}"


def image_modes(images: list[Path]) -> dict[Path, str]:
    """Each image's Pillow mode, from its header (no model needed: read before one loads).

    Raises:
        UnusableImage: the first image Pillow cannot open, or one over ``MAX_IMAGE_PIXELS``.
    """
    return {path: image_header(path, str(path)) for path in images}


def mismatch(images: list[Path], folders: list[Path], meta: dict, model_uri: str,
             modes: dict[Path, str] | None = None) -> str | None:
    """Why these images do not fit the model (one line naming the first that does not), or None.

    Args:
        images: the image files to predict.
        folders: the folders the user gave (their class subfolders are compared with the
            model's classes).
        meta: the model's ``stoker`` metadata (``preprocessing.channels``, ``classes``).
        model_uri: the model, for the message.
        modes: the images' modes when :func:`image_modes` read them already.

    Returns:
        The reason (an unreadable image, one over ``MAX_IMAGE_PIXELS``, or one ending with a
        ``--model-uri`` suggestion); None when they fit.
    """
    channels = int(meta["preprocessing"]["channels"])
    hint = "; choose a model trained on such images with --model-uri"
    for path in images:
        try:
            mode = modes[path] if modes and path in modes else image_header(path, str(path))
        except UnusableImage as e:
            return str(e)
        if wrong := channel_mismatch(mode, channels, model_uri):
            return f"{path}: {wrong}{hint}"
    classes = set(meta.get("classes") or [])
    for folder in folders:
        subfolders = sorted(p.name for p in folder.iterdir()  # those holding files: classes
                            if p.is_dir() and not p.name.startswith(".")
                            and any(f.is_file() for f in p.iterdir()))
        unknown = [name for name in subfolders if name not in classes]
        if subfolders and len(unknown) == len(subfolders):
            return (f"{folder}: class folders {', '.join(unknown[:5])} are none of the classes "
                    f"of {model_uri} ({', '.join(sorted(classes)[:10])}){hint}")
    return None
