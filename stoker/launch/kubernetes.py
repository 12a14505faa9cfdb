"""Submit Stoker's Kubernetes manifests, read how a job ended, and run one job as one attempt.

No Prefect here. Uses the official ``kubernetes`` client (the ``kubernetes`` extra):
``CoreV1Api`` for the spec ConfigMap and the pods, ``CustomObjectsApi`` for the TrainJob or
PyTorchJob. ``KubernetesLauncher.run`` returns an exit code with the same contract as
``LocalLauncher.run`` (0 done, 75 preempted, 137 infrastructure, else user error), so
``stoker.launch.retry.run_with_retries`` drives both.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, stop_never, wait_fixed

from stoker.launch.kubeflow import (
    JOB_LABEL,
    PYTORCH_CONTAINER,
    TRAINJOB_NODE,
    KubernetesLaunchConfig,
    configmap_name,
    render,
)
from stoker.launch.retry import Outcome, classify_exit
from stoker.runtime import EXIT_PREEMPTED
from stoker.runtime.spec import RunSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CustomResource:
    group: str
    version: str
    plural: str
    kind: str


RESOURCES = {
    "trainjob": CustomResource("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"),
    "pytorchjob": CustomResource("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"),
}
# What the identity that runs the launcher needs, as (API group, resource) -> verbs;
# infra/kubernetes/rbac.yaml grants exactly these.
REQUIRED_PERMISSIONS: dict[tuple[str, str], set[str]] = {
    ("", "configmaps"): {"create", "update", "delete"},
    ("", "pods"): {"list"},
    ("trainer.kubeflow.org", "trainjobs"): {"create", "get", "delete"},
    ("kubeflow.org", "pytorchjobs"): {"create", "get", "delete"},
}
# Pod failures that mean the node or the cluster took the pod away, not the code.
_DISRUPTED_REASONS = {"Evicted", "NodeLost", "Shutdown", "Terminated", "NodeShutdown"}
Phase = Literal["pending", "running", "succeeded", "failed", "suspended"]


class KubernetesError(RuntimeError):
    """The API server refused a request; the message names the object and the server's reason."""


@dataclass(frozen=True)
class JobStatus:
    """Where a job stands. ``outcome`` and ``exit_code`` are set once it has finished.

    ``exit_code`` follows Stoker's contract: the first failed pod's training container code
    (75 preempted, 137 killed), 137 for a pod the cluster took away without one, 124 for an
    exceeded deadline, 1 when no pod tells why.
    """

    name: str
    phase: Phase
    message: str = ""
    outcome: Outcome | None = None
    exit_code: int | None = None
    pod_exit_codes: dict[str, int] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.phase in ("succeeded", "failed")


def api_client(context: str | None = None) -> k8s.ApiClient:
    """An API client from the in-cluster service account, else from kubeconfig.

    Raises:
        KubernetesError: neither is available.
    """
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST") and context is None:
            k8s_config.load_incluster_config()
            return k8s.ApiClient()
        return k8s_config.new_client_from_config(context=context)
    except k8s_config.ConfigException as e:
        raise KubernetesError(f"no cluster credentials (in-cluster or kubeconfig): {e}") from e


def _error(action: str, obj: str, e: ApiException) -> KubernetesError:
    return KubernetesError(f"{action} {obj}: HTTP {e.status} {e.reason}: {e.body or ''}".strip())


def submit(manifests: list[dict], api: k8s.ApiClient) -> None:
    """Create ``manifests`` in order (a ConfigMap is replaced if it exists).

    Raises:
        KubernetesError: the server refused one (a job of that name exists already, the CRD
            is not installed, no permission, invalid field), with its HTTP status and message.
    """
    core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
    for manifest in manifests:
        meta = manifest["metadata"]
        obj = f"{manifest['kind']} {meta['namespace']}/{meta['name']}"
        try:
            if manifest["kind"] == "ConfigMap":
                try:
                    core.create_namespaced_config_map(meta["namespace"], manifest)
                except ApiException as e:
                    if e.status != 409:
                        raise
                    core.replace_namespaced_config_map(meta["name"], meta["namespace"], manifest)
            else:
                res = _resource_of(manifest["kind"])
                custom.create_namespaced_custom_object(
                    res.group, res.version, meta["namespace"], res.plural, manifest)
        except ApiException as e:
            raise _error("create", obj, e) from e
        log.info("created %s", obj)


def _resource_of(kind: str) -> CustomResource:
    for res in RESOURCES.values():
        if res.kind == kind:
            return res
    raise KubernetesError(f"kind {kind!r}: not a job kind Stoker submits")


def delete(name: str, config: KubernetesLaunchConfig, api: k8s.ApiClient,
           wait_s: float = 120.0, poll_interval_s: float = 2.0) -> None:
    """Delete the job and its spec ConfigMap (absent ones are fine); wait until the job is gone.

    Deletion is foreground, so the job object disappears only after its pods, and a new job of
    the same name can be created right after.

    Raises:
        KubernetesError: the server refused, or the job still exists after ``wait_s`` seconds.
    """
    res = RESOURCES[config.flavor]
    custom, core = k8s.CustomObjectsApi(api), k8s.CoreV1Api(api)
    obj = f"{res.kind} {config.namespace}/{name}"
    try:
        custom.delete_namespaced_custom_object(
            res.group, res.version, config.namespace, res.plural, name,
            propagation_policy="Foreground")
    except ApiException as e:
        if e.status != 404:
            raise _error("delete", obj, e) from e
    try:
        core.delete_namespaced_config_map(configmap_name(name), config.namespace)
    except ApiException as e:
        if e.status != 404:
            raise _error("delete", f"ConfigMap {config.namespace}/{configmap_name(name)}", e) from e

    def exists() -> bool:
        try:
            custom.get_namespaced_custom_object(
                res.group, res.version, config.namespace, res.plural, name)
        except ApiException as e:
            if e.status == 404:
                return False
            raise _error("get", obj, e) from e
        return True

    try:
        Retrying(retry=retry_if_result(bool), wait=wait_fixed(poll_interval_s),
                 stop=stop_after_delay(wait_s))(exists)
    except RetryError:
        raise KubernetesError(f"delete {obj}: still present after {wait_s:.0f} s") from None


def job_status(name: str, config: KubernetesLaunchConfig,
               api: k8s.ApiClient) -> JobStatus | None:
    """Read the job and its pods and say where it stands; None if no such job exists.

    Raises:
        KubernetesError: the server refused a request (other than 404 for the job).
    """
    res = RESOURCES[config.flavor]
    obj = f"{res.kind} {config.namespace}/{name}"
    try:
        job = k8s.CustomObjectsApi(api).get_namespaced_custom_object(
            res.group, res.version, config.namespace, res.plural, name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise _error("get", obj, e) from e
    try:
        pods = k8s.CoreV1Api(api).list_namespaced_pod(
            config.namespace, label_selector=f"{JOB_LABEL}={name}")
    except ApiException as e:
        raise _error("list pods of", obj, e) from e
    return classify(config.flavor, job, api.sanitize_for_serialization(pods).get("items", []))


def classify(flavor: str, job: dict, pods: list[dict]) -> JobStatus:
    """Phase and outcome of a job from its ``status.conditions`` and its pods (API dicts)."""
    name = job.get("metadata", {}).get("name", "")
    status = job.get("status") or {}
    true = {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}
    done, failed = ("Complete", "Failed") if flavor == "trainjob" else ("Succeeded", "Failed")
    if done in true:
        return JobStatus(name, "succeeded", true[done].get("message", ""), Outcome.COMPLETED, 0)
    if failed in true:
        return _failure(name, true[failed], pods)
    if "Suspended" in true:
        return JobStatus(name, "suspended", true["Suspended"].get("message", ""))
    running = any((p.get("status") or {}).get("phase") == "Running" for p in pods)
    running |= "Running" in true or any(j.get("active") for j in status.get("jobsStatus") or [])
    return JobStatus(name, "running" if running else "pending")


def _failure(name: str, condition: dict, pods: list[dict]) -> JobStatus:
    message = condition.get("message", "")
    exits = _pod_exits(pods)
    codes = {pod: code for _, code, pod, _ in exits}
    if condition.get("reason") == "DeadlineExceeded":
        return JobStatus(name, "failed", message, Outcome.USER_ERROR, 124, codes)
    if exits:
        _, code, pod, disrupted = min(exits)
        if disrupted and code != EXIT_PREEMPTED:
            code = 137  # the node went away: infrastructure, whatever the code said
        return JobStatus(name, "failed", f"{message} (first failed pod {pod}: exit {code})",
                         classify_exit(code), code, codes)
    taken = [p["metadata"]["name"] for p in pods if _disrupted(p)]
    if taken:
        return JobStatus(name, "failed", f"{message} (pods taken away: {', '.join(taken)})",
                         Outcome.INFRASTRUCTURE, 137, codes)
    return JobStatus(name, "failed", f"{message} (no pod exit code found)",
                     Outcome.USER_ERROR, 1, codes)


def _pod_exits(pods: list[dict]) -> list[tuple[dt.datetime, int, str, bool]]:
    """(finished time, exit code, pod name, disrupted) of each failed training container."""
    exits = []
    for pod in pods:
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        for cs in statuses:
            if cs.get("name") not in (PYTORCH_CONTAINER, TRAINJOB_NODE):
                continue
            term = (cs.get("state") or {}).get("terminated") or \
                (cs.get("lastState") or {}).get("terminated")
            if term and term.get("exitCode"):
                finished = term.get("finishedAt") or "9999-12-31T00:00:00Z"
                when = dt.datetime.fromisoformat(str(finished).replace("Z", "+00:00"))
                exits.append((when, int(term["exitCode"]), pod["metadata"]["name"],
                              _disrupted(pod)))
    return exits


def _disrupted(pod: dict) -> bool:
    status = pod.get("status") or {}
    if status.get("reason") in _DISRUPTED_REASONS:
        return True
    return any(c.get("type") == "DisruptionTarget" and c.get("status") == "True"
               for c in status.get("conditions") or [])


class StopRequested(Exception):  # noqa: N818 - a request, not an error
    """Someone asked the job to stop (``stoker stop``, the cost guard) while it ran."""


# A stopped job's pods are deleted, their exit codes with them: the attempt reads as ended by
# the SIGTERM the deletion sent (128 + 15), and as stopped, since the stop was asked for.
EXIT_STOPPED_BY_DELETION = 143


def wait(name: str, config: KubernetesLaunchConfig, api: k8s.ApiClient,
         poll_interval_s: float = 10.0, timeout_s: float | None = None,
         on_status: Callable[[JobStatus], None] = lambda s: None,
         stop_requested: Callable[[], bool] = lambda: False) -> JobStatus:
    """Poll ``job_status`` every ``poll_interval_s`` seconds until the job has finished.

    ``on_status`` gets each status whose phase differs from the previous one.
    ``stop_requested`` is asked before each poll.

    Raises:
        TimeoutError: not finished after ``timeout_s`` seconds.
        KubernetesError: the job disappeared, or the server refused a request.
        StopRequested: ``stop_requested()`` said so (the job is left as it is).
    """
    seen: list[str] = []

    def poll() -> JobStatus:
        if stop_requested():
            raise StopRequested(name)
        status = job_status(name, config, api)
        if status is None:
            raise KubernetesError(f"{RESOURCES[config.flavor].kind} {config.namespace}/{name}: "
                                  "not found (deleted while waiting?)")
        if not seen or seen[-1] != status.phase:
            seen.append(status.phase)
            on_status(status)
        return status

    try:
        return Retrying(retry=retry_if_result(lambda s: not s.finished),
                        wait=wait_fixed(poll_interval_s),
                        stop=stop_after_delay(timeout_s) if timeout_s else stop_never)(poll)
    except RetryError:
        raise TimeoutError(f"{name}: still {seen[-1]} after {timeout_s} s") from None


class KubernetesLauncher:
    """One attempt = one job on the cluster, with ``LocalLauncher``'s exit-code contract.

    ``run`` attaches to the job of that name if it is still going (the orchestrator restarted),
    else deletes a finished one and submits anew: the same call starts and resumes.

    Args:
        config: where and how to run.
        api: an API client (``api_client()``).
        poll_interval_s: seconds between status reads.
        on_status: called with each new phase (for logs).
    """

    def __init__(self, config: KubernetesLaunchConfig, api: k8s.ApiClient,
                 poll_interval_s: float = 10.0,
                 on_status: Callable[[JobStatus], None] = lambda s: None):
        self.config, self.api = config, api
        self.poll_interval_s, self.on_status = poll_interval_s, on_status

    def run(self, spec: RunSpec, name: str, timeout_s: float | None = None,
            stop_requested: Callable[[], bool] = lambda: False) -> int:
        """Run the job for ``spec`` under ``name`` to its end and return its exit code.

        If the wait is interrupted (timeout, cancellation, any exception) the job is deleted
        before the exception propagates: no GPU pod outlives the call.

        ``stop_requested`` is asked at every status poll (``stoker stop``, the cost guard).
        When it says so, the job is deleted: each pod gets SIGTERM and its
        ``terminationGracePeriodSeconds`` (which covers ``train.preemption_grace_s``), in which
        the ranks commit a stop checkpoint, as for a spot reclaim; the call returns 143
        (:data:`EXIT_STOPPED_BY_DELETION`) once the job is gone.

        Raises:
            ConfigError: the spec or config cannot be rendered (nothing was submitted).
            KubernetesError: the server refused a request.
            TimeoutError: the job ran longer than ``timeout_s`` seconds.
        """
        manifests = render(spec, name, self.config)
        current = job_status(name, self.config, self.api)
        if current is not None and not current.finished:
            log.info("job %s is %s: attaching to it", name, current.phase)
        else:
            if current is not None:
                delete(name, self.config, self.api)
            submit(manifests, self.api)
        try:
            final = wait(name, self.config, self.api, self.poll_interval_s, timeout_s,
                         self.on_status, stop_requested)
        except StopRequested:
            log.warning("job %s: stop requested: deleting %s %s/%s (its pods get SIGTERM and "
                        "%.0f s of grace for the stop checkpoint)", spec.job_dir,
                        RESOURCES[self.config.flavor].kind, self.config.namespace, name,
                        spec.train.preemption_grace_s)
            delete(name, self.config, self.api,
                   wait_s=max(120.0, spec.train.preemption_grace_s + 60.0))
            return EXIT_STOPPED_BY_DELETION
        except BaseException:
            delete(name, self.config, self.api)
            raise
        return int(final.exit_code if final.exit_code is not None else 1)
