"""A first run says what it waits for before each first-time wait (issue 45 trial: 10-40 s of
silence on a fresh machine), and a warm run says none of it: real git/DVC demo repository, real
MLflow sqlite store, real local Prefect server."""

from __future__ import annotations

import pytest
from local_servers import stop_local_servers
from prefect_server import seed_prefect_home

from stoker.config import load_pipeline_config
from stoker.local_server import PORT_FILE, LocalServer, free_port

pytestmark = pytest.mark.integration


def test_the_demo_repository_is_announced_before_it_is_built(tmp_path):
    from stoker.data.prepare import prepare_dataset

    config = load_pipeline_config(None, [f"work_dir={tmp_path / 'work'}"])
    said: list[str] = []
    prepare_dataset(config, log=said.append)
    repo = tmp_path / "work" / "demo-data" / "repo"
    assert said[0] == f"creating the demo data repository (once): {repo}", said
    assert said[1].startswith(f"created demo data repository {repo}"), said
    said.clear()
    prepare_dataset(config, log=said.append)  # warm: nothing about creating
    assert not [line for line in said if "(once)" in line], said


def test_a_new_mlflow_store_is_announced_and_its_end_said(tmp_path):
    from mlflow import MlflowClient

    from stoker.tracking.store import open_store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    said: list[str] = []
    open_store(uri, say=said.append)
    assert said[0] == f"creating the MLflow store (once): {tmp_path / 'mlflow.db'}", said
    assert said[1].startswith("MLflow store ready in ") and said[1].endswith(" s"), said
    assert MlflowClient(uri).search_experiments()  # the store is there: its Default experiment
    said.clear()
    open_store(uri, say=said.append)
    assert said == []


def test_a_server_start_is_announced_before_its_wait_and_a_reuse_is_not(tmp_path):
    home = seed_prefect_home(tmp_path / "prefect")
    port = free_port()
    (home / PORT_FILE).write_text(str(port))  # not 4200: other tests' servers use it
    said: list[str] = []
    try:
        assert LocalServer(home, say=said.append).ensure()[1] is True
        assert len(said) == 1 and said[0].startswith(
            f"starting the local Prefect server on 127.0.0.1:{port} (pid "), said
        assert f"log {home / 'server.log'})" in said[0]
        said.clear()
        assert LocalServer(home, say=said.append).ensure()[1] is False
        assert said == []
    finally:
        stop_local_servers(tmp_path)


def test_a_server_kept_off_its_usual_port_says_which_port_was_taken(tmp_path):
    import socket

    from stoker.local_server import ports_taken

    home = seed_prefect_home(tmp_path / "prefect")
    with socket.socket() as held:  # another process's listener on this home's sticky port
        held.bind(("127.0.0.1", 0))
        held.listen()
        sticky = held.getsockname()[1]
        (home / PORT_FILE).write_text(str(sticky))
        server = LocalServer(home)
        port = server._port()
        assert port != sticky
        assert server._port_taken[0] == sticky
    assert ports_taken([sticky]) == f"port {sticky} is taken by another process"
    assert ports_taken([sticky, 4200]) == f"port {sticky} and 4200 are taken by another process"
