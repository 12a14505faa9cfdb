"""Build-time check of the training image: versions match the build arguments, the runtime imports.

Run by the Dockerfile as the last build step; exits non-zero with a message naming the mismatch.
"""

import os
import platform
import sys


def main() -> int:
    import torch

    want_python = os.environ["STOKER_PYTHON_VERSION"]
    want_torch = os.environ["STOKER_TORCH_VERSION"]
    want_cuda = os.environ["STOKER_CUDA_VERSION"]
    have_python = ".".join(platform.python_version_tuple()[:2])
    have_torch = torch.__version__.split("+")[0]
    have_cuda = torch.version.cuda or "none"
    errors = []
    if have_python != want_python:
        errors.append(f"python is {have_python}, the matrix entry says {want_python}")
    if have_torch != want_torch:
        errors.append(f"torch is {torch.__version__}, the matrix entry says {want_torch}")
    if have_cuda != want_cuda:
        errors.append(f"torch is built for CUDA {have_cuda}, the matrix entry says {want_cuda}")
    # Imports every runtime module, so a dependency missing from the lock fails the build here.
    import stoker.runtime.launch  # noqa: F401
    import stoker.runtime.trainer  # noqa: F401

    for error in errors:
        print(f"verify_image: {error}", file=sys.stderr)
    if not errors:
        print(f"verify_image: python {have_python}, torch {torch.__version__}, cuda {have_cuda}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
