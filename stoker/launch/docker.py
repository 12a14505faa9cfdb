"""Run the training image through the Docker Engine API: one container per node.

Each container runs the image's entrypoint (``python -m stoker.runtime.launch``: torchrun with
Stoker's exit codes) on the host network and IPC namespace (what NCCL wants), with NVIDIA GPUs
through a device request, a large ``/dev/shm``, the dataset mounted read-only and the job folder
read-write at the same paths as on the host (so the run spec's paths hold inside), and labels
that mark it as Stoker's (the cost guard acts only on those). Several nodes on one host
rendezvous on 127.0.0.1 (node 0 hosts the store); on several hosts, point ``rdzv_endpoint``
at node 0.

Before any container that asks for GPUs is created, the CUDA preflight compares the image's
``io.stoker.cuda-version`` label (read from the engine; the image is pulled first if absent) with
the host driver's CUDA version, whatever the image's source (built by the flow or given). A
container that fails to start is removed.

``docker stop`` sends SIGTERM to the entrypoint, which passes it to the workers: they commit a
checkpoint and the container exits 75, which the retry policy resumes.

One trainer per job: before starting, the launcher looks for running containers labelled with
the same job (an orphan of an orchestrator that died). Such a container stops by itself once it
sees the job lease taken over (it commits and exits 75); the launcher waits up to
``orphan_wait_s`` for that, and otherwise refuses, naming the container and how to stop it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stoker.images.preflight import HostCuda, image_cuda_version, preflight_cuda
from stoker.ownership import DOCKER_JOB_LABEL, DOCKER_OWNER_LABEL
from stoker.runtime import EXIT_PREEMPTED
from stoker.runtime.spec import RunSpec
from stoker.stopping import interrupted


def _gpu_hint(error: Exception, gpus: str | int) -> str:
    """What to do when the engine has no GPU runtime for ``gpus`` (Docker's own message,
    ``could not select device driver "" with capabilities: [[gpu]]``, names neither)."""
    if "could not select device driver" in str(error) and str(gpus) not in ("0", "none"):
        return (f"; launcher.docker.gpus={gpus}: this Docker Engine has no GPU runtime (NVIDIA "
                "Container Toolkit); on a CPU host set launcher.docker.gpus=0")
    return ""


class DockerLaunchError(RuntimeError):
    """The Docker Engine is unreachable or refused to start a container (named in the message)."""


class JobContainersRunning(DockerLaunchError):
    """Containers of the same job, started by an earlier run, are still running."""


@dataclass
class DockerLauncher:
    """Launch one attempt as ``nnodes`` containers of ``image``.

    Attributes:
        image: image reference (ideally by digest, as the build flow returns it).
        nproc_per_node: worker processes per container (one per GPU on GPU hosts).
        nnodes: containers (nodes) in the job; all on this Docker host.
        gpus: GPUs per container: "all", a count, or 0 for CPU-only runs.
        shm_size: /dev/shm size (DataLoader workers and NCCL need more than Docker's 64 MB).
        user: ``uid:gid`` the container runs as; default the calling user, so files written to
            the mounted job folder belong to them (the image's own default user is non-root).
        shutdown_grace_s: seconds workers get to checkpoint after SIGTERM (torchrun
            ``--shutdown-timeout``); ``docker stop`` waits 15 s longer before SIGKILL.
        rdzv_endpoint: ``host:port`` of the c10d rendezvous (node 0's host).
        extra_mounts: further host paths to mount at the same path (e.g. a sqlite MLflow store).
        environment: extra environment variables for the containers.
        docker_host: Docker Engine URL; None uses DOCKER_HOST or the local socket.
        nvml: NVML module for the GPU preflight; None: ``pynvml`` (imported when GPUs are asked).
        orphan_wait_s: how long to wait for running containers of the same job to exit
            before refusing to start.
    """

    image: str
    nproc_per_node: int = 1
    nnodes: int = 1
    gpus: str | int = "all"
    shm_size: str = "16g"
    user: str | None = None
    shutdown_grace_s: float = 25.0
    rdzv_endpoint: str = "127.0.0.1:29400"
    extra_mounts: list[str] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    docker_host: str | None = None
    nvml: Any = None
    orphan_wait_s: float = 60.0
    containers: list = field(default_factory=list, init=False)

    def client(self):
        import docker

        try:
            client = docker.DockerClient(base_url=self.docker_host) if self.docker_host \
                else docker.from_env()
            client.ping()
        except Exception as e:  # docker raises several types for "no daemon"
            where = self.docker_host or os.environ.get("DOCKER_HOST", "the local socket")
            raise DockerLaunchError(f"Docker Engine at {where} unreachable: {e}") from None
        return client

    def command(self, spec_path: Path, node_rank: int, rdzv_id: str) -> list[str]:
        """Arguments for the image's entrypoint (torchrun's CLI) on node ``node_rank``.

        One node: c10d rendezvous on a free loopback port. Several: static rendezvous, node 0
        hosts the store at ``rdzv_endpoint`` (c10d would have every container on the host
        network claim the store, as they all match 127.0.0.1).
        """
        if self.nnodes == 1:
            rendezvous = ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                          f"--rdzv-id={rdzv_id}", "--local-addr=127.0.0.1"]
        else:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            rendezvous = ["--rdzv-backend=static", f"--master-addr={host}",
                          f"--master-port={port}", f"--node-rank={node_rank}"]
        return [
            f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc_per_node}", *rendezvous,
            "--max-restarts=0", f"--shutdown-timeout={int(self.shutdown_grace_s)}",
            "-m", "stoker.runtime", str(spec_path),
        ]

    def _mounts(self, spec: RunSpec) -> list:
        from docker.types import Mount

        paths = {spec.job_dir: False, spec.data_dir: True}
        for extra in self.extra_mounts:
            paths.setdefault(extra, False)
        return [Mount(target=p, source=p, type="bind", read_only=ro) for p, ro in paths.items()]

    def _device_requests(self) -> list:
        from docker.types import DeviceRequest

        if self.gpus in (0, "0", None, "none"):
            return []
        count = -1 if self.gpus == "all" else int(self.gpus)
        return [DeviceRequest(count=count, capabilities=[["gpu"]])]

    def image_labels(self, client) -> dict[str, str]:
        """The image's labels from the engine, pulling the image first when it is absent.

        Raises:
            DockerLaunchError: the image cannot be found or pulled.
        """
        import docker.errors

        try:
            try:
                attrs = client.api.inspect_image(self.image)
            except docker.errors.ImageNotFound:
                client.images.pull(self.image)
                attrs = client.api.inspect_image(self.image)
        except docker.errors.DockerException as e:
            raise DockerLaunchError(f"image {self.image}: not on the engine and not pulled: "
                                    f"{e}") from e
        return (attrs.get("Config") or {}).get("Labels") or {}

    def preflight(self, labels: dict[str, str]) -> HostCuda | None:
        """Refuse an image whose CUDA the host driver cannot run, before a GPU container exists.

        Returns:
            The host's driver facts; None when no GPU is asked or the image records no CUDA.

        Raises:
            stoker.images.preflight.PreflightError: driver too old, no driver, or no GPU.
        """
        if not self._device_requests():
            return None
        nvml = self.nvml
        if nvml is None:
            import pynvml as nvml
        return preflight_cuda(image_cuda_version(labels), nvml)

    def running_for(self, client, job: str) -> list:
        """Running containers labelled with ``job`` (ours or an earlier run's)."""
        return client.containers.list(filters={"label": f"{DOCKER_JOB_LABEL}={job}",
                                               "status": "running"})

    def wait_for_orphans(self, client, job: str) -> None:
        """Wait up to ``orphan_wait_s`` for running containers of ``job`` to exit.

        Raises:
            JobContainersRunning: some still run (named, with the command that stops them).
        """
        deadline = time.monotonic() + self.orphan_wait_s
        running = self.running_for(client, job)
        while running and time.monotonic() < deadline:
            time.sleep(1.0)
            running = self.running_for(client, job)
        if running:
            names = " ".join(c.name for c in running)
            raise JobContainersRunning(
                f"job {job}: container(s) {names} of an earlier run still train it; stop them "
                f"with `docker stop -t {int(self.shutdown_grace_s) + 15} {names}` (they commit "
                "a checkpoint and exit 75; this run then resumes from it)")

    def start(self, spec_path: Path) -> list:
        """Start the containers of one attempt (detached) and return them.

        Raises:
            stoker.images.preflight.PreflightError: GPUs asked and the host cannot run the image.
            JobContainersRunning: an earlier run's containers of this job are still running.
            DockerLaunchError: the engine is unreachable or a container cannot start (every
                container of the attempt, including the one that failed, is removed).
        """
        spec = RunSpec.load(spec_path)
        client = self.client()
        self.preflight(self.image_labels(client))
        job = Path(spec.job_dir).name
        self.wait_for_orphans(client, job)
        rdzv_id = f"{job}-{uuid.uuid4().hex[:8]}"
        user = self.user or f"{os.getuid()}:{os.getgid()}"
        self.containers = []
        for node in range(self.nnodes):
            try:
                # create, then start: a container that cannot start is already ours to remove.
                self.containers.append(client.containers.create(
                    self.image, command=self.command(spec_path, node, rdzv_id), detach=True,
                    name=f"stoker-{job[:40]}-n{node}-{uuid.uuid4().hex[:6]}",
                    network_mode="host", ipc_mode="host", shm_size=self.shm_size, user=user,
                    mounts=self._mounts(spec), device_requests=self._device_requests(),
                    environment={"PYTHONUNBUFFERED": "1", **self.environment},
                    labels={DOCKER_OWNER_LABEL: "true", DOCKER_JOB_LABEL: job,
                            "dev.stoker.node_rank": str(node)},
                    stop_signal="SIGTERM",
                ))
                self.containers[-1].start()
            except Exception as e:
                self.stop(remove=True)
                raise DockerLaunchError(f"cannot start node {node} of job {job} from image "
                                        f"{self.image}: {e}{_gpu_hint(e, self.gpus)}") from e
        return self.containers

    def stop(self, remove: bool = False) -> None:
        """``docker stop`` every container (SIGTERM, SIGKILL after the grace), then remove."""
        timeout = int(self.shutdown_grace_s) + 15
        for container in self.containers:
            with contextlib.suppress(Exception):
                container.stop(timeout=timeout)
            if remove:
                with contextlib.suppress(Exception):
                    container.remove(force=True)

    def run(self, spec_path: Path, on_line: Callable[[str], None] = print,
            timeout_s: float | None = None) -> int:
        """Run one attempt to its end and return its exit code (Stoker's contract).

        The nodes' logs stream to ``on_line`` prefixed with ``[node N]``. The first node to fail
        decides the code (137 when Docker reports it OOM-killed); when every node ends with 0 or
        75, any 75 makes the attempt preempted. The containers are stopped (SIGTERM first) and
        removed whatever happens, including timeouts and exceptions in the caller.

        Raises:
            DockerLaunchError: the engine is unreachable or a container cannot start.
            TimeoutError: the attempt ran longer than ``timeout_s``.
        """
        containers = self.start(spec_path)
        readers = [threading.Thread(target=_stream, args=(c, n, on_line), daemon=True)
                   for n, c in enumerate(containers)]
        for reader in readers:
            reader.start()
        codes: dict[int, int] = {}
        try:
            for node, container in enumerate(containers):
                try:
                    result = container.wait(timeout=timeout_s)
                except Exception as e:  # requests' ReadTimeout on timeout
                    if "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower():
                        raise TimeoutError(f"attempt ran over {timeout_s} s") from None
                    raise
                container.reload()
                oom = container.attrs.get("State", {}).get("OOMKilled", False)
                codes[node] = 137 if oom else int(result.get("StatusCode", 1))
        except BaseException as e:
            interrupted(e)  # who stops the ranks is recorded before the containers are stopped
            raise
        finally:
            self.stop(remove=True)
            for reader in readers:
                reader.join(timeout=5)
        return combine_exit_codes(list(codes.values()))


def combine_exit_codes(codes: list[int]) -> int:
    """One attempt code from the nodes' codes (see ``DockerLauncher.run``)."""
    failed = [c for c in codes if c not in (0, EXIT_PREEMPTED)]
    if failed:
        return 137 if 137 in failed else failed[0]
    return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0


def _stream(container, node: int, on_line: Callable[[str], None]) -> None:
    with contextlib.suppress(Exception):
        buffer = b""
        for chunk in container.logs(stream=True, follow=True):
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                on_line(f"[node {node}] {line.decode(errors='replace')}")
