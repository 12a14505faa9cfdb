"""The build-image flow and the prefect.yaml build step under a real Prefect server.

Both must compute the same content-hash tag; the flow streams the build into the Prefect log;
registry credentials come from a Prefect Secret block and are never logged.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from image_support import (
    ENTRY,
    REGISTRY,
    delete_repository,
    docker_client,
    ensure_standin_base,
    ensure_wheelhouse,
    extra_registry,
    require_registry,
)
from local_servers import embedded_env, stop_local_servers

from stoker.images.build import RegistryCredentialsMissingError, connect, registry_digest
from stoker.images.spec import SOURCE_ROOT, ImageRequest, content_hash, image_ref

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]
SESSION = uuid.uuid4().hex[:10]


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="module")
def request_fields(request) -> dict:
    engine = docker_client()
    require_registry()
    wheelhouse = ensure_wheelhouse(request.config.cache.mkdir("stoker-image-wheelhouse"), ENTRY)
    fields = {"matrix_entry": ENTRY, "base_image": ensure_standin_base(engine),
              "registry": REGISTRY, "repository": f"stoker-test/flow-{SESSION}",
              "pip_install_from": "wheelhouse", "wheelhouse": str(wheelhouse)}
    yield fields
    delete_repository(REGISTRY, fields["repository"])
    name = f"{REGISTRY}/{fields['repository']}"
    for image in engine.images.list(name=name):
        for tag in image.tags:
            if tag.startswith(f"{name}:"):
                engine.images.remove(tag)  # untag only: never another session's image
    engine.close()


def test_flow_streams_the_build_to_the_prefect_log_and_the_yaml_step_agrees(
        harness, request_fields, monkeypatch, capsys):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.deployments.steps.core import run_steps
    from prefect.logging.handlers import APILogHandler

    from flows.build_image import build_image_flow

    request = ImageRequest(**request_fields)
    state = build_image_flow(request, return_state=True)
    result = state.result()
    spec = request.spec()
    assert result["built"] and result["ref"] == image_ref(spec, content_hash(spec))
    APILogHandler().flush()  # logs travel in batches: send what is queued before reading
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(
            flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    messages = [log.message for log in logs]
    assert any(m.startswith("Step 1/") for m in messages)
    assert any(m.startswith(f"pushed {result['ref']}") for m in messages)

    # The prefect.yaml snippet, run by Prefect's own step runner with the same inputs.
    steps = yaml.safe_load((SOURCE_ROOT / "images/prefect-build-step.yaml").read_text())["build"]
    step_fields = steps[0]["tasks.images.prefect_build_step"]
    step_fields.update({k: v for k, v in request_fields.items()
                        if k not in ("matrix_entry", "registry")})
    monkeypatch.setenv("STOKER_REGISTRY", REGISTRY)
    monkeypatch.setenv("STOKER_IMAGE_MATRIX_ENTRY", ENTRY)
    capsys.readouterr()
    outputs = asyncio.run(run_steps(steps))["build-training-image"]
    assert outputs["image"] == result["ref"] and outputs["digest"] == result["digest"]
    assert outputs["tag"] == result["tag"]
    assert outputs["pinned_image"] == result["pinned_ref"]
    assert "nothing to build" in capsys.readouterr().out  # the step found the flow's image


def test_registry_credentials_from_a_secret_block(harness, request_fields, tmp_path, caplog):
    import bcrypt
    from prefect.blocks.system import Secret

    from tasks.images import registry_credentials

    password = f"pw-{uuid.uuid4().hex}"
    line = "ci:" + bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    Secret(value={"username": "ci", "password": password}).save(f"reg-{SESSION}")
    Secret(value={"username": "ci"}).save(f"half-{SESSION}")
    credentials = registry_credentials(f"reg-{SESSION}")
    assert credentials.username == "ci" and password not in repr(credentials)
    with pytest.raises(RegistryCredentialsMissingError, match=f"half-{SESSION}.*password"):
        registry_credentials(f"half-{SESSION}")
    with extra_registry(Path(tmp_path) / "auth", htpasswd=line) as registry:
        request = ImageRequest(**{**request_fields, "registry": registry,
                                  "registry_secret_block": f"reg-{SESSION}"})
        spec = request.spec()
        api = connect()
        # Accepted: the registry answers "no such tag" rather than "unauthorized".
        assert registry_digest(api, image_ref(spec, content_hash(spec)), credentials) is None
        api.close()
    assert password not in caplog.text


def stoker(*args: str, work: Path) -> subprocess.CompletedProcess:
    """``stoker`` in a subprocess on its own local Prefect server under ``work``."""
    return subprocess.run([sys.executable, "-m", "stoker.cli", *args, "--work-dir", str(work)],
                          capture_output=True, text=True, timeout=600, env=embedded_env(work))


def test_the_cli_finds_the_built_image_and_names_a_dead_registry(request_fields, tmp_path):
    """`stoker build-image` runs the flow on the local Prefect server: an image already in the
    registry is answered from it; a registry that does not answer is one line, exit 2, and the
    flow run is on the server as Failed."""
    from stoker.images.build import build_and_push

    work = tmp_path / "work"
    fields = [f"{k}={v}" for k, v in request_fields.items()]
    # In the registry first, whichever test of this module runs first (pytest-xdist does not
    # keep their order): the first test's build, found, or this one (cached layers).
    build_and_push(ImageRequest(**request_fields).spec(), on_log=lambda line: None)
    try:
        found = stoker("build-image", *fields, work=work)
        assert found.returncode == 0, found.stderr[-3000:]
        result = json.loads(found.stdout)
        spec = ImageRequest(**request_fields).spec()
        assert not result["built"] and result["ref"] == image_ref(spec, content_hash(spec))
        api = connect()
        assert result["digest"] == registry_digest(api, result["ref"], None)
        api.close()
        dead = stoker("build-image", *fields, "registry=127.0.0.1:1", work=work)
        assert dead.returncode == 2, dead.stderr[-3000:]
        errors = [line for line in dead.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "127.0.0.1:1" in errors[0], dead.stderr[-3000:]
        # Said once (new-user trial: 4 ERROR lines repeated it before the error line).
        assert [line for line in dead.stderr.splitlines() if "127.0.0.1:1/" in line] \
            == errors, dead.stderr[-3000:]
        assert "Finished in state Failed (RegistryUnreachableError: see the error line)" \
            in dead.stderr, dead.stderr[-3000:]
        assert "Traceback" not in dead.stderr
        with sqlite3.connect(work / ".prefect" / "prefect.db") as db:
            states = sorted(row[0] for row in db.execute(
                "SELECT s.type FROM flow_run r JOIN flow_run_state s ON s.id = r.state_id"))
        assert states == ["COMPLETED", "FAILED"]
    finally:
        stop_local_servers(tmp_path)


def test_the_cli_names_an_unknown_matrix_entry_before_prefect_starts(tmp_path):
    work = tmp_path / "work"
    result = stoker("build-image", "matrix_entry=no-such-entry", work=work)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: matrix entry 'no-such-entry'")
    assert len(result.stderr.strip().splitlines()) == 1
    # Nothing written but the test's own seeded Prefect home (embedded_env), and no server.
    assert sorted(p.name for p in work.iterdir()) == [".prefect"]
    assert not (work / ".prefect" / "server.json").exists()
