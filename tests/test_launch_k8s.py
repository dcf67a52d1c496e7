"""Kubernetes manifests checked against the operators' schemas: the Kubeflow training-operator SDK's
PyTorchJob models and the Kubernetes client's ConfigMap/DaemonSet models (a manifest passes only when it
deserializes into the models and serializes back unchanged: an unknown or misspelled field would be dropped,
a missing required field or a wrong type raises), and every emitted object against the API server's schemas:
the PyTorchJob and PodMonitor CRDs' openAPIV3Schema (vendored in tests/schemas/, sources in the files) and
Kubernetes' own OpenAPI schemas (kubernetes-validate, strict)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from leantrain.launch.health import read_health, record_failure
from leantrain.launch.job_spec import PLACEHOLDER_IMAGE
from leantrain.launch.k8s import RUN_AS_UID, k8s_documents, k8s_yaml, prepull_daemonset
from leantrain.spec import load_spec, spec_from_dict

kubernetes_client = pytest.importorskip("kubernetes.client")
kubeflow_training = pytest.importorskip("kubeflow.training")

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "examples" / "seed-10b.yaml"
IMAGE_NAME = "registry.example.com/ml/leantrain@sha256:" + "0" * 64
IMAGE = f"cluster.image={IMAGE_NAME}"


def roundtrip(doc: dict[str, Any], model: str) -> Any:
    """Deserialize into the SDK model and back; the manifest must survive unchanged."""
    client = kubeflow_training.ApiClient() if model.startswith("KubeflowOrg") else kubernetes_client.ApiClient()
    obj = client._ApiClient__deserialize(doc, model)
    assert client.sanitize_for_serialization(obj) == doc
    return obj


def emitted(tmp_path: Path, *overrides: str) -> list[dict[str, Any]]:
    spec = load_spec(SEED, profile="rehearsal", overrides=[IMAGE, *overrides])
    text = k8s_yaml(k8s_documents(spec, run_dir=tmp_path))
    return list(yaml.safe_load_all(text))


def test_roundtrip_catches_a_misspelled_or_missing_field() -> None:
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "x"},
           "spec": {"pytorchReplicaSpecs": {}, "runPolicy": {"backoffLimit": 1}}}
    roundtrip(job, "KubeflowOrgV1PyTorchJob")
    with pytest.raises(AssertionError):
        roundtrip({**job, "spec": {**job["spec"], "elasticPolice": {"minReplicas": 1}}}, "KubeflowOrgV1PyTorchJob")
    with pytest.raises(ValueError, match="run_policy"):
        roundtrip({**job, "spec": {"pytorchReplicaSpecs": {}}}, "KubeflowOrgV1PyTorchJob")


def test_pytorchjob_matches_operator_schema_gang_elastic_volumes_secrets_resources(tmp_path: Path) -> None:
    config_map, job_doc, daemonset = emitted(tmp_path, "fault.min_nodes=2", "fault.max_nodes=4",
                                             "fault.max_restarts=7", "cluster.k8s_queue=research")
    job = roundtrip(job_doc, "KubeflowOrgV1PyTorchJob")
    roundtrip(config_map, "V1ConfigMap")
    roundtrip(daemonset, "V1DaemonSet")

    elastic = job.spec.elastic_policy
    assert (elastic.min_replicas, elastic.max_replicas, elastic.rdzv_backend, elastic.max_restarts) == (2, 4, "c10d", 7)
    gang = job.spec.run_policy.scheduling_policy
    assert gang.min_available == 2 and gang.queue == "research"  # the minimum set starts together or not at all
    worker = job.spec.pytorch_replica_specs["Worker"]
    assert worker.replicas == 4 and worker.restart_policy == "OnFailure"
    pod = worker.template.spec
    assert pod.scheduler_name == "volcano"
    assert pod.security_context.run_as_non_root and pod.security_context.run_as_user == RUN_AS_UID
    (container,) = pod.containers
    assert container.name == "pytorch" and container.image == IMAGE_NAME
    assert container.resources.limits == {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8"}
    claims = {v.name: v.persistent_volume_claim.claim_name for v in pod.volumes if v.persistent_volume_claim}
    assert claims == {"runs": "leantrain-checkpoints", "data": "leantrain-data"}
    assert any(v.empty_dir and v.empty_dir.medium == "Memory" for v in pod.volumes)
    secret_refs = {e.name: e.value_from.secret_key_ref.name for e in container.env
                   if e.value_from and e.value_from.secret_key_ref}
    assert secret_refs == {"AWS_ACCESS_KEY_ID": "leantrain-secrets", "AWS_SECRET_ACCESS_KEY": "leantrain-secrets"}
    script = container.command[-1]
    assert "leantrain.launch.preflight_worker" in script and "leantrain.cli train /etc/leantrain/spec.yaml" in script
    assert script.index("preflight_worker") < script.index("leantrain.cli train")
    assert daemonset["spec"]["template"]["spec"]["initContainers"][0]["image"] == container.image


def test_configmap_spec_reloads_with_pod_paths_and_secret_references(tmp_path: Path) -> None:
    config_map, _, _ = emitted(tmp_path)
    raw = yaml.safe_load(config_map["data"]["spec.yaml"])
    assert raw["checkpoint"]["secret_key"] == "${AWS_SECRET_ACCESS_KEY}"
    assert "profiles" not in raw
    spec = spec_from_dict(raw, base_dir=Path("/"))
    assert str(spec.data.dir) == "/mnt/data" and str(spec.run.dir) == "/mnt/runs/run"
    assert spec.hardware.num_nodes == 4 and spec.parallelism.data_parallel == 4


def test_staged_data_uses_init_container_and_excluded_hosts_get_anti_affinity(tmp_path: Path) -> None:
    record_failure(tmp_path, host="gpu-node-3", kind="preflight", reason="nccl 2.18 (others 2.29)")
    _, job_doc, _ = emitted(tmp_path, "cluster.data_url=s3://bucket/prepared")
    job = roundtrip(job_doc, "KubeflowOrgV1PyTorchJob")
    pod = job.spec.pytorch_replica_specs["Worker"].template.spec
    (init,) = pod.init_containers
    assert init.command[-2:] == ["s3://bucket/prepared", "/mnt/local/data"]
    assert {e.name for e in init.env} >= {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert "data" not in {v.name for v in pod.volumes}
    term = pod.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms[0]
    expr = term.match_expressions[0]
    assert (expr.key, expr.operator, expr.values) == ("kubernetes.io/hostname", "NotIn", ["gpu-node-3"])
    # ... and what fails in a pod is recorded under its node's name, which that rule matches (a pod's hostname
    # is the pod's name: preflight recorded pods, and no node was ever kept away)
    (node,) = [e for e in pod.containers[0].env if e.name == "LEANTRAIN_NODE_NAME"]
    assert node.value_from.field_ref.field_path == "spec.nodeName"


def test_each_run_has_its_own_prepull_daemonset(tmp_path: Path) -> None:
    """Every job file named the same DaemonSet: applying a second run's file changed the first run's pre-pulled
    image, and deleting one run's file took it from all. It is the run's own, named and selected by the run."""
    first = emitted(tmp_path, "run.name=alpha")[2]
    second = emitted(tmp_path, "run.name=beta", "cluster.image=registry.example/other:2")[2]
    assert first["metadata"]["name"] == "alpha-prepull" and second["metadata"]["name"] == "beta-prepull"
    assert first["spec"]["selector"]["matchLabels"] != second["spec"]["selector"]["matchLabels"]
    assert first["spec"]["template"]["metadata"]["labels"] == first["spec"]["selector"]["matchLabels"]
    roundtrip(second, "V1DaemonSet")


def test_shipped_prepull_daemonset_is_what_the_code_emits() -> None:
    shipped = yaml.safe_load((REPO / "docker" / "prepull-daemonset.yaml").read_text())
    assert shipped == prepull_daemonset(image=PLACEHOLDER_IMAGE)  # the image to put in: docker/README.md
    roundtrip(shipped, "V1DaemonSet")


def test_every_referenced_env_var_metrics_port_fabric_and_rdma(tmp_path: Path) -> None:
    from leantrain.launch.job_spec import raw_env_references

    overrides = [IMAGE, "monitoring.webhook_url_env=ALERT_WEBHOOK_URL", "cluster.nccl_preset=roce",
                 "checkpoint.endpoint_url=${S3_ENDPOINT_URL:-https://s3.amazonaws.com}",
                 "cluster.k8s_rdma_resource=rdma/rdma_shared_device_a", "cluster.k8s_rdma_per_node=2"]
    spec = load_spec(SEED, profile="rehearsal", overrides=overrides)
    refs = raw_env_references(SEED, profile="rehearsal", overrides=overrides)
    config_map, job_doc, _ = k8s_documents(spec, run_dir=tmp_path, env_refs=refs)
    # The pods resolve the reference from their own environment, not the submit host's value.
    pod_spec = yaml.safe_load(config_map["data"]["spec.yaml"])
    assert pod_spec["checkpoint"]["endpoint_url"] == "${S3_ENDPOINT_URL:-https://s3.amazonaws.com}"
    job = roundtrip(job_doc, "KubeflowOrgV1PyTorchJob")
    template = job.spec.pytorch_replica_specs["Worker"].template
    (container,) = template.spec.containers
    from_secret = {e.name for e in container.env if e.value_from}
    assert {"ALERT_WEBHOOK_URL", "S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= from_secret
    values = {e.name: e.value for e in container.env if not e.value_from}
    assert values["NCCL_IB_GID_INDEX"] == "3" and values["NCCL_IB_DISABLE"] == "0"
    ports = {p.name: p.container_port for p in container.ports}
    assert ports["metrics"] == 9464
    assert template.metadata.annotations["prometheus.io/port"] == "9464"
    assert container.resources.limits["rdma/rdma_shared_device_a"] == "2"
    assert container.security_context.capabilities.add == ["IPC_LOCK"]
    assert "logs/pod-$HOSTNAME.log" in container.command[-1]
    plain = emitted(tmp_path)[1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert "securityContext" not in plain and not any(k.startswith("rdma/") for k in plain["resources"]["limits"])


def test_job_names_are_unique_and_the_run_dir_stays(tmp_path: Path) -> None:
    (cm1, job1, _), (cm2, job2, _) = emitted(tmp_path), emitted(tmp_path)
    assert job1["metadata"]["name"] != job2["metadata"]["name"]
    assert job1["metadata"]["name"].startswith("run-") and cm1["metadata"]["name"] != cm2["metadata"]["name"]
    run_dirs = {yaml.safe_load(cm["data"]["spec.yaml"])["run"]["dir"] for cm in (cm1, cm2)}
    assert run_dirs == {"/mnt/runs/run"}
    script = job1["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"][-1]
    assert "--run-dir /mnt/runs/run" in script
    # a refusing rank's reason goes to the Job's own file (every pod's; another job's name is another file)
    assert f'export LEANTRAIN_REFUSAL_FILE="/mnt/runs/run/logs/refused-{job1["metadata"]["name"]}.json"' in script


# A stand-in for torchrun on the container's PATH: records its arguments; preflight passes; training does what
# STUB_MODE says: a rank refuses the job (writes the refusal file the script exported, torchrun exits 1), crashes
# (an OOM kill of local rank 0, in torchrun's failure summary),
# passes, or runs until SIGTERM (passed on by the script: the trainer's checkpoint on the pod's termination).
TORCHRUN_STUB = """#!/bin/bash
echo "$*" >> "$STUB_CALLS"
case "$*" in *preflight_worker*) exit 0;; esac
case "$STUB_MODE" in
  refuse) echo '{"message": "data.dir /mnt/data has no manifest.json", "rank": "3"}' > "$LEANTRAIN_REFUSAL_FILE"
          exit 1;;
  crash) printf '%s\n' "Traceback (most recent call last):" '  File "run.py"' "torch.ChildFailedError: " "=====" \
          "Root Cause (first observed failure):" "[0]:" "  rank      : 5 (local_rank: 0)" "  exitcode  : -9 (pid: 3)" \
          "====="; exit 1;;
  term) sleep 30 & SLEEP=$!; trap 'kill $SLEEP; echo SIGTERM >> "$STUB_CALLS"; exit 143' TERM
        echo ready >> "$STUB_CALLS"; wait $SLEEP;;
esac
"""


@pytest.mark.parametrize("preflight", [True, False])
def test_a_refused_job_is_not_started_again_by_its_pods_restarts(tmp_path: Path, preflight: bool) -> None:
    """Kubernetes restarts a failed container (`OnFailure`, the default) up to the job's backoffLimit. The refusal
    file was named per container start and torchrun exited 1, so every restart was a full start of every rank
    into the same refusal. Now the container exits 2 when a rank of the Job refused it, and a restarted container
    of any pod of the Job refuses at once, before preflight and torchrun; a pod of a Job applied again under the
    same name (after a fix) starts as usual. The script runs here under bash with a stand-in torchrun."""
    import os
    import signal
    import subprocess
    import time

    from leantrain.launch.k8s import POD_STARTED

    _, job, _ = emitted(tmp_path / "emit", f"cluster.preflight={str(preflight).lower()}")
    name = job["metadata"]["name"]
    script = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"][-1]
    run_dir, stub_dir, calls = tmp_path / "runs" / "run", tmp_path / "bin", tmp_path / "calls"
    stub_dir.mkdir()
    (stub_dir / "torchrun").write_text(TORCHRUN_STUB)
    (stub_dir / "torchrun").chmod(0o755)
    refusal = run_dir / "logs" / f"refused-{name}.json"
    starts = 2 if preflight else 1  # torchrun runs of one container start that trains

    def container(pod: str, mode: str) -> subprocess.Popen[str]:
        """One start of the container of `pod` (its /dev/shm marker under tmp_path/pod)."""
        (tmp_path / pod).mkdir(exist_ok=True)
        text = script.replace("/mnt/runs/run", str(run_dir)).replace(POD_STARTED, str(tmp_path / pod / "started"))
        path = f"{stub_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"  # the image's python: leantrain's
        env = {**os.environ, "PATH": path, "STUB_MODE": mode, "STUB_CALLS": str(calls), "LEANTRAIN_NODE_NAME": "node-1"}
        return subprocess.Popen(["bash", "-c", text], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def run(pod: str, mode: str) -> tuple[int, str, int]:
        """(exit code, console, torchrun runs) of one container start."""
        before = len(calls.read_text().splitlines()) if calls.exists() else 0
        proc = container(pod, mode)
        out, _ = proc.communicate(timeout=60)
        return proc.returncode, out, len(calls.read_text().splitlines()) - before

    code, out, runs = run("pod-a", "refuse")  # pod a's first start: a rank refuses the job
    assert code == 2 and runs == starts, out
    assert f"the ranks refused job {name}" in out and "has no manifest.json" in out and refusal.is_file()
    code, out, runs = run("pod-a", "pass")  # its container restarted (OnFailure): refused at once
    assert code == 2 and runs == 0 and "has no manifest.json" in out, out
    (tmp_path / "pod-b").mkdir()
    (tmp_path / "pod-b" / "started").touch()  # pod b started with pod a; its container restarts after the refusal
    code, out, runs = run("pod-b", "pass")
    assert code == 2 and runs == 0, out
    code, out, runs = run("pod-a2", "pass")  # the same job file applied again after a fix: a new pod, trains
    assert code == 0 and runs == starts and not refusal.exists(), out
    code, out, runs = run("pod-a2", "crash")  # a crash is not a refusal: torchrun's exit code, restarts train
    assert code == 1 and runs == starts and "the ranks refused" not in out, out
    # recorded against the pod's node (launch.node_run), which the next --emit keeps the Job's pods away from
    assert read_health(run_dir)["node-1"].crashes == 1 and "node-1 crashed: rank 5 (local rank 0)" in out, out

    proc = container("pod-c", "term")  # the pod's termination: SIGTERM reaches torchrun (no longer exec'd)
    deadline = time.monotonic() + 30
    while "ready" not in (calls.read_text() if calls.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143 and calls.read_text().splitlines()[-1] == "SIGTERM", out


def test_pod_monitor_and_setup_manifests_pvc_and_secret(tmp_path: Path) -> None:
    from leantrain.launch.k8s import setup_documents

    docs = emitted(tmp_path, "cluster.k8s_pod_monitor=true", "cluster.k8s_gang_scheduler=none")
    monitor = docs[3]
    assert monitor["kind"] == "PodMonitor" and monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["selector"]["matchLabels"] == docs[1]["metadata"]["labels"]
    assert "schedulerName" not in docs[1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    spec = load_spec(SEED, profile="rehearsal", overrides=[IMAGE, "cluster.k8s_storage_class=shared-nfs"])
    data_pvc, loader, runs_pvc, secret = setup_documents(spec)
    for doc, model in ((data_pvc, "V1PersistentVolumeClaim"), (loader, "V1Pod"),
                       (runs_pvc, "V1PersistentVolumeClaim"), (secret, "V1Secret")):
        roundtrip(doc, model)
    # The loader pod fills the data PVC; the training pods mount it read-only.
    assert data_pvc["spec"]["accessModes"] == ["ReadWriteMany"] and runs_pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert loader["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == data_pvc["metadata"]["name"]
    assert loader["spec"]["securityContext"]["runAsNonRoot"] is True
    assert runs_pvc["spec"]["storageClassName"] == "shared-nfs"
    assert secret["stringData"] == {"AWS_ACCESS_KEY_ID": "${AWS_ACCESS_KEY_ID}",
                                    "AWS_SECRET_ACCESS_KEY": "${AWS_SECRET_ACCESS_KEY}"}  # placeholders only


def test_cli_emit_k8s_writes_setup_beside_the_job(tmp_path: Path) -> None:
    from leantrain.cli import main

    out = tmp_path / "job.k8s.yaml"
    args = ["launch", str(SEED), "--profile", "rehearsal", "--emit", "k8s", "--out", str(out), "--run-dir",
            "/mnt/runs/seed"]
    assert main(args) == 2 and not out.exists()  # no cluster.image: refused, nothing written
    assert main([*args, "--set", "cluster.image=leantrain/train:REPLACE-ME"]) == 2  # a placeholder too
    assert main([*args, "--dry-run"]) == 0 and PLACEHOLDER_IMAGE in out.read_text()
    assert main([*args, "--set", IMAGE]) == 0 and IMAGE_NAME in out.read_text()
    kinds = [d["kind"] for d in yaml.safe_load_all((tmp_path / "job.k8s.setup.yaml").read_text())]
    assert kinds == ["PersistentVolumeClaim", "Pod", "PersistentVolumeClaim", "Secret"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.log", "job.k8s.setup.yaml", "job.k8s.yaml"]


def emit_console(tmp_path: Path, *overrides: str, nproc: int | None = None) -> str:
    """What `launch --emit k8s` prints for the seed example's rehearsal profile with these overrides."""
    import io

    from rich.console import Console

    from leantrain.launch.command import run

    buf = io.StringIO()
    spec = load_spec(SEED, profile="rehearsal", overrides=[IMAGE, *overrides])
    run(console=Console(file=buf, width=400), spec=spec, spec_path=SEED, overrides=[IMAGE, *overrides],
        profile="rehearsal", nproc=nproc, nnodes=None, max_restarts=None, run_dir=tmp_path / "run", dry_run=False,
        preflight=False, emit="k8s", out=tmp_path / "job.k8s.yaml")
    return buf.getvalue()


def test_emit_k8s_warns_when_the_fast_tier_exceeds_the_shm_volume(tmp_path: Path) -> None:
    """The seed example's rehearsal (8 ranks per node) keeps 2 × 1.90 GiB × 8 = 30.4 GiB of fast tier per node: a
    16 GiB /dev/shm volume gets one warning line naming cluster.k8s_shm_gb and the size to set (the plan's
    own check, plan/budget.k8s_shm_problem); 4 ranks per node (15.2 GiB) fit; so does the default 64 GiB."""
    tier = ["checkpoint.memory_interval_steps=50"]
    text = emit_console(tmp_path, *tier, "cluster.k8s_shm_gb=16")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("warning:")]
    assert "cluster.k8s_shm_gb: 16" in line and "set cluster.k8s_shm_gb to at least 31" in line, line
    assert "8 ranks in /dev/shm/leantrain" in line
    assert (tmp_path / "job.k8s.yaml").is_file()  # a warning, not a refusal
    assert "warning:" not in emit_console(tmp_path, *tier, "cluster.k8s_shm_gb=16", nproc=4)
    assert "warning:" not in emit_console(tmp_path, *tier)
    assert "warning:" not in emit_console(tmp_path, "cluster.k8s_shm_gb=1")  # no fast tier, nothing in /dev/shm


# ---- schemas: every emitted object against the API server's own ---------------------------------------------
SCHEMAS = REPO / "tests" / "schemas"
K8S_VERSION = "1.37.0"


def strict(schema: Any) -> Any:
    """The CRD schema as the API server applies it with strict field validation (kubectl's default): a field
    the schema does not declare is an error, not silently pruned."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    return [strict(v) for v in schema] if isinstance(schema, list) else schema


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """Problems of one emitted object: the PyTorchJob against the training operator's CRD schema (vendored,
    tests/schemas/pytorchjob-v1.json) with each replica's pod template against Kubernetes' PodTemplateSpec; the
    PodMonitor against the prometheus-operator CRD's (tests/schemas/podmonitor-v1.json); core objects against
    Kubernetes' OpenAPI schemas (kubernetes-validate, strict)."""
    import json

    import jsonschema
    import kubernetes_validate

    def core(obj: dict[str, Any]) -> list[str]:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            return [f"{obj['kind']}: {err.message} at {'.'.join(map(str, err.path))}"]
        return []

    crds = {"PyTorchJob": "pytorchjob-v1.json", "PodMonitor": "podmonitor-v1.json"}
    if doc["kind"] not in crds:
        return core(doc)
    crd = strict(json.loads((SCHEMAS / crds[doc["kind"]]).read_text()))
    errors = [f"{doc['kind']}: {e.message} at {'.'.join(map(str, e.path))}"
              for e in jsonschema.Draft7Validator(crd).iter_errors(doc)]
    if doc["kind"] == "PodMonitor":
        return errors
    for name, replica in doc["spec"]["pytorchReplicaSpecs"].items():
        errors += core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name.lower()},
                        "template": replica["template"]})
    return errors


def test_schema_check_catches_a_misspelled_field_in_the_job_and_in_its_pods(tmp_path: Path) -> None:
    pytest.importorskip("kubernetes_validate")
    _, job, daemonset = emitted(tmp_path)
    assert schema_errors(job) == [] and schema_errors(daemonset) == []
    typo = yaml.safe_load(yaml.safe_dump(job))
    typo["spec"]["elasticPolicy"]["maxReplica"] = 4
    assert any("maxReplica" in e for e in schema_errors(typo))
    pod_typo = yaml.safe_load(yaml.safe_dump(job))
    pod_typo["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["imagePolicy"] = "x"
    assert any("imagePolicy" in e for e in schema_errors(pod_typo))
    assert schema_errors({**daemonset, "spec": {**daemonset["spec"], "replicas": 3}})
    monitor = emitted(tmp_path, "cluster.k8s_pod_monitor=true")[3]
    assert schema_errors(monitor) == []
    bad = yaml.safe_load(yaml.safe_dump(monitor))
    bad["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    assert any("intervall" in e for e in schema_errors(bad))


@pytest.mark.parametrize("overrides", [
    [],
    ["cluster.data_url=s3://bucket/prepared", "cluster.nccl_preset=efa",
     "cluster.k8s_rdma_resource=vpc.amazonaws.com/efa", "cluster.k8s_rdma_per_node=4"],
    ["fault.min_nodes=2", "fault.max_nodes=4", "cluster.k8s_queue=research", "cluster.k8s_priority_class=high",
     "cluster.nccl_preset=infiniband", "cluster.k8s_gang_scheduler=scheduler-plugins", "cluster.k8s_pod_monitor=true"],
])
def test_every_emitted_object_passes_its_schema(tmp_path: Path, overrides: list[str]) -> None:
    """The job file and the setup file of `--emit k8s`, every object (the PodMonitor with k8s_pod_monitor)."""
    pytest.importorskip("kubernetes_validate")
    from leantrain.launch.k8s import setup_documents

    spec = load_spec(SEED, profile="rehearsal", overrides=[IMAGE, *overrides])
    record_failure(tmp_path, host="gpu-node-3", kind="preflight", reason="driver")  # node affinity too
    docs = [*k8s_documents(spec, run_dir=tmp_path), *setup_documents(spec)]
    assert {d["kind"] for d in docs} >= {"ConfigMap", "PyTorchJob", "DaemonSet", "PersistentVolumeClaim"}
    for doc in docs:
        assert schema_errors(doc) == [], doc["kind"]


def test_auto_restart_off_gives_the_job_no_restarts(tmp_path: Path) -> None:
    """`fault.auto_restart: false` was ignored: `maxRestarts` and `backoffLimit` stayed fault.max_restarts. Both
    are 0 then, and torchrun in the pod gets `--max-restarts=0`, as for a local launch."""
    for overrides, expected in ((["fault.auto_restart=false"], 0), ([], 10)):
        _, job_doc, _ = emitted(tmp_path, "fault.max_restarts=10", *overrides)
        job = roundtrip(job_doc, "KubeflowOrgV1PyTorchJob")
        assert job.spec.elastic_policy.max_restarts == expected and job.spec.run_policy.backoff_limit == expected
        script = job.spec.pytorch_replica_specs["Worker"].template.spec.containers[0].command[-1]
        assert f"--max-restarts={expected} -m leantrain.cli train" in script


def test_restart_policy_never_is_valid_and_a_pytorchjob_has_no_pod_failure_policy(tmp_path: Path) -> None:
    """With `Never` the training operator (v1.9) fails the PyTorchJob at its first failed pod, a refusal (exit 2)
    included, so the job carries nothing more. A batch/v1 Job's podFailurePolicy (a FailJob rule on exit code 2)
    has no place in a PyTorchJob: the CRD's schema refuses it in the run policy and in the replica spec. The
    other pods, still training when the job fails, are deleted (cleanPodPolicy Running: the operator's default,
    None, left them holding their GPUs); the failed pod stays for its logs."""
    pytest.importorskip("kubernetes_validate")
    _, job, _ = emitted(tmp_path, "cluster.k8s_restart_policy=Never")
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "Never" and schema_errors(job) == []
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    rule = {"action": "FailJob", "onExitCodes": {"containerName": "pytorch", "operator": "In", "values": [2]}}
    for where in (job["spec"]["runPolicy"], job["spec"]["pytorchReplicaSpecs"]["Worker"]):
        where["podFailurePolicy"] = {"rules": [rule]}
        assert any("podFailurePolicy" in e for e in schema_errors(job))
        del where["podFailurePolicy"]


DNS_1035 = r"[a-z]([-a-z0-9]*[a-z0-9])?"


@pytest.mark.parametrize(("run_name", "label"), [
    ("405b-ablation", "run-405b-ablation"),  # a leading digit: rejected by the training-operator's webhook
    ("Llama_3 Ünïcode", "llama-3-unicode"),  # str.isalnum() let `ü`, `ï` through
    ("x" * 70, "x" * 50),
    ("--", "leantrain"),
])
def test_job_names_are_dns_1035_labels(tmp_path: Path, run_name: str, label: str) -> None:
    import re

    config_map, job, _ = emitted(tmp_path, f"run.name={run_name}")
    name = job["metadata"]["name"]
    assert re.fullmatch(DNS_1035, name) and len(name) <= 63 and name.startswith(label[:43] + "-"), name
    assert re.fullmatch(DNS_1035, config_map["metadata"]["name"]) and len(config_map["metadata"]["name"]) <= 63
    assert yaml.safe_load(config_map["data"]["spec.yaml"])["run"]["dir"] == f"/mnt/runs/{label}"


def test_different_specs_at_the_default_run_dir_get_their_own_cluster_run_dir(tmp_path: Path) -> None:
    """The cluster run dir (and the job's name) came from run.dir's name, `run` for every spec that keeps the
    default runs/run: two different jobs wrote to /mnt/runs/run. The spec file's stem names them then; run.name,
    or a run.dir that is not the default, still wins. The Slurm job name follows."""
    from leantrain.cli import main

    specs = {}
    for stem in ("ablation-a", "ablation-b"):
        specs[stem] = tmp_path / f"{stem}.yaml"
        specs[stem].write_text(SEED.read_text())  # the same spec under two names: two jobs

    def emit(spec_path: Path, kind: str, *overrides: str) -> str:
        out = tmp_path / f"job-{kind}"
        args = ["launch", str(spec_path), "--profile", "rehearsal", "--set", IMAGE, "--emit", kind, "--dry-run"]
        for item in overrides:
            args += ["--set", item]
        assert main([*args, "--out", str(out)]) == 0
        return out.read_text()

    def run_dir(text: str) -> str:
        config_map = next(yaml.safe_load_all(text))
        return yaml.safe_load(config_map["data"]["spec.yaml"])["run"]["dir"]

    assert [run_dir(emit(p, "k8s")) for p in specs.values()] == ["/mnt/runs/ablation-a", "/mnt/runs/ablation-b"]
    assert "#SBATCH --job-name=ablation-b\n" in emit(specs["ablation-b"], "slurm")
    assert run_dir(emit(specs["ablation-a"], "k8s", "run.dir=/shared/runs/lr-sweep-3")) == "/mnt/runs/lr-sweep-3"
    assert run_dir(emit(specs["ablation-a"], "k8s", "run.name=Long Run")) == "/mnt/runs/long-run"


def test_the_prepull_daemonset_and_the_pods_go_to_gpu_nodes_only(tmp_path: Path) -> None:
    """The DaemonSet had no node selector, so it pulled the multi-GB image onto every CPU node of the cluster."""
    _, job, daemonset = emitted(tmp_path)[:3]
    assert daemonset["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "nodeSelector" not in job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    chosen = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    _, job, daemonset = emitted(tmp_path, f"cluster.k8s_node_selector={chosen}")[:3]
    assert daemonset["spec"]["template"]["spec"]["nodeSelector"] == chosen
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["nodeSelector"] == chosen
    roundtrip(daemonset, "V1DaemonSet")
    roundtrip(job, "KubeflowOrgV1PyTorchJob")
