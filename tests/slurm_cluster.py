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
        # Nodes that can run a job now: a node that is down (its slurmd gone, or munged not
        # answering) would leave every job pending until each test's own timeout.
        nodes = slurm("sinfo", "-h", "-p", partition, "-t", "idle,mix,alloc,comp",
                      "-o", "%D").split()
        states = slurm("sinfo", "-h", "-p", partition, "-o", "%D %T").strip()
    except Exception as e:
        skip_or_fail(f"no Slurm answers ({e}); start one with .ci/start-slurm.sh")
    if not nodes or int(nodes[0]) < 2:
        skip_or_fail(f"the Slurm answering has not 2 nodes up in partition {partition!r} "
                     f"(nodes by state: {states or 'none'}); .ci/start-slurm.sh starts one")
    return os.environ["SLURM_CONF"]
