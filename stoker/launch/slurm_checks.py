"""Checks of the ``launcher.slurm`` fields against the cluster, before anything is submitted:
the partition exists, it has the nodes asked, and ``sbatch --test-only`` takes the job."""

from __future__ import annotations

from stoker.config import ConfigError, SlurmLauncherConfig
from stoker.launch.slurm import SlurmError, parse_fields, resource_args, slurm


def check_slurm_config(slurm_config: SlurmLauncherConfig) -> None:
    """Check the partition and node count against the cluster, before anything is submitted.

    Raises:
        ConfigError: naming ``launcher.slurm.partition`` (not on the cluster, or none is the
            default) or ``launcher.slurm.nodes`` (more than the partition has), or Slurm does
            not answer (``launcher.kind``).
    """
    try:
        lines = [parse_fields(line) for line in
                 slurm("scontrol", "-o", "show", "partition").splitlines() if line.strip()]
    except SlurmError as e:
        raise ConfigError(f"launcher.kind=slurm: the cluster does not answer ({e})") from None
    partitions = {p.get("PartitionName"): p for p in lines}
    name = slurm_config.partition
    if name is None:
        default = [p for p in lines if p.get("Default") == "YES"]
        if not default:
            raise ConfigError("launcher.slurm.partition: empty, and the cluster has no default "
                              f"partition (it has: {', '.join(sorted(partitions))})")
        partition = default[0]
    elif name not in partitions:
        raise ConfigError(f"launcher.slurm.partition: {name!r} is not a partition of the "
                          f"cluster (it has: {', '.join(sorted(partitions))})")
    else:
        partition = partitions[name]
    total = int(partition.get("TotalNodes", "0") or 0)
    if slurm_config.nodes > total:
        raise ConfigError(f"launcher.slurm.nodes: {slurm_config.nodes} nodes asked, partition "
                          f"{partition.get('PartitionName')} has {total}")
    test_only(slurm_config)


def test_only(config: SlurmLauncherConfig) -> None:
    """Ask Slurm whether it would take the job (``sbatch --test-only``; nothing is submitted).

    Raises:
        ConfigError: naming ``launcher.slurm`` and the fields given, with Slurm's reason (GPUs
            the nodes lack, an account or QoS the cluster refuses).
    """
    try:
        slurm("sbatch", "--test-only", *resource_args(config), "--wrap", "true")
    except SlurmError as e:
        given = ", ".join(f"{k}={v}" for k, v in config.model_dump(exclude_defaults=True).items())
        reason = str(e).removeprefix("sbatch --test-only: ").replace("sbatch: error: ", "")
        raise ConfigError(f"launcher.slurm ({given or 'defaults'}): Slurm refuses the job: "
                          f"{reason}") from None
