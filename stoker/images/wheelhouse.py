"""Fill a wheelhouse for offline image builds: every wheel the training image installs.

Builds whose containers reach no package index (air-gapped hosts, or a proxy whose CA only the
host trusts) install from a folder of wheels instead: ``ImageSpec(pip_install_from="wheelhouse",
wheelhouse=...)`` copies it into the build and runs ``pip install --no-index --find-links``.
``fill_wheelhouse`` makes that folder on a host that does reach the indexes, with ``pip download``
for the image's Python version and platform.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from stoker.images.spec import IMAGES_DIR, SOURCE_ROOT, MatrixEntry

LOCK_FILE = f"{IMAGES_DIR}/requirements-runtime.txt"
# Platform tags of the images (glibc >= 2.28 on x86-64: Ubuntu 22.04/24.04, Debian 12).
LINUX_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                   "linux_x86_64")


class WheelhouseError(RuntimeError):
    """pip download failed; the message holds pip's last output lines."""


def download_command(dest: Path, entry: MatrixEntry, lock: Path, torch: str | None = None,
                     python: str = sys.executable) -> list[str]:
    """The ``pip download`` command line that fills ``dest`` for ``entry``.

    Args:
        dest: wheelhouse folder.
        entry: matrix entry; its Python version, torch version and torch index are used.
        lock: the runtime lock (images/requirements-runtime.txt).
        torch: torch requirement or a local wheel file; None: ``torch==<entry.torch>``.
        python: interpreter whose pip runs the download.
    """
    command = [python, "-m", "pip", "download", "--disable-pip-version-check", "--dest",
               str(dest), "--only-binary=:all:", "-r", str(lock), torch or f"torch=={entry.torch}"]
    if entry.torch_index_url:
        command += ["--extra-index-url", entry.torch_index_url]
    host = f"{sys.version_info.major}.{sys.version_info.minor}"
    if entry.python != host or not sys.platform.startswith("linux"):
        command += ["--python-version", entry.python, "--implementation", "cp"]
        for platform in LINUX_PLATFORMS:
            command += ["--platform", platform]
    return command


def fill_wheelhouse(dest: Path, entry: MatrixEntry, lock: Path | None = None,
                    torch: str | None = None, on_log: Callable[[str], None] = print,
                    timeout_s: float = 3600.0) -> list[Path]:
    """Download torch and the locked runtime dependencies for ``entry`` into ``dest``.

    Wheels already in ``dest`` are kept (pip skips what is there), so refilling is cheap.

    Args:
        dest: wheelhouse folder (created if missing).
        entry: matrix entry the image is built from.
        lock: runtime lock; None: images/requirements-runtime.txt of this checkout.
        torch: torch requirement or local wheel path (e.g. a CPU wheel); None: the entry's.
        on_log: receives pip's output lines.
        timeout_s: limit for pip, in seconds.

    Returns:
        The wheel files in ``dest``, sorted.

    Raises:
        WheelhouseError: pip failed (a package has no wheel for the platform, no index
            answered, ...), with pip's last lines.
    """
    dest.mkdir(parents=True, exist_ok=True)
    command = download_command(dest, entry, lock or SOURCE_ROOT / LOCK_FILE, torch)
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    for line in done.stdout.splitlines():
        on_log(line)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise WheelhouseError(f"pip download into {dest} failed (exit {done.returncode}):\n{tail}")
    return sorted(dest.glob("*.whl"))
