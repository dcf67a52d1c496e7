"""The `cluster` section: how job files for a cluster are written (Slurm sbatch, Kubernetes PyTorchJob), the
nodes' cores and host memory (with its unit), and how data is staged."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from leantrain.spec.base import PositiveInt, Section
from leantrain.spec.hardware_schema import parse_memory_gb

SLURM_TIME_RE = r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$"


class ClusterSpec(Section):
    """How job files for a cluster are written (Slurm sbatch, Kubernetes PyTorchJob) and data is staged."""

    image: str | None = Field(
        None,
        description="Training image you built and pushed (docker/README.md), pinned by digest (name@sha256:...) in "
        "production; required by Kubernetes job files and the pyxis/apptainer Slurm runtimes (`launch --emit ... "
        "--dry-run` writes a placeholder instead).",
    )
    time_limit: str = Field(
        "24:00:00", pattern=SLURM_TIME_RE, description="Wall-clock limit per allocation, Slurm format [D-]HH:MM:SS."
    )
    checkpoint_signal_s: int = Field(
        120, ge=10, description="Seconds before the time limit at which the job asks the trainer to checkpoint."
    )
    rdzv_port: int = Field(29500, ge=1, le=65535, description="c10d rendezvous port on the first node.")
    cpus_per_node: PositiveInt | None = Field(None, description="CPU cores per node; default 8 per GPU.")
    memory_gb_per_node: float | None = Field(
        None, description="Host memory per node with its unit, \"512 GiB\" or \"550 GB\" (a bare whole number is "
        "ambiguous and refused with both readings); or use memory_gib_per_node. Default 64 GiB per GPU."
    )
    memory_gib_per_node: float | None = Field(
        None, gt=0, description="Host memory per node in GiB (2^30 bytes: Slurm's --mem=…G, Kubernetes' …Gi)."
    )
    slurm_partition: str | None = Field(None, description="Slurm partition (-p).")
    slurm_account: str | None = Field(None, description="Slurm account (-A).")
    slurm_qos: str | None = Field(None, description="Slurm quality of service.")
    slurm_runtime: Literal["host", "pyxis", "apptainer"] = Field(
        "host", description="Where srun steps run: `pyxis` (enroot, --container-image) or `apptainer` (apptainer "
        "exec --nv) run them in `image`; `host` runs them on the node, set up by `env_hook` or `slurm_venv` (one "
        "of them is required: never the submit host's own venv)."
    )
    slurm_venv: str | None = Field(
        None, description="`slurm_runtime: host`: a venv with leantrain on storage every node mounts at this path; "
        "the job activates it on each node."
    )
    env_hook: str | None = Field(
        None, description="Shell file sourced on every node before leantrain runs (module loads, a venv on "
        "shared storage); the job file's env hook instead of the submit host's venv."
    )
    max_requeues: int = Field(
        3, ge=0, description="Slurm: requeue the job after a failed training step at most this many times "
        "(never with fault.auto_restart: false)."
    )
    nccl_preset: Literal["none", "infiniband", "roce", "efa", "tcp"] = Field(
        "none", description="The cluster's fabric: NCCL settings for job files (launch/fabric.py: InfiniBand, RoCE "
        "v2, AWS EFA through the aws-ofi-nccl plugin, or plain TCP); `nccl_env` entries win."
    )
    nccl_env: dict[str, str] = Field(
        default_factory=dict, description="NCCL_*/UCX_* variables exported on every node (over `nccl_preset`)."
    )
    k8s_namespace: str = Field("default", description="Kubernetes namespace.")
    k8s_gang_scheduler: Literal["volcano", "scheduler-plugins", "none"] = Field(
        "volcano", description="Gang scheduler that starts all pods or none (`none`: the default scheduler)."
    )
    k8s_rdma_resource: str | None = Field(
        None, description="Extended resource for RDMA NICs (e.g. rdma/rdma_shared_device_a, nvidia.com/hostdev); "
        "requested per pod, with the IPC_LOCK capability."
    )
    k8s_rdma_per_node: PositiveInt = Field(1, description="How many `k8s_rdma_resource` each pod requests.")
    k8s_ipc_lock: bool = Field(False, description="Add IPC_LOCK (pinned memory for RDMA) without an RDMA resource.")
    k8s_pod_monitor: bool = Field(
        False, description="Emit a PodMonitor (prometheus-operator) beside the job; scrape annotations always."
    )
    k8s_storage_class: str | None = Field(None, description="StorageClass of the emitted PVCs (cluster default).")
    k8s_data_pvc_gb: PositiveInt = Field(
        1024, description="Size of the emitted data PVC in GiB (written as …Gi; ReadWriteMany: the data loader pod "
        "writes it, the training pods mount it read-only)."
    )
    k8s_checkpoint_pvc_gb: PositiveInt = Field(
        4096, description="Size of the emitted run-dir PVC in GiB (written as …Gi; ReadWriteMany: every pod writes)."
    )
    k8s_queue: str | None = Field(None, description="Scheduler queue (volcano) for the job's pod group.")
    k8s_priority_class: str | None = Field(None, description="PriorityClass of the pods.")
    k8s_node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the training pods and the image pre-pull DaemonSet require "
        "(e.g. `{nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}`). Empty: the pods go where their GPU request fits, "
        "and with `nvidia.com/gpu` the DaemonSet runs on nodes labelled `nvidia.com/gpu.present: \"true\"` (NVIDIA "
        "GPU feature discovery, part of the GPU operator) instead of pulling the image onto every node."
    )
    k8s_restart_policy: Literal["OnFailure", "ExitCode", "Always", "Never"] = Field(
        "OnFailure", description="Pod restart policy of the training replicas."
    )
    k8s_secret_name: str = Field("leantrain-secrets", description="Kubernetes Secret holding the secret env vars.")
    k8s_data_pvc: str = Field("leantrain-data", description="PersistentVolumeClaim with the prepared data.")
    k8s_checkpoint_pvc: str = Field("leantrain-checkpoints", description="PersistentVolumeClaim for run dirs.")
    k8s_shm_gb: PositiveInt = Field(
        64, description="Size of the in-memory /dev/shm volume in GiB (written as …Gi; the plan checks the fast tier "
        "against it)."
    )
    data_url: str | None = Field(
        None, description="Remote prepared data dir (fsspec URL, e.g. s3://bucket/data); staged to node-local "
        "disk and verified against the manifest before training."
    )
    data_endpoint_url: str | None = Field(None, description="S3-compatible endpoint for data_url.")
    node_local_dir: str = Field("/tmp/leantrain", description="Node-local folder that data_url is staged into.")
    preflight: bool = Field(True, description="Job files run `preflight` on all ranks before training.")
    preflight_timeout_s: float = Field(180.0, gt=0, description="Preflight limit; ranks not joined by then fail.")
    unhealthy_after_crashes: PositiveInt = Field(
        2, description="Crashes recorded for a host before it is excluded (node_health.json)."
    )

    @field_validator("memory_gb_per_node", mode="before")
    @classmethod
    def _host_memory_with_unit(cls, value: object) -> float | None:
        return parse_memory_gb(value, gib_field="memory_gib_per_node")

    @model_validator(mode="after")
    def _one_host_memory(self) -> ClusterSpec:
        if self.memory_gb_per_node is not None and self.memory_gib_per_node is not None:
            raise ValueError("give memory_gb_per_node or memory_gib_per_node, not both")
        return self

    @property
    def host_memory_gib(self) -> float | None:
        """Host memory per node in GiB, from whichever field gives it (None: the default, 64 GiB per GPU)."""
        if self.memory_gib_per_node is not None:
            return self.memory_gib_per_node
        return None if self.memory_gb_per_node is None else self.memory_gb_per_node * 1e9 / 2**30
