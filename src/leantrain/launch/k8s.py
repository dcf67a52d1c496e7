"""Kubernetes manifests for `leantrain launch --emit k8s`: a Kubeflow PyTorchJob plus what it needs.

One multi-document YAML file:
1. a ConfigMap holding the parsed spec (profile and overrides applied, paths rewritten to the pod's mounts;
   secrets stay `${VAR}` references),
2. the PyTorchJob (kubeflow.org/v1, training-operator ≥ 1.7): Worker replicas only with an `elasticPolicy`
   (c10d rendezvous, min/max replicas, max restarts) — the operator injects torchrun's PET_* settings;
   gang scheduling through `runPolicy.schedulingPolicy.minAvailable` and the gang scheduler's name (all pods
   of the minimum set start together or none do; the operator must run with `--gang-scheduler-name`);
   secrets as env vars from one Kubernetes Secret; PVCs for data and run dirs; an in-memory /dev/shm;
   node-local staging in an init container when `cluster.data_url` is set; GPUs/CPU/memory from the plan;
   excluded hosts kept away by node affinity,
3. a DaemonSet that pre-pulls the training image on every GPU node, so a restart does not wait on a pull.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml

from leantrain.launch.health import excluded_hosts
from leantrain.launch.resources import TORCHRUN_ENV, JobResources, TrainCommand, job_name, job_resources, torchrun_args
from leantrain.launch.staging import is_remote
from leantrain.security import spec_secret_env_names
from leantrain.spec import JobSpec

SPEC_MOUNT = "/etc/leantrain"
DATA_MOUNT = "/mnt/data"
RUNS_MOUNT = "/mnt/runs"
LOCAL_MOUNT = "/mnt/local"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
RUN_AS_UID = 1000  # the image's non-root `leantrain` user (docker/Dockerfile)


def pod_spec_document(spec: JobSpec, *, data_dir: str, run_dir: str) -> dict[str, Any]:
    """The spec as the pods load it: explicitly set fields only (defaults stay defaults), pod paths."""
    doc = spec.model_dump(mode="json", exclude_unset=True, exclude={"profiles"})
    doc.setdefault("data", {})["dir"] = data_dir
    doc.setdefault("run", {})["dir"] = run_dir
    if spec.run.registry is not None:
        doc["run"]["registry"] = f"{RUNS_MOUNT}/runs.db"
    return doc


def _secret_env(spec: JobSpec) -> list[dict[str, Any]]:
    names = sorted(spec_secret_env_names(spec))
    env = [{"name": n, "valueFrom": {"secretKeyRef": {"name": spec.cluster.k8s_secret_name, "key": n}}} for n in names]
    if spec.cluster.data_url and spec.cluster.data_url.startswith("s3://"):
        env += [
            {"name": n, "valueFrom": {"secretKeyRef": {"name": spec.cluster.k8s_secret_name, "key": n,
                                                       "optional": True}}}
            for n in S3_ENV if n not in names
        ]
    return env


def _resources(res: JobResources) -> dict[str, Any]:
    amounts = {"cpu": str(res.cpus_per_node), "memory": f"{res.memory_gb_per_node}Gi"}
    if res.gpu_resource:
        amounts[res.gpu_resource] = str(res.gpus_per_node)
    return {"limits": dict(amounts), "requests": dict(amounts)}


def _affinity(hosts: list[str]) -> dict[str, Any] | None:
    if not hosts:
        return None
    term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": hosts}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def _gpu_tolerations(res: JobResources) -> list[dict[str, Any]]:
    if not res.gpu_resource:
        return []
    return [{"key": res.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}]


def _storage(spec: JobSpec, *, name: str, data_dir: str) -> tuple[list[Any], list[Any], list[Any]]:
    """(volumes, training container mounts, init containers): spec, runs PVC, /dev/shm, and the data either
    on its PVC or staged by an init container into node-local disk."""
    cluster = spec.cluster
    mounts: list[dict[str, Any]] = [
        {"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True},
        {"name": "runs", "mountPath": RUNS_MOUNT},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "spec", "configMap": {"name": f"{name}-spec"}},
        {"name": "runs", "persistentVolumeClaim": {"claimName": cluster.k8s_checkpoint_pvc}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{cluster.k8s_shm_gb}Gi"}},
    ]
    if not is_remote(cluster.data_url):
        mounts.append({"name": "data", "mountPath": DATA_MOUNT, "readOnly": True})
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": cluster.k8s_data_pvc,
                                                                  "readOnly": True}})
        return volumes, mounts, []
    mounts.append({"name": "local", "mountPath": LOCAL_MOUNT})
    volumes.append({"name": "local", "emptyDir": {}})
    stage = ["python", "-m", "leantrain.launch.staging", str(cluster.data_url), data_dir]
    if cluster.data_endpoint_url:
        stage += ["--endpoint-url", cluster.data_endpoint_url]
    init = {"name": "stage-data", "image": cluster.image, "imagePullPolicy": "IfNotPresent", "command": stage,
            "env": _secret_env(spec), "volumeMounts": [{"name": "local", "mountPath": LOCAL_MOUNT}]}
    return volumes, mounts, [init]


def _container_script(spec: JobSpec, *, res: JobResources, name: str, max_restarts: int, run_dir: str) -> str:
    """Preflight then training, both under torchrun; the operator's PET_* env supplies the rendezvous. The
    preflight gets its own rendezvous id so it cannot be confused with the training rendezvous."""
    spec_args = TrainCommand(spec_path=Path(f"{SPEC_MOUNT}/spec.yaml")).spec_args(run_dir=run_dir)
    train_rdzv = torchrun_args(res, max_restarts=max_restarts, rdzv_endpoint=None, rdzv_id=None)
    train = shlex.join(["torchrun", *train_rdzv, "-m", "leantrain.cli", "train", *spec_args])
    if not spec.cluster.preflight:
        return f"umask 077; exec {train}"
    pre_rdzv = torchrun_args(res, max_restarts=0, rdzv_endpoint=None, rdzv_id=f"preflight-{name}")
    preflight = shlex.join(["torchrun", *pre_rdzv, "-m", "leantrain.launch.preflight_worker", *spec_args,
                            "--expected-world-size", str(res.min_nodes * res.gpus_per_node),
                            "--timeout-s", str(int(spec.cluster.preflight_timeout_s))])
    return f"set -eu; umask 077; {preflight} && exec {train}"


def _pod_spec(
    spec: JobSpec, *, res: JobResources, name: str, max_restarts: int, run_dir: Path | None
) -> dict[str, Any]:
    """The Worker pods: one training container, gang scheduler, non-root, GPU tolerations, bad hosts avoided."""
    cluster = spec.cluster
    data_dir = f"{LOCAL_MOUNT}/data" if is_remote(cluster.data_url) else DATA_MOUNT
    volumes, mounts, init_containers = _storage(spec, name=name, data_dir=data_dir)
    env = [{"name": k, "value": v} for k, v in TORCHRUN_ENV.items()]
    env += [{"name": "LEANTRAIN_IMAGE", "value": cluster.image}, *_secret_env(spec)]
    container = {
        "name": "pytorch",  # the operator looks for this container name
        "image": cluster.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["bash", "-c", _container_script(spec, res=res, name=name, max_restarts=max_restarts,
                                                    run_dir=f"{RUNS_MOUNT}/{name}")],
        "env": env,
        "ports": [{"name": "pytorchjob-port", "containerPort": cluster.rdzv_port}],
        "resources": _resources(res),
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "schedulerName": "volcano" if cluster.k8s_gang_scheduler == "volcano" else "scheduler-plugins-scheduler",
        "terminationGracePeriodSeconds": cluster.checkpoint_signal_s,  # SIGTERM leaves time to checkpoint
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_UID, "fsGroup": RUN_AS_UID},
        "containers": [container],
        "volumes": volumes,
        "tolerations": _gpu_tolerations(res),
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if (affinity := _affinity(excluded_hosts(run_dir, crash_threshold=cluster.unhealthy_after_crashes))) is not None:
        pod_spec["affinity"] = affinity
    if cluster.k8s_priority_class:
        pod_spec["priorityClassName"] = cluster.k8s_priority_class
    return pod_spec


def pytorch_job(
    spec: JobSpec, *, res: JobResources, max_restarts: int, run_dir: Path | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ConfigMap, PyTorchJob) for this spec."""
    cluster = spec.cluster
    name = job_name(spec)
    data_dir = f"{LOCAL_MOUNT}/data" if is_remote(cluster.data_url) else DATA_MOUNT
    pod_document = pod_spec_document(spec, data_dir=data_dir, run_dir=f"{RUNS_MOUNT}/{name}")
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-spec", "namespace": cluster.k8s_namespace, "labels": _labels(name)},
        "data": {"spec.yaml": yaml.safe_dump(pod_document, sort_keys=False)},
    }
    scheduling: dict[str, Any] = {"minAvailable": res.min_nodes, "scheduleTimeoutSeconds": 600}
    if cluster.k8s_queue:
        scheduling["queue"] = cluster.k8s_queue
    if cluster.k8s_priority_class:
        scheduling["priorityClass"] = cluster.k8s_priority_class
    pod_spec = _pod_spec(spec, res=res, name=name, max_restarts=max_restarts, run_dir=run_dir)
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": cluster.k8s_namespace, "labels": _labels(name)},
        "spec": {
            "nprocPerNode": str(res.gpus_per_node),
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "rdzvId": name,
                "rdzvPort": cluster.rdzv_port,
                "minReplicas": res.min_nodes,
                "maxReplicas": res.max_nodes,
                "maxRestarts": max_restarts,
            },
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": max_restarts, "schedulingPolicy": scheduling},
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": res.num_nodes,
                    "restartPolicy": cluster.k8s_restart_policy,
                    "template": {"metadata": {"labels": _labels(name)}, "spec": pod_spec},
                }
            },
        },
    }
    return config_map, job


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "leantrain", "app.kubernetes.io/instance": name}


def prepull_daemonset(
    *, image: str, namespace: str = "default", gpu_resource: str | None = "nvidia.com/gpu"
) -> dict[str, Any]:
    """A DaemonSet whose init container pulls `image` on every (GPU) node and exits; a pause container keeps
    the pod alive at ~no cost, so the image stays cached and a restarted training pod starts at once."""
    labels = {"app.kubernetes.io/name": "leantrain-image-prepull"}
    pod_spec: dict[str, Any] = {
        "initContainers": [{"name": "prepull", "image": image, "imagePullPolicy": "IfNotPresent",
                            "command": ["true"], "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}],
        "containers": [{"name": "pause", "image": PAUSE_IMAGE,
                        "resources": {"requests": {"cpu": "1m", "memory": "8Mi"},
                                      "limits": {"cpu": "10m", "memory": "16Mi"}}}],
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65534},
    }
    if gpu_resource:
        pod_spec["tolerations"] = [{"key": gpu_resource, "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "leantrain-image-prepull", "namespace": namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def k8s_documents(
    spec: JobSpec, *, run_dir: Path | None = None, nnodes: str | None = None, nproc: int | None = None,
    max_restarts: int | None = None,
) -> list[dict[str, Any]]:
    """[ConfigMap, PyTorchJob, DaemonSet]."""
    res = job_resources(spec, nnodes=nnodes, nproc=nproc)
    restarts = spec.fault.max_restarts if max_restarts is None else max_restarts
    config_map, job = pytorch_job(spec, res=res, max_restarts=restarts, run_dir=run_dir)
    daemonset = prepull_daemonset(image=spec.cluster.image, namespace=spec.cluster.k8s_namespace,
                                  gpu_resource=res.gpu_resource)
    return [config_map, job, daemonset]


class _ManifestDumper(yaml.SafeDumper):
    """Plain YAML for kubectl readers: no &anchors/*aliases, multi-line strings as `|` blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ManifestDumper.add_representer(str, _str_representer)


def k8s_yaml(documents: list[dict[str, Any]]) -> str:
    header = "# Written by `leantrain launch --emit k8s`; regenerate it from the spec instead of editing.\n"
    return header + yaml.dump_all(documents, Dumper=_ManifestDumper, sort_keys=False)
