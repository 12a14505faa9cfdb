"""The built-in models that need torchvision (the ``vision`` extra), and whether it can be imported
here. Imports torch only when one of those models is asked about: the orchestrator checks the
model before anything starts, and a model without torchvision needs no torch import for that.
"""

from __future__ import annotations

VISION_MODELS = ("resnet18", "resnet34", "resnet50")  # built on torchvision: the vision extra


def vision_problem(name: str) -> str | None:
    """Why the built-in model ``name`` cannot be built in this environment, in one line; None
    when it can (or needs no torchvision).

    torchvision is an optional extra (``pip install 'stoker[vision]'``): a build made for
    another torch fails at import ("operator torchvision::nms does not exist"), not only a
    missing one, so the import itself is tried.
    """
    if name not in VISION_MODELS:
        return None
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError, OSError) as e:  # absent, or built for another torch
        from importlib.metadata import version

        reason = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        return (f"train.model {name!r} needs torchvision, which cannot be imported here "
                f"({reason}); install the vision extra: pip install 'stoker[vision]' (a "
                f"torchvision build matching torch {version('torch')})")
    return None
