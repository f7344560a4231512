"""Kubernetes objects for a vime run over several pods (``python -m vime.launch k8s ... > job.yaml``).

Printed for ``kubectl apply -f job.yaml``, in this order:

* a Secret holding the join token, made at launch (each launch its own); both Jobs read it into ``VIME_TOKEN``;
* a headless Service naming the head pod, which the agents join through (published before the pod is ready:
  the agents wait for the driver's port themselves);
* the head, a Job of one pod running the driver, listening on its pod's address (pods reach each other
  directly, which the actors need: each listens on a port of its own);
* with more than one node, the node agents, an Indexed Job of nodes - 1 pods, each named for its index,
  which wait in an init container until the driver listens (a joiner gives up after 30 s; a driver may take
  minutes to build its model).

The run folder is a volume at ``RUN_ROOT`` in the head pod: a PersistentVolumeClaim (``--pvc``) to keep it,
else an emptyDir that goes with the pod. Every pod asks for ``--gpus-per-node`` ``nvidia.com/gpu``.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

import yaml

from vime.launch import Scenario, check_counts, driver_args

RUN_ROOT = "/vime-runs"
WAIT_FOR_HEAD = ("import socket, sys, time\n"
                 "while True:\n"
                 "    try:\n"
                 "        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()\n"
                 "        break\n"
                 "    except OSError:\n"
                 "        time.sleep(2)\n")


@dataclasses.dataclass(frozen=True)
class KubernetesJob:
    """One launch's choices."""

    nodes: int
    gpus_per_node: int
    scenario: Scenario
    image: str
    job_name: str
    python: str = "python"
    namespace: str | None = None
    port: int = 29500
    pvc: str | None = None


def manifests(job: KubernetesJob) -> list[dict[str, Any]]:
    """The objects, in the order they are applied; ValueError for a job that cannot run."""
    check_counts(job.nodes, job.gpus_per_node)
    if job.scenario.resumed:
        raise ValueError("--resume: vime.launch k8s starts new runs only (the run folder is the pod's volume); "
                         "resume from the pod with python -m vime.scenario --resume")
    objects = [_secret(job), _service(job), _head(job)]
    if job.nodes > 1:
        objects.append(_agents(job))
    return objects


def render(job: KubernetesJob) -> str:
    """The objects as one YAML stream."""
    return yaml.safe_dump_all(manifests(job), sort_keys=False)


def _metadata(job: KubernetesJob, name: str, component: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "vime",
                                                         "app.kubernetes.io/instance": job.job_name,
                                                         "app.kubernetes.io/component": component}}
    if job.namespace:
        metadata["namespace"] = job.namespace
    return metadata


def _secret(job: KubernetesJob) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _metadata(job, f"{job.job_name}-token", "token"),
            "type": "Opaque", "stringData": {"token": secrets.token_hex(16)}}


def _service(job: KubernetesJob) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(job, f"{job.job_name}-head", "head"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": _metadata(job, "", "head")["labels"],
                     "ports": [{"name": "driver", "port": job.port, "targetPort": job.port}]}}


def _container(job: KubernetesJob, name: str, command: list[str], extra_env: list[dict[str, Any]]) -> dict[str, Any]:
    """A container of ``--image`` with the token in its environment and the node's GPUs."""
    token = {"name": "VIME_TOKEN", "valueFrom": {"secretKeyRef": {"name": f"{job.job_name}-token", "key": "token"}}}
    container: dict[str, Any] = {"name": name, "image": job.image, "command": command, "env": [token, *extra_env]}
    if job.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": job.gpus_per_node}}
    return container


def _head(job: KubernetesJob) -> dict[str, Any]:
    """The driver's Job: one pod, never restarted (a run continues with --resume, not from scratch)."""
    run_dir = f"{RUN_ROOT}/{job.job_name}"
    # $(POD_IP) is expanded by the kubelet from the container's environment
    command = [_literal(job.python), *map(_literal, driver_args(job.scenario, job.nodes)), "--host", "$(POD_IP)",
               "--port", str(job.port), "--out", run_dir]
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    container = _container(job, "driver", command, [pod_ip])
    container["ports"] = [{"name": "driver", "containerPort": job.port}]
    container["volumeMounts"] = [{"name": "runs", "mountPath": RUN_ROOT}]
    volume = ({"name": "runs", "persistentVolumeClaim": {"claimName": job.pvc}} if job.pvc
              else {"name": "runs", "emptyDir": {}})
    pod = {"metadata": {"labels": _metadata(job, "", "head")["labels"]},
           "spec": {"restartPolicy": "Never", "containers": [container], "volumes": [volume]}}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(job, f"{job.job_name}-head", "head"),
            "spec": {"backoffLimit": 0, "template": pod}}


def _literal(word: str) -> str:
    """A word of the user's as the kubelet passes it on: it expands ``$(NAME)`` in a command from the container's
    environment, and reads ``$$`` as one ``$``."""
    return word.replace("$", "$$")


def _agents(job: KubernetesJob) -> dict[str, Any]:
    """The node agents' Indexed Job: one pod per other node, named ``node-INDEX``."""
    head = f"{job.job_name}-head"
    index = {"name": "NODE_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
    command = [job.python, "-m", "vime.node", "--join", f"tcp://{head}:{job.port}", "--name", "node-$(NODE_INDEX)"]
    wait = {"name": "wait-for-driver", "image": job.image,
            "command": [job.python, "-c", WAIT_FOR_HEAD, head, str(job.port)]}
    pod = {"metadata": {"labels": _metadata(job, "", "node")["labels"]},
           "spec": {"restartPolicy": "Never", "initContainers": [wait],
                    "containers": [_container(job, "node", command, [index])]}}
    others = job.nodes - 1
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(job, f"{job.job_name}-nodes", "node"),
            "spec": {"completionMode": "Indexed", "completions": others, "parallelism": others, "backoffLimit": 0,
                     "template": pod}}
