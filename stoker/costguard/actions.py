"""Actors: stop one kind of resource, and only if it carries Stoker's ownership mark.

Each actor reads the mark from the system it acts on (container labels from the engine, instance
tags from EC2) right before acting, whatever the caller believes, and refuses anything without
it. The Prefect actor lives in ``tasks/cost_guard.py`` (``stoker/`` does not import Prefect).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from stoker.costguard.inventory import Resource
from stoker.ownership import CLOUD_OWNER_TAG, DOCKER_OWNER_LABEL

log = logging.getLogger(__name__)

ActionStatus = Literal["stopped", "cancelled", "refused", "gone", "failed"]


@dataclass(frozen=True)
class ActionResult:
    """What an actor did: ``status`` and a one-line ``detail`` for the report."""

    status: ActionStatus
    detail: str


class Actor(Protocol):
    """Stops resources of one ``kind`` ("container", "job", "instance")."""

    kind: str

    def act(self, resource: Resource) -> ActionResult:
        """Stop ``resource`` gracefully if it carries Stoker's ownership mark; never raises for
        a refused or failed stop (the result says so)."""
        ...


class DockerActor:
    """Stops Stoker-owned containers: SIGTERM (the runtime checkpoints), SIGKILL after a timeout.

    Args:
        client: a ``docker.DockerClient``.
        stop_timeout_s: seconds between SIGTERM and SIGKILL (``docker stop -t``).
    """

    kind = "container"

    def __init__(self, client: Any, stop_timeout_s: float = 60.0):
        self.client = client
        self.stop_timeout_s = stop_timeout_s

    def act(self, resource: Resource) -> ActionResult:
        import docker.errors

        try:
            container = self.client.containers.get(resource.id)
            if container.labels.get(DOCKER_OWNER_LABEL) != "true":
                return ActionResult("refused", f"container {container.name} has no "
                                    f"{DOCKER_OWNER_LABEL}=true label")
            if container.status != "running":
                return ActionResult("gone", f"container {container.name} is {container.status}")
            # docker stop: the image's stop signal (SIGTERM by default), SIGKILL after the timeout.
            container.stop(timeout=int(round(self.stop_timeout_s)))
            container.reload()
        except docker.errors.NotFound:
            return ActionResult("gone", f"container {resource.id[:12]} no longer exists")
        except docker.errors.APIError as e:
            return ActionResult("failed", f"docker: {e.explanation or e}")
        state = container.attrs.get("State", {})
        return ActionResult("stopped", stop_outcome(container.name, state, self.stop_timeout_s))


def stop_outcome(name: str, state: dict, stop_timeout_s: float) -> str:
    """How a ``docker stop`` ended, in an operator's words (137 after the timeout is SIGKILL by
    the stop, not an out-of-memory kill)."""
    code = state.get("ExitCode")
    if state.get("OOMKilled"):
        return f"container {name} stopped; it had been killed for lack of memory (exit {code})"
    if code == 137:
        return (f"container {name} did not exit within stop_timeout_s {stop_timeout_s:g} after "
                f"SIGTERM: killed by SIGKILL (exit 137 after stop timeout)")
    return f"container {name} stopped after SIGTERM (exit {code})"


class Ec2Actor:
    """Stops EC2 instances tagged ``stoker:owned=true`` (stop, not terminate: disks are kept).

    Args:
        client: a boto3 EC2 client (``boto3.client("ec2", region_name=..., endpoint_url=...)``).
    """

    kind = "instance"

    def __init__(self, client: Any):
        self.client = client

    @classmethod
    def connect(cls, region: str | None = None, endpoint_url: str | None = None) -> Ec2Actor:
        """An actor with a boto3 client; credentials come from boto3's usual chain."""
        import boto3

        return cls(boto3.client("ec2", region_name=region, endpoint_url=endpoint_url))

    def act(self, resource: Resource) -> ActionResult:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            found = self.client.describe_instances(InstanceIds=[resource.id])
            instances = [i for r in found.get("Reservations", []) for i in r.get("Instances", [])]
            if not instances:
                return ActionResult("gone", f"instance {resource.id} not found")
            instance = instances[0]
            tags = {t["Key"]: t["Value"] for t in instance.get("Tags", [])}
            if tags.get(CLOUD_OWNER_TAG) != "true":
                return ActionResult("refused", f"instance {resource.id} has no "
                                    f"{CLOUD_OWNER_TAG}=true tag")
            state = instance.get("State", {}).get("Name")
            if state != "running":
                return ActionResult("gone", f"instance {resource.id} is {state}")
            result = self.client.stop_instances(InstanceIds=[resource.id])
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") == "InvalidInstanceID.NotFound":
                return ActionResult("gone", f"instance {resource.id} not found")
            return ActionResult("failed", f"EC2: {e}")
        except BotoCoreError as e:
            return ActionResult("failed", f"EC2: {e}")
        new_state = result["StoppingInstances"][0]["CurrentState"]["Name"]
        return ActionResult("stopped", f"instance {resource.id} {new_state}")
