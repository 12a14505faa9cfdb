"""Benchmark: the "unchanged image" decision versus a fully cached ``docker build``.

Both start from the same inputs. The decision is ``build_and_push`` on an image the registry
already holds (content hash, one registry question through the daemon, no build). The baseline
is a build of the same context through the Engine API with every step cached (what a CI job
that always runs ``docker build`` pays at best). The two alternate, several repetitions each;
medians are printed, then the ratio, last. Target: decision <= 1 s and no build.

Run from the repository root (needs the Docker Engine and the registry of .ci/start-services.sh):

    python benchmarks/bench_image_decision.py [--repetitions 7]

The first run makes the stand-in Debian base (debootstrap, 1-3 min), fills a wheelhouse and builds
the image once (a few minutes); later runs reuse all three.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import docker
import docker.errors
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stoker.images.base import ensure_debian_base  # noqa: E402
from stoker.images.build import build, build_and_push, build_labels, connect  # noqa: E402
from stoker.images.spec import ImageSpec, content_hash, load_matrix  # noqa: E402
from stoker.images.wheelhouse import fill_wheelhouse  # noqa: E402

ENTRY = "cpu-py311"
BASE = "stoker-test/base:bookworm"
REPOSITORY = "stoker-bench/train"
BASELINE_TAG = "stoker-bench/cached-build:latest"


def torch_wheel(version: str) -> Path:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in os.environ.get("PIP_FIND_LINKS", "").split() + ["/opt/wheels"]:
        path = Path(folder.removeprefix("file://"))
        found = sorted(path.glob(f"torch-{version}+cpu-{tag}-{tag}-*.whl")) if path.is_dir() else []
        if found:
            return found[-1]
    sys.exit(f"no local CPU wheel of torch {version} for {tag} in PIP_FIND_LINKS or /opt/wheels")


def prepare(registry: str, wheelhouse: Path) -> ImageSpec:
    client = docker.from_env(timeout=600)
    ensure_debian_base(client, BASE)
    client.close()
    entry = load_matrix().entry(ENTRY)
    wheel = torch_wheel(entry.torch)
    lock = ROOT / "images/requirements-runtime.txt"
    key = hashlib.sha256(lock.read_bytes() + wheel.name.encode()).hexdigest()[:16]
    marker = wheelhouse / f".filled-{key}"
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
        sys.exit("the decision built an image: the benchmark's image was not in the registry")
    return elapsed


def time_cached_build(spec: ImageSpec, labels: dict[str, str]) -> tuple[float, int, int]:
    """Seconds for a build of the same context; also (steps, steps that ran a container)."""
    lines: list[str] = []
    api = connect()
    started = time.perf_counter()
    build(api, spec, BASELINE_TAG, labels, lines.append)
    elapsed = time.perf_counter() - started
    api.close()
    steps = sum(line.startswith("Step ") for line in lines)
    executed = sum("---> Running in" in line for line in lines)
    return elapsed, steps, executed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--registry", default="127.0.0.1:5000")
    parser.add_argument("--wheelhouse", type=Path, default=ROOT / "benchmarks/out/wheelhouse")
    args = parser.parse_args()

    spec = prepare(args.registry, args.wheelhouse)
    first = build_and_push(spec, on_log=lambda line: None)  # make sure the registry holds it
    print(f"image {first.ref} ({'built now' if first.built else 'already pushed'})")
    labels = build_labels(spec, content_hash(spec))  # fixed labels: every step can be cached
    time_cached_build(spec, labels)  # warm-up: creates the label layers once

    decisions, builds = [], []
    steps = executed = 0
    try:
        for _ in range(args.repetitions):
            decisions.append(time_decision(spec))
            elapsed, steps, executed = time_cached_build(spec, labels)
            builds.append(elapsed)
    finally:
        client = docker.from_env()
        for tag in (BASELINE_TAG, first.ref):  # untag only: the layers stay cached
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.remove(tag)
        client.close()
        _delete_repository(args.registry, REPOSITORY)

    decision_s, build_s = statistics.median(decisions), statistics.median(builds)
    print(f"repetitions: {args.repetitions} (alternating)")
    print(f"cached docker build: median {build_s:.3f} s ({steps} steps, {executed} executed; "
          f"runs {', '.join(f'{s:.2f}' for s in builds)})")
    print(f"unchanged-image decision: median {decision_s:.3f} s, no build "
          f"(target <= 1 s: {'met' if decision_s <= 1.0 else 'MISSED'}; "
          f"runs {', '.join(f'{s:.3f}' for s in decisions)})")
    print(f"ratio decision / cached build: {decision_s / build_s:.4f}")


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
