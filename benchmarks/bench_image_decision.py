"""Benchmark: the "unchanged image" decision versus a fully cached ``docker build``.

Both start from the same inputs. The decision is ``build_and_push`` on an image the registry
already holds (content hash, one registry question through the daemon, no build). The baseline
is a build of the same context through the Engine API with every step cached (what a CI job
that always runs ``docker build`` pays at best). They run in pairs, alternating, after a warm-up
pair; the ratio (decision / cached build) is per pair and informative. Target: the decision's
median <= 1 s (from its interval) and no build. The build runs in the Docker daemon, so the CPU
time beside each figure is this process's only (the client's side).

Run from the repository root (needs the Docker Engine and the registry of .ci/start-services.sh):

    python benchmarks/bench_image_decision.py [--quick] [--repeats 7]

The first full run makes the stand-in Debian base (debootstrap, 1-3 min), fills a wheelhouse and
builds the image once (a few minutes); later runs reuse all three. ``--quick`` (one pair) runs
only once they exist, and is skipped with the reason otherwise; so is any run without Docker.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import docker
import docker.errors
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    Target,
    alternate,
    check,
    compared,
    emit,
    log,
    options,
)
from stoker.images.base import ensure_debian_base  # noqa: E402
from stoker.images.build import build, build_and_push, build_labels, connect  # noqa: E402
from stoker.images.spec import ImageSpec, content_hash, load_matrix  # noqa: E402
from stoker.images.wheelhouse import fill_wheelhouse  # noqa: E402

ENTRY = "cpu-py311"
BASE = "stoker-test/base:bookworm"
REPOSITORY = "stoker-bench/train"
BASELINE_TAG = "stoker-bench/cached-build:latest"
DECISION_TARGET = Target("<=", 1.0)
METRIC = "unchanged-image decision time / cached docker build time (informative)"


class NotPrepared(Exception):
    """What the benchmark needs is missing (Docker, a torch wheel, a prepared wheelhouse)."""


def torch_wheel(version: str) -> Path:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in os.environ.get("PIP_FIND_LINKS", "").split() + ["/opt/wheels"]:
        path = Path(folder.removeprefix("file://"))
        found = sorted(path.glob(f"torch-{version}+cpu-{tag}-{tag}-*.whl")) if path.is_dir() else []
        if found:
            return found[-1]
    raise NotPrepared(f"no local CPU wheel of torch {version} for {tag} in PIP_FIND_LINKS or "
                      "/opt/wheels")


def prepare(registry: str, wheelhouse: Path, quick: bool) -> ImageSpec:
    """The image spec to decide on; makes the base and the wheelhouse unless ``quick``.

    Raises:
        NotPrepared: Docker is unreachable, no torch wheel, or (``quick``) nothing made yet.
    """
    try:
        client = docker.from_env(timeout=600)
        has_base = bool(client.images.list(name=BASE))
    except docker.errors.DockerException as e:
        raise NotPrepared(f"the Docker Engine is not reachable: {e}") from e
    if quick and not has_base:
        raise NotPrepared(f"{BASE} not made yet: run once without --quick (1-3 min)")
    ensure_debian_base(client, BASE)
    client.close()
    entry = load_matrix().entry(ENTRY)
    wheel = torch_wheel(entry.torch)
    lock = ROOT / "images/requirements-runtime.txt"
    key = hashlib.sha256(lock.read_bytes() + wheel.name.encode()).hexdigest()[:16]
    marker = wheelhouse / f".filled-{key}"
    if quick and not marker.exists():
        raise NotPrepared(f"{wheelhouse} not filled yet: run once without --quick")
    if not marker.exists():  # first run, or the lock changed: start from an empty folder
        shutil.rmtree(wheelhouse, ignore_errors=True)
        fill_wheelhouse(wheelhouse, entry.model_copy(update={"torch_index_url": None}),
                        torch=str(wheel), on_log=lambda line: None)
        marker.touch()
    return ImageSpec.from_matrix(ENTRY, base_image=BASE, registry=registry,
                                 repository=REPOSITORY, pip_install_from="wheelhouse",
                                 wheelhouse=wheelhouse)


def time_decision(spec: ImageSpec) -> float:
    started = time.perf_counter()
    result = build_and_push(spec, on_log=lambda line: None)
    elapsed = time.perf_counter() - started
    if result.built:
        raise RuntimeError("the decision built an image: the benchmark's image was not in the "
                           "registry")
    return elapsed


def time_cached_build(spec: ImageSpec, labels: dict[str, str],
                      counts: list[tuple[int, int]]) -> float:
    """Seconds for a build of the same context; appends (steps, steps that ran a container)."""
    lines: list[str] = []
    api = connect()
    started = time.perf_counter()
    build(api, spec, BASELINE_TAG, labels, lines.append)
    elapsed = time.perf_counter() - started
    api.close()
    counts.append((sum(line.startswith("Step ") for line in lines),
                   sum("---> Running in" in line for line in lines)))
    return elapsed


def main() -> None:
    args = options(__doc__, 7, extra=lambda p: (
        p.add_argument("--registry", default="127.0.0.1:5000"),
        p.add_argument("--wheelhouse", type=Path, default=ROOT / "benchmarks/out/wheelhouse")))
    try:
        spec = prepare(args.registry, args.wheelhouse, args.quick)
    except NotPrepared as e:
        emit("image_decision", metric=METRIC, quick=args.quick, status="skipped",
             reason=str(e))
        return
    first = build_and_push(spec, on_log=lambda line: None)  # make sure the registry holds it
    log(f"image {first.ref} ({'built now' if first.built else 'already pushed'})")
    labels = build_labels(spec, content_hash(spec))  # fixed labels: every step can be cached
    counts: list[tuple[int, int]] = []
    try:  # the warm-up pair creates the label layers once
        pairs = alternate(lambda i: time_cached_build(spec, labels, counts),
                          lambda i: time_decision(spec), args.repeats, max(1, args.warmups))
    finally:
        client = docker.from_env()
        for tag in (BASELINE_TAG, first.ref):  # untag only: the layers stay cached
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.remove(tag)
        client.close()
        _delete_repository(args.registry, REPOSITORY)

    steps, executed = counts[-1]
    emit("image_decision", metric=METRIC, quick=args.quick,
         **compared(pairs, lambda b, c: c / b, "decision <= 1 s (median) and no build",
                    f"cached docker build ({steps} steps, {executed} executed)",
                    "unchanged-image decision (no build)", "s"),
         checks=[check("decision time", pairs.values("candidate"), "s", DECISION_TARGET)],
         notes=[f"image {first.ref}; the cached build ran {steps} steps, {executed} of them "
                "in a container (0: every step cached)",
                "CPU time is this process's: the build itself runs in the Docker daemon"])


def _delete_repository(registry: str, repository: str) -> None:
    accept = ("application/vnd.docker.distribution.manifest.v2+json, "
              "application/vnd.oci.image.manifest.v1+json")
    tags = httpx.get(f"http://{registry}/v2/{repository}/tags/list", timeout=10)
    for tag in (tags.json().get("tags") or []) if tags.status_code == 200 else []:
        head = httpx.head(f"http://{registry}/v2/{repository}/manifests/{tag}",
                          headers={"Accept": accept}, timeout=10)
        if head.status_code == 200:
            digest = head.headers["Docker-Content-Digest"]
            httpx.delete(f"http://{registry}/v2/{repository}/manifests/{digest}", timeout=10)


if __name__ == "__main__":
    main()
