"""The real Slurm cluster the Slurm tests use (``.ci/start-slurm.sh``: partitions low and high
over 2 nodes)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from image_support import skip_or_fail

from stoker.launch.slurm import slurm

DEFAULT_CONF = Path(os.environ.get("STOKER_SLURM_DIR", "/tmp/stoker-slurm")) / "slurm.conf"


def require_cluster(partition: str) -> str:
    """Point ``SLURM_CONF`` at the cluster (already set, else ``DEFAULT_CONF``) and check that
    it answers with 2 nodes in ``partition``; skip (fail under CI) otherwise. Returns the
    ``SLURM_CONF`` path."""
    if "SLURM_CONF" not in os.environ and DEFAULT_CONF.exists():
        os.environ["SLURM_CONF"] = str(DEFAULT_CONF)
    if not shutil.which("sbatch"):
        skip_or_fail("Slurm's client commands are not installed (.ci/start-slurm.sh)")
    try:
        slurm("scontrol", "ping", timeout_s=10)
        nodes = slurm("sinfo", "-h", "-p", partition, "-o", "%D").split()
    except Exception as e:
        skip_or_fail(f"no Slurm answers ({e}); start one with .ci/start-slurm.sh")
    if not nodes or int(nodes[0]) < 2:
        skip_or_fail("the Slurm of .ci/start-slurm.sh (partitions low/high, 2 nodes) is not "
                     "the one answering")
    return os.environ["SLURM_CONF"]
