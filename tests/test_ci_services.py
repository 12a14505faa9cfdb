"""The CI's service scripts start from what an earlier machine left in /tmp.

A machine can start from a copy of another's disk, or after a reboot: pid files and sockets under
``/tmp/stoker-slurm`` then name processes that are gone, and their numbers are soon other
programs'. ``.ci/start-slurm.sh`` must bring a working cluster up anyway, or every Slurm test
waits on nodes that never come up.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from image_support import skip_or_fail

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
START = ROOT / ".ci" / "start-slurm.sh"


def _needs_slurm() -> None:
    if os.geteuid() != 0:
        skip_or_fail("starting munged and slurmd needs root")
    if not (shutil.which("munged") and shutil.which("slurmctld")):
        skip_or_fail("Slurm and munge are not installed (.ci/start-slurm.sh installs them)")


def test_stale_pid_files_and_a_dead_socket_do_not_stop_the_cluster_from_starting(tmp_path):
    _needs_slurm()
    folder = tmp_path / "slurm"
    env = {**os.environ, "STOKER_SLURM_DIR": str(folder), "STOKER_SLURM_PORT": "17817"}
    env.pop("SLURM_CONF", None)
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        # What the last machine left: pid files whose numbers are another live program's now,
        # and munged's socket with no munged behind it.
        (folder / "run").mkdir(parents=True)
        for daemon in ("munged", "slurmctld", "slurmd-n1", "slurmd-n2"):
            (folder / "run" / f"{daemon}.pid").write_text(f"{stand_in.pid}\n")
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(str(folder / "munge.socket"))
        dead.close()

        started = subprocess.run(["bash", str(START)], env=env, capture_output=True, text=True,
                                 timeout=90)
        assert started.returncode == 0, started.stderr[-2000:]
        conf = folder / "slurm.conf"
        assert started.stdout.strip() == f"export SLURM_CONF={conf}"
        up = subprocess.run(["sinfo", "-h", "-p", "low", "-t", "idle,mix,alloc", "-o", "%D"],
                            env={**env, "SLURM_CONF": str(conf)}, capture_output=True, text=True,
                            timeout=30)
        assert up.stdout.split() == ["2"], up.stdout + up.stderr
        assert stand_in.poll() is None, "the script killed a process that was not its daemon"
    finally:
        subprocess.run(["bash", str(START), "stop"], env=env, timeout=60)
        stand_in.kill()
        stand_in.wait()
    assert stand_in.returncode == -9  # ours, not the stop's
