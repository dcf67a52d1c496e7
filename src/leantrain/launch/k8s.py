"""Kubernetes manifests for `leantrain launch --emit k8s`: a Kubeflow PyTorchJob plus what it needs.

One multi-document YAML file:
1. a ConfigMap holding the parsed spec (profile and overrides applied, paths rewritten to the pod's mounts;
   secrets stay `${VAR}` references),
2. the PyTorchJob (kubeflow.org/v1, training-operator ≥ 1.7): Worker replicas only with an `elasticPolicy`
   (c10d rendezvous, min/max replicas, max restarts) — the operator injects torchrun's PET_* settings;
   gang scheduling through `runPolicy.schedulingPolicy.minAvailable` and the gang scheduler's name (all pods
   of the minimum set start together or none do; the operator must run with `--gang-scheduler-name`);
   every env var the spec references (`${VAR}` anywhere, the webhook URL's variable) from one Secret; NCCL
   fabric variables (launch/fabric.py); PVCs for data and run dirs; an in-memory /dev/shm; node-local staging
   in an init container when `cluster.data_url` is set; GPUs/CPU/memory from the plan (with spare), RDMA NICs
   and IPC_LOCK when asked; excluded hosts kept away by node affinity; rank 0's Prometheus port exposed as
   `metrics` with scrape annotations; the pod's console teed to `RUN_DIR/logs/pod-<pod>.log`; a job its ranks
   refuse (exit 2) is not started again by its pods' restarts (`RUN_DIR/logs/refused-<job>.json`). The job's name
   carries a random suffix (each submission is a new job); the run dir is named after the run, so a new job
   resumes the old one's checkpoints,
3. a DaemonSet that pre-pulls the training image on every GPU node, so a restart does not wait on a pull,
4. with `cluster.k8s_pod_monitor`, a prometheus-operator PodMonitor.
`setup_documents` gives the PVCs and the Secret template, which `--emit k8s` writes beside the job
(`<job>.setup.yaml`): apply them once, before the job.
"""

from __future__ import annotations

import secrets
import shlex
from pathlib import Path
from typing import Any

import yaml

from leantrain.errors import REFUSAL_ENV
from leantrain.launch.fabric import nccl_env
from leantrain.launch.health import NODE_NAME_ENV, excluded_hosts
from leantrain.launch.job_spec import frozen_spec_document, job_image, referenced_env_names, staging_env_names
from leantrain.launch.resources import TORCHRUN_ENV, JobResources, TrainCommand, job_name, job_resources, torchrun_args
from leantrain.launch.staging import is_remote
from leantrain.launch.torchrun import restarts as torchrun_restarts
from leantrain.spec import JobSpec

SPEC_MOUNT = "/etc/leantrain"
DATA_MOUNT = "/mnt/data"
RUNS_MOUNT = "/mnt/runs"
LOCAL_MOUNT = "/mnt/local"
SCHEDULERS = {"volcano": "volcano", "scheduler-plugins": "scheduler-plugins-scheduler"}
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
RUN_AS_UID = 1000  # the image's non-root `leantrain` user (docker/Dockerfile)
METRICS_PORT = 9464  # rank 0's Prometheus endpoint in the pod when the spec sets none (or 0: any free port)
POD_STARTED = "/dev/shm/.leantrain-pod-started"  # on the pod's /dev/shm volume: a container start that is not the first


def metrics_port(spec: JobSpec) -> int:
    return spec.monitoring.prometheus_port or METRICS_PORT


def pod_spec_document(
    spec: JobSpec, *, data_dir: str, run_dir: str, env_refs: dict[str, str] | None = None
) -> dict[str, Any]:
    """The spec as the pods load it: explicitly set fields only (defaults stay defaults), pod paths, and the
    spec file's `${VAR}` references kept as references."""
    doc = frozen_spec_document(spec, env_refs=env_refs)
    doc.setdefault("data", {})["dir"] = data_dir
    doc.setdefault("run", {})["dir"] = run_dir
    if spec.run.registry is not None:
        doc["run"]["registry"] = f"{RUNS_MOUNT}/runs.db"
    doc.setdefault("monitoring", {})["prometheus_port"] = metrics_port(spec)  # a fixed port the scraper knows
    return doc


def _secret_env(spec: JobSpec, env_refs: dict[str, str] | None = None) -> list[dict[str, Any]]:
    names = sorted(referenced_env_names(spec, env_refs))
    env = [{"name": n, "valueFrom": {"secretKeyRef": {"name": spec.cluster.k8s_secret_name, "key": n}}} for n in names]
    env += [
        {"name": n, "valueFrom": {"secretKeyRef": {"name": spec.cluster.k8s_secret_name, "key": n, "optional": True}}}
        for n in staging_env_names(spec) if n not in names
    ]
    return env


def _resources(res: JobResources, spec: JobSpec) -> dict[str, Any]:
    amounts = {"cpu": str(res.cpus_per_node), "memory": f"{res.memory_gib_per_node}Gi"}
    if res.gpu_resource:
        amounts[res.gpu_resource] = str(res.gpus_per_node)
    if spec.cluster.k8s_rdma_resource:
        amounts[spec.cluster.k8s_rdma_resource] = str(spec.cluster.k8s_rdma_per_node)
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


def _storage(
    spec: JobSpec, *, name: str, data_dir: str, image: str, env_refs: dict[str, str] | None = None
) -> tuple[list[Any], list[Any], list[Any]]:
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
    init = {"name": "stage-data", "image": image, "imagePullPolicy": "IfNotPresent", "command": stage,
            "env": _secret_env(spec, env_refs), "volumeMounts": [{"name": "local", "mountPath": LOCAL_MOUNT}]}
    return volumes, mounts, [init]


def _container_script(spec: JobSpec, *, res: JobResources, name: str, max_restarts: int, run_dir: str) -> str:
    """Preflight then training, both under torchrun; the operator's PET_* env supplies the rendezvous. The
    preflight gets its own rendezvous id so it cannot be confused with the training rendezvous.

    A rank that refuses the job (errors.record_refusal) writes why to the Job's refusal file (`refusal_file`):
    torchrun's restarts then refuse at once, the container exits 2 (not torchrun's 1), and a restart of the
    container (`OnFailure`, `Always`) by any pod of the Job refuses at once, before preflight and torchrun. A
    pod's first start removes a file left by an earlier Job of the same name (the file applied again after a
    fix): POD_STARTED, on the pod's /dev/shm volume, survives its container's restarts and no more. (A pod that
    first starts after the refusal, one beyond an elastic job's minimum or one the operator recreated, removes it
    too: the Job's next start then runs torchrun once more, and its ranks refuse again.) torchrun runs under
    launch.node_run (rank logs in RUN_DIR/logs/<pod>/, a crash of the node recorded in node_health.json, which the
    next `--emit` keeps the pods away from) as bash's child, not exec'd: SIGTERM (the pod's termination) is passed
    on to it, so the trainer checkpoints."""
    spec_args = TrainCommand(spec_path=Path(f"{SPEC_MOUNT}/spec.yaml")).spec_args(run_dir=run_dir)
    train_rdzv = torchrun_args(res, max_restarts=max_restarts, rdzv_endpoint=None, rdzv_id=None)
    train = shlex.join(["python", "-m", "leantrain.launch.node_run", run_dir, "--forward-signals", "--", "torchrun",
                        *train_rdzv, "-m", "leantrain.cli", "train", *spec_args])
    refused = (f'echo "leantrain: the ranks refused job {name} (not started again; fix the input and apply the job '
               f'again): $(cat "${REFUSAL_ENV}")"; exit 2')
    lines = [
        "set -eu" if spec.cluster.preflight else "set -u",
        "umask 077",
        "# The pod's console also goes to the run dir, where validate and doctor read it (logs/pod-<pod>.log).",
        f'mkdir -p {run_dir}/logs; exec > >(tee -a "{run_dir}/logs/pod-$HOSTNAME.log") 2>&1',
        "# A rank that refuses the job writes why here, one file for every pod of this Job.",
        f'export {REFUSAL_ENV}="{refusal_file(name, run_dir=run_dir)}"',
        f"if [ -e {POD_STARTED} ]; then  # a restart of this pod's container: refuse at once what the Job refused",
        f'  if [ -f "${REFUSAL_ENV}" ]; then {refused}; fi',
        "else  # this pod's first start: a file left by an earlier Job of this name is not this Job's",
        f'  rm -f "${REFUSAL_ENV}"; touch {POD_STARTED}',
        "fi",
    ]
    if spec.cluster.preflight:
        pre_rdzv = torchrun_args(res, max_restarts=0, rdzv_endpoint=None, rdzv_id=f"preflight-{name}")
        lines.append(shlex.join(["torchrun", *pre_rdzv, "-m", "leantrain.launch.preflight_worker", *spec_args,
                                 "--expected-world-size", str(res.min_nodes * res.gpus_per_node),
                                 "--timeout-s", str(int(spec.cluster.preflight_timeout_s))]))
    return "\n".join([
        *lines,
        "TRAIN_PID=  # the pod's SIGTERM goes on to torchrun (the trainer checkpoints)",
        "trap '[ -z \"$TRAIN_PID\" ] || kill -TERM \"$TRAIN_PID\" 2>/dev/null || true' TERM INT",
        f"{train} &",
        "TRAIN_PID=$!",
        "STATUS=0",
        "while :; do  # a trapped signal interrupts `wait`: wait again for the real exit status",
        '  if wait "$TRAIN_PID"; then CODE=0; else CODE=$?; fi',
        '  if [ "$CODE" -eq 127 ]; then break; fi  # already reported: STATUS holds it',
        "  STATUS=$CODE",
        '  if [ "$CODE" -le 128 ] || ! kill -0 "$TRAIN_PID" 2>/dev/null; then break; fi',
        "done",
        f'if [ "$STATUS" -ne 0 ] && [ -f "${REFUSAL_ENV}" ]; then {refused}; fi',
        'exit "$STATUS"',
    ])


def refusal_file(name: str, *, run_dir: str) -> str:
    """The refusal file of the Job `name` (every pod's, every container start's): a new Job (a new `--emit`) has
    a new name, so it is not refused by an earlier Job's file."""
    return f"{run_dir}/logs/refused-{name}.json"


def _pod_spec(
    spec: JobSpec, *, res: JobResources, name: str, run_name: str, max_restarts: int, run_dir: Path | None,
    image: str, env_refs: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The Worker pods: one training container, gang scheduler, non-root, GPU tolerations, bad hosts avoided."""
    cluster = spec.cluster
    data_dir = f"{LOCAL_MOUNT}/data" if is_remote(cluster.data_url) else DATA_MOUNT
    volumes, mounts, init_containers = _storage(spec, name=name, data_dir=data_dir, image=image, env_refs=env_refs)
    env = [{"name": k, "value": v} for k, v in {**TORCHRUN_ENV, **nccl_env(spec)}.items()]
    env += [{"name": "LEANTRAIN_IMAGE", "value": image}, *_secret_env(spec, env_refs),
            {"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]  # node_health.json
    container = {
        "name": "pytorch",  # the operator looks for this container name
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["bash", "-c", _container_script(spec, res=res, name=name, max_restarts=max_restarts,
                                                    run_dir=f"{RUNS_MOUNT}/{run_name}")],
        "env": env,
        "ports": [{"name": "pytorchjob-port", "containerPort": cluster.rdzv_port},
                  {"name": "metrics", "containerPort": metrics_port(spec)}],
        "resources": _resources(res, spec),
        "volumeMounts": mounts,
    }
    if cluster.k8s_rdma_resource or cluster.k8s_ipc_lock:  # RDMA pins memory: the verbs need IPC_LOCK
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": cluster.checkpoint_signal_s,  # SIGTERM leaves time to checkpoint
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_UID, "fsGroup": RUN_AS_UID},
        "containers": [container],
        "volumes": volumes,
        "tolerations": _gpu_tolerations(res),
    }
    if cluster.k8s_gang_scheduler != "none":
        pod_spec["schedulerName"] = SCHEDULERS[cluster.k8s_gang_scheduler]
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if (affinity := _affinity(excluded_hosts(run_dir, crash_threshold=cluster.unhealthy_after_crashes))) is not None:
        pod_spec["affinity"] = affinity
    if cluster.k8s_priority_class:
        pod_spec["priorityClassName"] = cluster.k8s_priority_class
    if cluster.k8s_node_selector:
        pod_spec["nodeSelector"] = dict(cluster.k8s_node_selector)
    return pod_spec


def unique_job_name(spec: JobSpec, *, job_id: str | None = None, source: Path | None = None) -> str:
    """The run's name plus a short random suffix: every submission is its own PyTorchJob (a second `kubectl
    apply` of the same run would otherwise collide with, or silently reconfigure, the first). A DNS-1035 label of
    at most 50 characters (63 allowed)."""
    return f"{job_name(spec, source=source)[:43].rstrip('-')}-{job_id or secrets.token_hex(3)}"


def pytorch_job(
    spec: JobSpec, *, res: JobResources, max_restarts: int, run_dir: Path | None = None, job_id: str | None = None,
    env_refs: dict[str, str] | None = None, image: str | None = None, source: Path | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ConfigMap, PyTorchJob) for this spec. The run dir on the PVC is named after the run, not the job, so a
    resubmitted job resumes from the same checkpoints."""
    cluster = spec.cluster
    run_name = job_name(spec, source=source)
    name = unique_job_name(spec, job_id=job_id, source=source)
    data_dir = f"{LOCAL_MOUNT}/data" if is_remote(cluster.data_url) else DATA_MOUNT
    pod_document = pod_spec_document(spec, data_dir=data_dir, run_dir=f"{RUNS_MOUNT}/{run_name}", env_refs=env_refs)
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
    image = image or job_image(spec, dry_run=False, why="a Kubernetes job")
    pod_spec = _pod_spec(spec, res=res, name=name, run_name=run_name, max_restarts=max_restarts, run_dir=run_dir,
                         image=image, env_refs=env_refs)
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics_port(spec)),
              "prometheus.io/path": "/metrics"}
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
            # a failed job's pods still running are deleted (their GPUs freed; under `Never` the operator fails
            # the job at its first failed pod while the others train on); finished pods and their logs stay
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": max_restarts, "schedulingPolicy": scheduling},
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": res.num_nodes,
                    "restartPolicy": cluster.k8s_restart_policy,
                    "template": {"metadata": {"labels": _labels(name), "annotations": scrape}, "spec": pod_spec},
                }
            },
        },
    }
    return config_map, job


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "leantrain", "app.kubernetes.io/instance": name}


def pod_monitor(spec: JobSpec, *, name: str) -> dict[str, Any]:
    """A prometheus-operator PodMonitor scraping the job's pods on the `metrics` port."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": name, "namespace": spec.cluster.k8s_namespace, "labels": _labels(name)},
        "spec": {"selector": {"matchLabels": _labels(name)},
                 "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]},
    }


def data_loader_name(spec: JobSpec) -> str:
    return f"{spec.cluster.k8s_data_pvc}-loader"[:63]


def data_load_commands(spec: JobSpec, *, data_dir: str) -> list[str]:
    """The copy job for a data PVC: stream the prepared data dir into the loader pod, then remove the pod.
    Preflight then checks the manifest and every shard on every rank before training starts."""
    ns, pod = spec.cluster.k8s_namespace, data_loader_name(spec)
    return [f"kubectl -n {ns} wait --for=condition=Ready pod/{pod} --timeout=600s",
            f"tar -C {shlex.quote(data_dir)} -cf - . | kubectl -n {ns} exec -i {pod} -- tar -C {DATA_MOUNT} -xf -",
            f"kubectl -n {ns} exec {pod} -- test -s {DATA_MOUNT}/manifest.json",
            f"kubectl -n {ns} delete pod {pod}"]


def _data_loader_pod(spec: JobSpec, *, image: str) -> dict[str, Any]:
    """A small non-root pod that mounts the data PVC read-write for the copy (data_load_commands), then is deleted;
    it ends itself after an hour."""
    cluster = spec.cluster
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": data_loader_name(spec), "namespace": cluster.k8s_namespace,
                     "labels": {"app.kubernetes.io/name": "leantrain-data-loader"}},
        "spec": {
            "restartPolicy": "Never", "activeDeadlineSeconds": 3600,
            "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_UID, "fsGroup": RUN_AS_UID},
            "containers": [{"name": "loader", "image": image, "imagePullPolicy": "IfNotPresent",
                            "command": ["sleep", "3600"],
                            "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                                          "limits": {"cpu": "2", "memory": "2Gi"}},
                            "volumeMounts": [{"name": "data", "mountPath": DATA_MOUNT}]}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": cluster.k8s_data_pvc}}],
        },
    }


def setup_documents(
    spec: JobSpec, *, env_refs: dict[str, str] | None = None, dry_run: bool = False
) -> list[dict[str, Any]]:
    """What the job needs to exist first, applied once per namespace: the data PVC (ReadWriteMany: the loader
    pod fills it, every training pod mounts it read-only) with the loader pod, unless `cluster.data_url` is
    staged by each pod's init container; the run-dir PVC (ReadWriteMany: every pod writes checkpoints and
    logs); and the Secret with every env var the spec references, as `${VAR}` placeholders for `envsubst` (no
    secret value is ever written)."""
    cluster = spec.cluster

    def claim(name: str, mode: str, size_gb: int) -> dict[str, Any]:
        claim_spec: dict[str, Any] = {"accessModes": [mode], "resources": {"requests": {"storage": f"{size_gb}Gi"}}}
        if cluster.k8s_storage_class:
            claim_spec["storageClassName"] = cluster.k8s_storage_class
        return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": name, "namespace": cluster.k8s_namespace}, "spec": claim_spec}

    docs = [claim(cluster.k8s_checkpoint_pvc, "ReadWriteMany", cluster.k8s_checkpoint_pvc_gb)]
    if not is_remote(cluster.data_url):
        image = job_image(spec, dry_run=dry_run, why="the data loader pod")
        docs[:0] = [claim(cluster.k8s_data_pvc, "ReadWriteMany", cluster.k8s_data_pvc_gb),
                    _data_loader_pod(spec, image=image)]
    names = sorted(referenced_env_names(spec, env_refs))
    if names:
        docs.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                     "metadata": {"name": cluster.k8s_secret_name, "namespace": cluster.k8s_namespace},
                     "stringData": {n: f"${{{n}}}" for n in names}})
    return docs


def prepull_daemonset(
    *, image: str, namespace: str = "default", gpu_resource: str | None = "nvidia.com/gpu", run: str | None = None,
    node_selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A DaemonSet whose init container pulls `image` on every (GPU) node and exits; a pause container keeps
    the pod alive at ~no cost, so the image stays cached and a restarted training pod starts at once. With `run`
    (the run's name) it is the run's own (`<run>-prepull`, selected by its run label): one name for every job
    made the last job applied set every job's image, and deleting one job's file took it from all of them.
    It runs on the nodes `node_selector` names (`cluster.k8s_node_selector`, the training pods' too), else with
    NVIDIA GPUs on those GPU feature discovery labels `nvidia.com/gpu.present` (not every CPU node)."""
    labels = {"app.kubernetes.io/name": "leantrain-image-prepull", **({"leantrain.io/run": run} if run else {})}
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
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    elif gpu_resource == "nvidia.com/gpu":
        pod_spec["nodeSelector"] = {"nvidia.com/gpu.present": "true"}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": f"{run[:48].rstrip('-')}-prepull" if run else "leantrain-image-prepull",
                     "namespace": namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def k8s_documents(
    spec: JobSpec, *, run_dir: Path | None = None, nnodes: str | None = None, nproc: int | None = None,
    max_restarts: int | None = None, job_id: str | None = None, env_refs: dict[str, str] | None = None,
    dry_run: bool = False, source: Path | None = None,
) -> list[dict[str, Any]]:
    """[ConfigMap, PyTorchJob, DaemonSet] and, with cluster.k8s_pod_monitor, a PodMonitor. `cluster.image` is
    required (with `dry_run`, a placeholder stands in)."""
    res = job_resources(spec, nnodes=nnodes, nproc=nproc)
    restarts = torchrun_restarts(spec, max_restarts)  # 0 when fault.auto_restart is off, as for a local launch
    image = job_image(spec, dry_run=dry_run, why="a Kubernetes job")
    config_map, job = pytorch_job(spec, res=res, max_restarts=restarts, run_dir=run_dir, job_id=job_id,
                                  env_refs=env_refs, image=image, source=source)
    daemonset = prepull_daemonset(image=image, namespace=spec.cluster.k8s_namespace,
                                  gpu_resource=res.gpu_resource, run=job_name(spec, source=source),
                                  node_selector=spec.cluster.k8s_node_selector)
    docs = [config_map, job, daemonset]
    if spec.cluster.k8s_pod_monitor:
        docs.append(pod_monitor(spec, name=job["metadata"]["name"]))
    return docs


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
