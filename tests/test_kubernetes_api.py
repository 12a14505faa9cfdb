"""Submission and status through the real ``kubernetes`` client over real HTTP, against a server
on 127.0.0.1 that records every request and answers like the API server (no cluster exists
here). Status fixtures are checked against Kubeflow's own API models."""

from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from test_kubernetes import config

from stoker.config import ConfigError, RetryConfig
from stoker.launch import kubeflow
from stoker.launch.api_models import check_manifest
from stoker.launch.retry import Outcome, run_with_retries
from stoker.runtime.spec import RunSpec


def _require(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"{module} is not installed: pip install -e '.[kubernetes]'",
                    allow_module_level=True)


k8s = _require("kubernetes.client")
kapi = _require("stoker.launch.kubernetes")

NS = "training"
NAME = "stoker-job-1"
TRAINJOBS = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs"
PYTORCHJOBS = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs"
CONFIGMAPS = f"/api/v1/namespaces/{NS}/configmaps"
PODS = f"/api/v1/namespaces/{NS}/pods"


class FakeApiServer:
    """Plays the Kubernetes API server on 127.0.0.1: records (method, path, query, body) and
    answers each (method, path) from a script; the last scripted answer repeats, anything
    unscripted gets 404 with a Status body like the real server's."""

    def __init__(self):
        self.requests: list[tuple[str, str, dict, dict | None]] = []
        self.routes: dict[tuple[str, str], list] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                server.requests.append((self.command, url.path, parse_qs(url.query), body))
                status, payload = server._next(self.command, url.path)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _answer

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,),
                                       daemon=True)

    def on(self, method: str, path: str, *answers) -> None:
        """Script answers: (status, body) pairs, or callables returning one."""
        self.routes[(method, path)] = list(answers)

    def _next(self, method: str, path: str) -> tuple[int, dict]:
        answers = self.routes.get((method, path))
        if not answers:
            return 404, status_body(404, "NotFound", f"{path} not found")
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        return answer() if callable(answer) else answer

    def calls(self, method: str | None = None) -> list[tuple[str, str]]:
        return [(m, p) for m, p, _, _ in self.requests if method in (None, m)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"


def status_body(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
            "reason": reason, "code": code}


@pytest.fixture
def server():
    fake = FakeApiServer()
    fake.thread.start()
    yield fake
    fake.httpd.shutdown()
    fake.httpd.server_close()


@pytest.fixture
def api(server):
    configuration = k8s.Configuration(host=server.url)
    with k8s.ApiClient(configuration) as client:
        yield client


@pytest.fixture
def spec() -> RunSpec:
    return RunSpec(data_dir="/data/digits", job_dir="/jobs/j1")


def cond(type_: str, reason: str = "Reason", message: str = "") -> dict:
    return {"type": type_, "status": "True", "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T12:00:00Z"}


def job_obj(kind: str, *conditions: dict, **status) -> dict:
    api_version = "trainer.kubeflow.org/v1alpha1" if kind == "TrainJob" else "kubeflow.org/v1"
    obj = {"apiVersion": api_version, "kind": kind,
           "metadata": {"name": NAME, "namespace": NS},
           "spec": {"runtimeRef": {"name": "torch-distributed"}} if kind == "TrainJob"
           else {"pytorchReplicaSpecs": {}, "runPolicy": {}},
           "status": {"conditions": list(conditions), **status}}
    check_manifest(obj)  # fixtures shaped like the real status
    return obj


def pod(name: str, exit_code: int | None = None, finished_s: int = 0, container: str = "node",
        disrupted: bool = False, phase: str | None = None) -> dict:
    state = {"running": {"startedAt": "2026-01-01T11:00:00Z"}}
    if exit_code is not None:
        finished = dt.datetime(2026, 1, 1, 12, tzinfo=dt.UTC) + dt.timedelta(seconds=finished_s)
        state = {"terminated": {"exitCode": exit_code, "reason": "Error",
                                "finishedAt": finished.isoformat().replace("+00:00", "Z")}}
    status = {"phase": phase or ("Running" if exit_code is None else "Failed"),
              "containerStatuses": [{"name": container, "image": "img", "imageID": "img@sha",
                                     "ready": False, "restartCount": 0, "state": state}]}
    if disrupted:
        status["conditions"] = [{"type": "DisruptionTarget", "status": "True",
                                 "reason": "DeletionByTaintManager"}]
    return {"metadata": {"name": name, "namespace": NS}, "status": status}


def pod_list(*pods: dict) -> dict:
    return {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": list(pods)}


def test_submit_creates_the_configmap_then_the_trainjob(server, api, spec):
    server.on("POST", CONFIGMAPS, (201, {}))
    server.on("POST", TRAINJOBS, (201, {}))
    manifests = kapi.render(spec, NAME, config(namespace=NS))
    kapi.submit(manifests, api)
    assert server.calls() == [("POST", CONFIGMAPS), ("POST", TRAINJOBS)]
    assert [body for _, _, _, body in server.requests] == manifests


def test_submit_pytorchjob_and_replace_an_existing_configmap(server, api, spec):
    server.on("POST", CONFIGMAPS, (409, status_body(409, "AlreadyExists", "exists")))
    server.on("PUT", f"{CONFIGMAPS}/{NAME}-spec", (200, {}))
    server.on("POST", PYTORCHJOBS, (201, {}))
    manifests = kapi.render(spec, NAME, config(namespace=NS, flavor="pytorchjob"))
    kapi.submit(manifests, api)
    assert server.calls() == [("POST", CONFIGMAPS), ("PUT", f"{CONFIGMAPS}/{NAME}-spec"),
                              ("POST", PYTORCHJOBS)]
    assert server.requests[-1][3]["kind"] == "PyTorchJob"


def test_submit_reports_the_servers_refusal(server, api, spec):
    server.on("POST", CONFIGMAPS, (201, {}))
    server.on("POST", TRAINJOBS, (409, status_body(409, "AlreadyExists",
                                                   f'trainjobs "{NAME}" already exists')))
    with pytest.raises(kapi.KubernetesError,
                       match=f"create TrainJob {NS}/{NAME}: HTTP 409 .*already exists"):
        kapi.submit(kapi.render(spec, NAME, config(namespace=NS)), api)


def test_job_status_reads_conditions_and_the_first_failed_pod(server, api):
    server.on("GET", f"{TRAINJOBS}/{NAME}", (200, job_obj("TrainJob", cond("Failed", "JobFailed",
                                                                          "jobset failed"))))
    server.on("GET", PODS, (200, pod_list(pod("n-1", 75, finished_s=30),
                                          pod("n-0", 75, finished_s=20))))
    status = kapi.job_status(NAME, config(namespace=NS), api)
    assert (status.phase, status.outcome, status.exit_code) == ("failed", Outcome.PREEMPTED, 75)
    assert "first failed pod n-0" in status.message
    assert status.pod_exit_codes == {"n-0": 75, "n-1": 75}
    _, _, query, _ = server.requests[-1]
    assert query == {"labelSelector": [f"dev.stoker.job={NAME}"]}


def test_job_status_of_a_missing_job_is_none(server, api):
    assert kapi.job_status(NAME, config(namespace=NS, flavor="pytorchjob"), api) is None
    assert server.calls() == [("GET", f"{PYTORCHJOBS}/{NAME}")]


@pytest.mark.parametrize(("flavor", "job", "pods", "expected"), [
    ("trainjob", job_obj("TrainJob", cond("Complete")), [], ("succeeded", Outcome.COMPLETED, 0)),
    ("pytorchjob", job_obj("PyTorchJob", cond("Succeeded")), [],
     ("succeeded", Outcome.COMPLETED, 0)),
    ("trainjob", job_obj("TrainJob"), [], ("pending", None, None)),
    ("trainjob", job_obj("TrainJob", jobsStatus=[{"name": "node", "active": 2, "ready": 0,
                                                  "failed": 0, "succeeded": 0, "suspended": 0}]),
     [], ("running", None, None)),
    ("pytorchjob", job_obj("PyTorchJob", cond("Running")), [], ("running", None, None)),
    ("trainjob", job_obj("TrainJob", cond("Suspended")), [], ("suspended", None, None)),
    # The first failure decides: a bug at t=10 s, then peers killed by the job's cleanup.
    ("pytorchjob", job_obj("PyTorchJob", cond("Failed")),
     [pod("w-1", 75, 40, "pytorch"), pod("w-0", 2, 10, "pytorch")],
     ("failed", Outcome.USER_ERROR, 2)),
    ("trainjob", job_obj("TrainJob", cond("Failed")), [pod("n-0", 137)],
     ("failed", Outcome.INFRASTRUCTURE, 137)),
    # A pod whose node went away fails the NCCL peers too: infrastructure, not a bug.
    ("trainjob", job_obj("TrainJob", cond("Failed")), [pod("n-0", 1, 5, disrupted=True),
                                                       pod("n-1", 1, 9)],
     ("failed", Outcome.INFRASTRUCTURE, 137)),
    ("trainjob", job_obj("TrainJob", cond("Failed")),
     [{"metadata": {"name": "n-0"}, "status": {"phase": "Failed", "reason": "Evicted"}}],
     ("failed", Outcome.INFRASTRUCTURE, 137)),
    ("trainjob", job_obj("TrainJob", cond("Failed", "DeadlineExceeded")), [pod("n-0", 75)],
     ("failed", Outcome.USER_ERROR, 124)),
    ("pytorchjob", job_obj("PyTorchJob", cond("Failed")), [], ("failed", Outcome.USER_ERROR, 1)),
    ("pytorchjob", job_obj("PyTorchJob", cond("Failed")), [pod("sidecar", 3, container="x")],
     ("failed", Outcome.USER_ERROR, 1)),
])
def test_classify(flavor, job, pods, expected):
    status = kapi.classify(flavor, job, pods)
    assert (status.phase, status.outcome, status.exit_code) == expected
    assert status.finished == (expected[0] in ("succeeded", "failed"))


def script_job(server, path: str, *jobs: dict, pods: dict | None = None) -> None:
    server.on("GET", f"{path}/{NAME}", *[(200, j) for j in jobs])
    server.on("GET", PODS, (200, pods or pod_list()))


def test_launcher_submits_waits_and_returns_the_exit_code(server, api, spec):
    seen = []
    script_job(server, TRAINJOBS, job_obj("TrainJob"), job_obj("TrainJob", cond("Failed")),
               pods=pod_list(pod("n-0", 137)))
    server.routes[("GET", f"{TRAINJOBS}/{NAME}")].insert(0, (404, status_body(404, "NotFound",
                                                                               "absent")))
    server.on("POST", CONFIGMAPS, (201, {}))
    server.on("POST", TRAINJOBS, (201, {}))
    launcher = kapi.KubernetesLauncher(config(namespace=NS), api, poll_interval_s=0.01,
                                       on_status=lambda s: seen.append(s.phase))
    assert launcher.run(spec, NAME) == 137
    assert seen == ["pending", "failed"]
    assert ("POST", TRAINJOBS) in server.calls() and not server.calls("DELETE")


@pytest.mark.parametrize("flavor", ["trainjob", "pytorchjob"])
def test_launcher_submits_nothing_when_a_manifest_is_refused(server, api, spec, flavor,
                                                             monkeypatch):
    monkeypatch.setattr(kubeflow, "_env", lambda config: [{"name": "X", "valu": "1"}])
    launcher = kapi.KubernetesLauncher(config(namespace=NS, flavor=flavor), api,
                                       poll_interval_s=0.01)
    with pytest.raises(ConfigError, match=r"env\[0\]\.valu: unknown field"):
        launcher.run(spec, NAME)
    assert server.requests == []


def test_launcher_attaches_to_a_job_that_is_still_running(server, api, spec):
    running = job_obj("PyTorchJob", cond("Running"))
    script_job(server, PYTORCHJOBS, running, running, job_obj("PyTorchJob", cond("Succeeded")))
    launcher = kapi.KubernetesLauncher(config(namespace=NS, flavor="pytorchjob"), api,
                                       poll_interval_s=0.01)
    assert launcher.run(spec, NAME) == 0
    assert not server.calls("POST") and not server.calls("DELETE")


def test_launcher_deletes_a_finished_job_before_resubmitting(server, api, spec):
    gone = (404, status_body(404, "NotFound", "gone"))
    server.on("GET", f"{TRAINJOBS}/{NAME}", (200, job_obj("TrainJob", cond("Failed"))), gone,
              (200, job_obj("TrainJob")), (200, job_obj("TrainJob", cond("Complete"))))
    server.on("GET", PODS, (200, pod_list(pod("n-0", 75))))
    server.on("DELETE", f"{TRAINJOBS}/{NAME}", (200, {}))
    server.on("DELETE", f"{CONFIGMAPS}/{NAME}-spec", (200, {}))
    server.on("POST", CONFIGMAPS, (201, {}))
    server.on("POST", TRAINJOBS, (201, {}))
    launcher = kapi.KubernetesLauncher(config(namespace=NS), api, poll_interval_s=0.01)
    assert launcher.run(spec, NAME) == 0
    calls = server.calls()
    assert calls.index(("DELETE", f"{TRAINJOBS}/{NAME}")) < calls.index(("POST", TRAINJOBS))
    _, _, query, body = server.requests[calls.index(("DELETE", f"{TRAINJOBS}/{NAME}"))]
    assert (body or {}).get("propagationPolicy") == "Foreground" or \
        query.get("propagationPolicy") == ["Foreground"]


def test_delete_gives_up_when_the_job_stays(server, api):
    server.on("GET", f"{TRAINJOBS}/{NAME}", (200, job_obj("TrainJob", cond("Running"))))
    server.on("DELETE", f"{TRAINJOBS}/{NAME}", (200, {}))
    with pytest.raises(kapi.KubernetesError, match=f"delete TrainJob {NS}/{NAME}: still present"):
        kapi.delete(NAME, config(namespace=NS), api, wait_s=0.05, poll_interval_s=0.01)


def test_launcher_deletes_the_job_when_the_wait_times_out(server, api, spec):
    deleted = threading.Event()
    running = (200, job_obj("TrainJob", cond("Running")))
    gone = (404, status_body(404, "NotFound", "gone"))
    server.on("GET", f"{TRAINJOBS}/{NAME}", lambda: gone if deleted.is_set() else running)
    server.on("GET", PODS, (200, pod_list(pod("n-0"))))
    server.on("DELETE", f"{TRAINJOBS}/{NAME}", lambda: (deleted.set(), (200, {}))[1])
    launcher = kapi.KubernetesLauncher(config(namespace=NS), api, poll_interval_s=0.01)
    with pytest.raises(TimeoutError, match=f"{NAME}: still running"):
        launcher.run(spec, NAME, timeout_s=0.05)
    assert deleted.is_set() and not server.calls("POST")
    assert server.calls()[-1] == ("GET", f"{TRAINJOBS}/{NAME}")  # waited until it was gone


def test_run_with_retries_resumes_a_preempted_job_on_the_cluster(server, api, spec):
    """The existing retry loop drives the launcher: preempted (75), resubmitted, completed."""
    gone = (404, status_body(404, "NotFound", "gone"))
    server.on("GET", f"{PYTORCHJOBS}/{NAME}", gone, (200, job_obj("PyTorchJob", cond("Failed"))),
              (200, job_obj("PyTorchJob", cond("Failed"))), gone,
              (200, job_obj("PyTorchJob", cond("Succeeded"))))
    server.on("GET", PODS, (200, pod_list(pod("w-0", 75, container="pytorch"))))
    for method, path in (("POST", CONFIGMAPS), ("POST", PYTORCHJOBS),
                         ("DELETE", f"{PYTORCHJOBS}/{NAME}"),
                         ("DELETE", f"{CONFIGMAPS}/{NAME}-spec")):
        server.on(method, path, (200, {}))
    launcher = kapi.KubernetesLauncher(config(namespace=NS, flavor="pytorchjob"), api,
                                       poll_interval_s=0.01)
    attempts = run_with_retries(lambda n: launcher.run(spec, NAME), RetryConfig(backoff_s=0),
                                sleep=lambda s: None)
    assert [a.outcome for a in attempts] == [Outcome.PREEMPTED, Outcome.COMPLETED]
    assert server.calls("POST").count(("POST", PYTORCHJOBS)) == 2


def test_rbac_grants_what_the_launcher_uses():
    import yaml
    from test_kubernetes import ROOT

    docs = list(yaml.safe_load_all((ROOT / "infra/kubernetes/rbac.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "Role")
    granted = {(g, r): set(rule["verbs"]) for rule in role["rules"]
               for g in rule["apiGroups"] for r in rule["resources"]}
    for key, verbs in kapi.REQUIRED_PERMISSIONS.items():
        assert verbs <= granted.get(key, set()), key
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    account = next(d for d in docs if d["kind"] == "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]


@pytest.mark.parametrize("flavor", ["trainjob", "pytorchjob"])
def test_a_job_kept_in_a_bucket_is_submitted_with_credentials_from_a_secret(server, api,
                                                                              flavor):
    """With a top-level checkpoint_dir the job's spec (in the ConfigMap) names its checkpoints
    in the bucket; the pods get the bucket credentials from a Secret (secretKeyRef), never a
    value in the manifest; an inline secret is refused naming the field, and so is a second
    checkpoint location beside the job store's."""
    from test_kubernetes import assert_valid

    from stoker.config import PipelineConfig
    from stoker.launch.factory import make_launcher

    spec = RunSpec(data_dir="/data/digits", job_dir="/jobs/j1", lease_token="tok",
                   checkpoint_dir="s3://stoker-jobs/jobs/j1/checkpoints")
    jobs = TRAINJOBS if flavor == "trainjob" else PYTORCHJOBS
    server.on("POST", CONFIGMAPS, (201, {}))
    server.on("POST", jobs, (201, {}))
    manifests = kapi.render(spec, NAME, config(namespace=NS, flavor=flavor,
                                               credentials_secret="bucket-creds"))
    kapi.submit(manifests, api)
    assert server.calls() == [("POST", CONFIGMAPS), ("POST", jobs)]
    configmap, job = (body for _, _, _, body in server.requests)
    assert_valid(job)
    sent = RunSpec.model_validate(__import__("yaml").safe_load(configmap["data"]["spec.yaml"]))
    assert sent.checkpoint_dir == "s3://stoker-jobs/jobs/j1/checkpoints"
    assert sent.lease_token == "tok"  # the pods fence their commits with the job's lease
    text = json.dumps(job)
    env = {e["name"]: e for e in (job["spec"]["trainer"]["env"] if flavor == "trainjob" else
                                  job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
                                  ["spec"]["containers"][0]["env"])}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        assert env[key]["valueFrom"]["secretKeyRef"]["name"] == "bucket-creds"
        assert "value" not in env[key]
    assert "testing-secret" not in text

    with pytest.raises(ValueError, match="env.AWS_SECRET_ACCESS_KEY: credentials never go "
                                         "inline"):
        config(env={"AWS_SECRET_ACCESS_KEY": "testing-secret"})
    pipeline = PipelineConfig(checkpoint_dir="s3://stoker-jobs/jobs", tracking={
        "tracking_uri": "http://127.0.0.1:5000"}, launcher={
        "kind": "kubernetes", "kubernetes": {"image": "img:1", "checkpoint_dir": "s3://x/y"}})
    with pytest.raises(ConfigError, match="launcher.kubernetes.checkpoint_dir: leave it empty"):
        make_launcher(pipeline, 1, "img:1")


def test_a_stop_request_deletes_the_job_and_the_attempt_is_stopped(server, api, tmp_path):
    """``stoker stop`` (or the cost guard) on a Kubernetes job: the request was only recorded,
    and the job trained on until its attempt ended. Now the launcher sees it at its next status
    poll and deletes the job (its pods get SIGTERM and their grace for the stop checkpoint);
    the attempt is stopped, not retried, and nothing is submitted again."""
    from stoker.jobs.stop_request import request_stop
    from stoker.launch.factory import KubernetesAdapter
    from stoker.launch.kubeflow import VolumeClaim

    spec = RunSpec(data_dir="/data/digits", job_dir=str(tmp_path))
    spec.dump(tmp_path / "spec.yaml")
    name = kubeflow.kubernetes_name(tmp_path.name)
    path = f"{TRAINJOBS}/{name}"
    gets, deleted = [], threading.Event()
    running = (200, job_obj("TrainJob", cond("Running")) | {"metadata": {"name": name,
                                                                        "namespace": NS}})

    def get_job():
        gets.append(1)
        if len(gets) == 3:  # the job has been running for two polls: stoker stop
            request_stop(tmp_path, "user", "maintenance")
        if len(gets) > 50:  # (a launcher that does not look: the job ends on its own)
            return 200, job_obj("TrainJob", cond("Complete")) | {"metadata": {"name": name,
                                                                              "namespace": NS}}
        return (404, status_body(404, "NotFound", "gone")) if deleted.is_set() else running

    server.on("GET", path, get_job)
    server.on("GET", PODS, (200, pod_list(pod("n-0"))))
    server.on("DELETE", path, lambda: (deleted.set(), (200, {}))[1])
    server.on("DELETE", f"{CONFIGMAPS}/{name}-spec", (200, {}))
    claims = [VolumeClaim(claim_name="datasets", mount_path="/data", read_only=True),
              VolumeClaim(claim_name="jobs", mount_path=str(tmp_path.parent))]
    launcher = KubernetesAdapter(kapi.KubernetesLauncher(
        config(namespace=NS, volume_claims=claims), api, poll_interval_s=0.01))
    codes = []

    def launch(_number: int) -> int:
        codes.append(launcher.run(tmp_path / "spec.yaml", on_line=lambda line: None))
        return codes[-1]

    attempts = run_with_retries(launch, RetryConfig(), sleep=lambda s: None,
                                stop_requested=lambda: (tmp_path / "stop-requested.json").exists())
    assert codes == [kapi.EXIT_STOPPED_BY_DELETION]
    assert [a.outcome for a in attempts] == [Outcome.STOPPED]  # not retried
    assert deleted.is_set() and not server.calls("POST")  # attached, never submitted again
    _, _, query, body = next(r for r in server.requests if r[0] == "DELETE" and r[1] == path)
    assert (body or {}).get("propagationPolicy") == "Foreground" or \
        query.get("propagationPolicy") == ["Foreground"]
    assert server.calls()[-1] == ("GET", path)  # waited until the job was gone


def test_stoker_stop_on_a_kubernetes_job_waits_for_the_launcher_not_for_local_ranks(
        tmp_path, monkeypatch):
    """No rank of a Kubernetes job runs on the orchestrating machine: ``stoker stop`` records
    the request and waits for the job to stop (its launcher deletes it), without looking for a
    local launcher or a container all the while (it polled both until its timeout)."""
    import socket
    import subprocess
    import sys
    import time

    import stoker.jobs.stop as stop_request
    from stoker.jobs.attempts import AttemptLog
    from stoker.jobs.stop_request import read_stop_request

    def not_here(*_args):
        raise AssertionError("looked for local ranks of a Kubernetes job")

    monkeypatch.setattr(stop_request, "launcher_below", not_here)
    monkeypatch.setattr(stop_request, "job_containers", not_here)
    monkeypatch.setattr(stop_request, "docker_client", not_here)
    # The orchestrating flow: holds the job and ends once the stop is asked for (its launcher
    # deleted the job at its next poll).
    holder = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        f"while not os.path.exists({str(tmp_path / 'stop-requested.json')!r}):\n"
        "    time.sleep(0.05)\n")])
    threading.Thread(target=holder.wait, daemon=True).start()  # reaped: not a zombie "alive"
    try:
        (tmp_path / "lease.json").write_text(json.dumps({
            "host": socket.gethostname(), "pid": holder.pid, "expires": time.time() + 600}))
        AttemptLog(tmp_path).start(1, "spot", None, "kubernetes")
        state = stop_request.stop_job(tmp_path, "maintenance", timeout_s=30, poll_s=0.05)
    finally:
        holder.kill()
        holder.wait()
    assert state == "stopped"
    assert read_stop_request(tmp_path).describe() == "stopped by user: maintenance"
