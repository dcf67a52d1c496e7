"""The job spec: one pydantic model tree for the YAML job file (examples/seed-10b.yaml's shape plus what stages need).

Every field carries a description; `docs/spec.md` is generated from these models (a test keeps it in sync).
Cross-field rules (spec/rules.py) run in `JobSpec._check_cross_fields`, so every stage gets a spec that is
already coherent. The `data:` section's models are in spec/data_schema.py, the model and fine-tuning sections
in spec/model_schema.py. Imports run one way: schema → rules → shapes → model_schema/data_schema → base.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from leantrain.spec.base import MAX_STEPS, SECRET_REF_RE, Fraction, PositiveInt, SecretRef, Section
from leantrain.spec.cluster_schema import ClusterSpec
from leantrain.spec.data_schema import (
    CleaningSpec,
    DataSource,
    DataSpec,
    DedupSpec,
    MixtureStageSpec,
    PIISpec,
    TokenizerSpec,
)
from leantrain.spec.hardware_schema import HardwareSpec
from leantrain.spec.model_schema import FinetuneSpec, LoraSpec, ModelSpec, MoESpec, default_lora_targets
from leantrain.spec.rules import cross_field_problems

__all__ = [  # the data section's models live in data_schema.py; importing them from here keeps working
    "SECRET_REF_RE", "CleaningSpec", "DataSource", "DataSpec", "DedupSpec", "FinetuneSpec", "Fraction", "JobSpec",
    "LoraSpec", "MixtureStageSpec", "ModelSpec", "MoESpec", "PIISpec", "PositiveInt", "SecretRef", "Section",
    "TokenizerSpec",
]


class ParallelismSpec(Section):
    """How the job is split over GPUs: one device mesh (dp_replicate × dp_shard) × tp × pp, ep within dp."""

    data_parallel: PositiveInt = Field(1, description="Data-parallel degree (replicate × shard).")
    tensor_parallel: PositiveInt = Field(1, description="Tensor-parallel degree; keep inside a node.")
    pipeline_parallel: PositiveInt = Field(1, description="Pipeline stages.")
    expert_parallel: PositiveInt = Field(1, description="Expert-parallel degree; divides data_parallel.")
    data_parallel_replicate: PositiveInt = Field(
        1, description="HSDP: replicas across which shards are copied; divides data_parallel."
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        3, description="ZeRO level: 0 DDP, 1 shard optimizer, 2 +grads, 3 +params (FSDP)."
    )
    sequence_parallel: bool = Field(True, description="Shard norms/dropout along the sequence with TP.")
    loss_parallel: bool = Field(
        True, description="With TP: keep the logits split over the vocabulary and compute the loss "
        "sharded (torchtitan's default; off, every TP rank holds the whole vocabulary's fp32 logits and their "
        "gradient).",
    )
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "dualpipe"] = Field(
        "1f1b", description="Pipeline schedule. dualpipe (DeepSeek-V3's bidirectional schedule) is planning only: "
        "`plan` prices it, the trainer refuses it."
    )
    virtual_stages: PositiveInt = Field(1, description="Model chunks per pipeline rank (interleaved 1F1B).")
    grad_sync: Literal["every_micro_batch", "last_micro_batch"] = Field(
        "every_micro_batch",
        description="With gradient accumulation: reduce(-scatter) gradients after every micro-batch (only sharded "
        "gradients are held), or only after the last (less traffic, but FSDP then holds every parameter's "
        "unsharded gradient between micro-batches).",
    )
    cpu_offload: bool = Field(False, description="FSDP CPU offload of parameters and optimizer states.")
    fsdp_single_rank: bool = Field(
        False,
        description="Wrap the model in FSDP2 even on one rank, to measure FSDP2's own cost on one GPU; needs a "
        "process group (one is started for the one rank; under `leantrain launch --nproc 1`, torchrun's).",
    )
    layout: Literal["spec", "auto"] = Field(
        "spec", description="spec: use these degrees when they match the GPU count; auto: the planner's best."
    )

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.tensor_parallel * self.pipeline_parallel


class PrecisionSpec(Section):
    """Numeric formats for compute, master weights, gradients reduction and optimizer states."""

    compute: Literal["fp32", "bf16", "fp16", "fp8"] = Field("bf16", description="Matmul compute dtype.")
    master_weights: Literal["fp32", "bf16"] = Field("fp32", description="Dtype of the weights the optimizer updates.")
    grad_reduce: Literal["fp32", "bf16"] = Field("fp32", description="Dtype of gradient reduction.")
    optimizer_state: Literal["fp32", "bf16", "8bit"] = Field(
        "fp32", description="Adam moment dtype; 8bit uses torchao's AdamW8bit."
    )


class TrainingSpec(Section):
    """Optimisation and loop settings."""

    global_batch_tokens: PositiveInt = Field(4 * 2**20, description="Tokens per optimizer step (all ranks).")
    micro_batch: PositiveInt = Field(1, description="Sequences per rank per forward/backward.")
    lr: float = Field(3e-4, gt=0, le=1, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of the peak.")
    warmup_steps: int = Field(2000, ge=0, le=MAX_STEPS, description="Linear warm-up steps.")
    schedule: Literal["cosine", "wsd", "constant"] = Field("cosine", description="LR schedule after warm-up.")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="WSD: share of steps spent decaying.")
    max_steps: PositiveInt | None = Field(
        None, le=MAX_STEPS, description="Optimizer steps; default tokens_total / global_batch_tokens."
    )
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    seed: int = Field(1234, ge=0, description="Seed for weights, data order and dropout.")
    deterministic: bool = Field(False, description="Bitwise-reproducible runs (and resumes) where possible.")
    activation_checkpointing: Literal["none", "selective", "op", "full"] = Field(
        "none", description="Recompute activations in backward to save memory: selective redoes the attention "
        "core; op keeps every second matmul output and the attention kernel's and redoes the rest of each block "
        "(torchtitan's op-level policy; dense SwiGLU models, full weights); full keeps only each block's input."
    )
    compile: bool = Field(False, description="torch.compile each transformer block.")
    on_nonfinite: Literal["skip", "stop"] = Field("skip", description="Non-finite loss/grad: skip the step or stop.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device; auto picks cuda when present.")
    log_every: PositiveInt = Field(10, description="Steps between metric records.")
    eval_every: int = Field(
        100, ge=0, description="Steps between held-out evaluations (and at the last step); 0 turns them off."
    )
    eval_batches: PositiveInt = Field(4, description="Micro-batches per rank in one held-out evaluation.")


class CheckpointSpec(Section):
    """Distributed checkpoints: cadence, retention, storage."""

    interval_steps: PositiveInt | Literal["auto"] = Field(
        1000, description="Steps between saves, or auto (Young/Daly from failure rate and save time)."
    )
    keep_last: PositiveInt = Field(5, description="Committed checkpoints to keep.")
    storage: Literal["local", "object_store"] = Field("local", description="Local disk or S3-compatible store.")
    url: str | None = Field(None, description="s3://bucket/prefix for object_store; a folder for local.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, Ceph, ...).")
    access_key: SecretRef | None = Field(None, description="Object-store access key, as `${VAR}`.")
    secret_key: SecretRef | None = Field(None, description="Object-store secret key, as `${VAR}`.")
    async_save: bool = Field(False, description="Stage to CPU and write while training continues.")
    write_bandwidth_gb_s: float | None = Field(
        None, gt=0, description="Storage write bandwidth of the whole job, GB/s (planning); default "
        "write_bandwidth_gb_s_per_node × nodes (every node writes its shards in parallel)."
    )
    write_bandwidth_gb_s_per_node: float = Field(
        1.0, gt=0, description="Storage write bandwidth per node, GB/s (planning): Llama 3's store sustained 2 TB/s "
        "for 2,048 nodes (report §3.3.1), about 1 GB/s each."
    )
    max_consecutive_failures: PositiveInt = Field(
        3, description="Failed saves in a row after which the run stops (exit 1) instead of training unprotected."
    )
    save_retries: int = Field(2, ge=0, le=10, description="Retries of a failed save before it counts as failed.")
    memory_interval_steps: PositiveInt | None = Field(
        None, description="Fast tier: every this many steps each rank keeps its shard in node-local memory_dir "
        "with a copy on a peer rank; a restart resumes from it when newer than the durable tier. None: off.",
    )
    memory_dir: Path = Field(Path("/dev/shm/leantrain"), description="Node-local folder of the fast tier (tmpfs).")
    memory_peer_offset: PositiveInt | None = Field(
        None, description="The fast tier's copy goes to rank + this (default: ranks per node, i.e. the next node).",
    )
    retry_backoff_s: float = Field(
        1.0, ge=0, le=600, description="Wait before the first retry of a failed save, doubling each retry, seconds."
    )
    save_timeout_s: float = Field(600.0, gt=0, le=86400, description="One save with its retries, seconds: no "
                                  "retry starts after it (the ranks agree), so a dead store fails the save.")

    @model_validator(mode="after")
    def _object_store_needs_url(self) -> CheckpointSpec:
        if self.storage == "object_store" and self.url is not None and not self.url.startswith("s3://"):
            raise ValueError(f"object_store url must start with s3://, got {self.url!r}")
        return self


class FaultSpec(Section):
    """Failure handling."""

    auto_restart: bool = Field(True, description="Restart failed workers from the latest checkpoint.")
    max_restarts: int = Field(3, ge=0, description="Restarts before the job gives up.")
    elasticity: bool = Field(False, description="Allow the world size to change between min and max nodes.")
    min_nodes: PositiveInt | None = Field(None, description="Elastic lower bound on nodes.")
    max_nodes: PositiveInt | None = Field(None, description="Elastic upper bound on nodes.")
    failures_per_gpu_day: float | None = Field(
        None, gt=0, description="Failure rate for the checkpoint interval; default from Llama 3's report."
    )
    restart_s: float = Field(300.0, ge=0, description="Time to detect a failure and restart, seconds.")
    preempt_signals: list[Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"]] = Field(
        ["SIGTERM", "SIGINT", "SIGUSR1"],
        description="Signals that trigger an immediate checkpoint and a clean exit (SIGINT/SIGTERM exit 130/143).",
    )
    collective_timeout_s: float = Field(
        120.0, gt=0, le=86400, description="Process-group timeout, seconds: a stuck collective aborts the job so it "
        "restarts; longer than monitoring.hang_timeout_s (the watchdog finds a hang first); saves/loads get 30 min.",
    )
    hang_action: Literal["abort", "alert"] = Field(
        "abort", description="No step on a rank for monitoring.hang_timeout_s: abort so the elastic agent restarts "
        "the group (under torchrun with auto_restart), or only alert.",
    )
    preempt_check_every: PositiveInt = Field(
        50, description="Steps between the ranks' agreement on a preemption signal, a checkpoint request and "
        "(with checkpoint.interval_steps: auto) a time-based save: one tiny all-reduce over the whole world, "
        "0.1-0.4 s at thousands of ranks. A signal is acted on within this many steps: keep steps × this under "
        "the scheduler's grace period.",
    )

    @model_validator(mode="after")
    def _nodes_ordered(self) -> FaultSpec:
        if self.min_nodes and self.max_nodes and self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) is larger than max_nodes ({self.max_nodes})")
        return self


class BudgetSpec(Section):
    """What the run may cost in time and money."""

    target_days: float | None = Field(30.0, gt=0, description="Wall-clock days to finish; sizes the GPU count.")
    num_gpus: PositiveInt | None = Field(None, description="Fixed GPU count; then the planner reports days.")
    assumed_mfu: Fraction = Field(0.4, description="Model FLOPs utilisation assumed for sizing.")
    price_per_gpu_hour: float = Field(2.5, ge=0, description="Price of one GPU-hour.")
    currency: str = Field("USD", min_length=1, description="Currency of prices.")
    spare_fraction: float = Field(0.08, ge=0, le=0.5, description="Spare GPUs kept for failures (seed: 5-10%).")
    sizing_flops: Literal["6ND", "detailed"] = Field(
        "6ND",
        description="FLOPs that size the GPU count: the rule of thumb 6·N·D (nominal N) or the detailed count "
        "(matmuls of the active weights + attention), the one MFU is measured against.",
    )


class PlanSpec(Section):
    """Planner knobs: the step-time model's efficiency and overlap, memory reserve, search range (docs/plan.md)."""

    compute_efficiency: Fraction | None = Field(
        None, description="Fraction of peak FLOP/s a large matmul reaches; default per accelerator (plan.timing)."
    )
    elementwise_passes: float | None = Field(
        None, ge=0, description="Passes memory-bound ops make over a layer's saved activations per forward + "
        "backward, at HBM bandwidth; default fitted on published runs (plan.inputs, docs/plan.md)."
    )
    whole_run_efficiency: Fraction | None = Field(
        None, description="Share of a whole run's GPU time spent in steady steps beyond failures and checkpoints "
        "(ramps, rollbacks, stragglers, stalls); default fitted on published whole runs (docs/plan.md)."
    )
    fp8_speedup: float | None = Field(
        None, ge=1, description="Speed-up of a large fp8 GEMM over bf16 (smaller GEMMs gain less, plan/timing.py); "
        "default 1.78 from torchao's published linear benchmarks (the trainer's fp8); Transformer Engine stacks "
        "fit their own (docs/plan.md)."
    )
    dp_overlap: float = Field(0.8, ge=0, le=1, description="Share of data-parallel communication hidden by compute.")
    tp_overlap: float = Field(0.0, ge=0, le=1, description="Share of tensor-parallel communication hidden.")
    ep_overlap: float = Field(
        0.8, ge=0, le=1, description="Share of expert-parallel all-to-all hidden under compute (DeepSeek-V3's "
        "DualPipe hides nearly all; docs/plan.md)."
    )
    moe_node_limit: PositiveInt | None = Field(
        None, description="Price the expert all-to-all as DeepSeek-V3's node-limited routing (each token reaches "
        "at most this many nodes, sent once per node over the inter-node link, forwarded inside it); null: a plain "
        "all-to-all of every top-k copy. Planning only: the router does not limit nodes."
    )
    recompute_early_stop: bool = Field(
        True, description="How recompute runs: true (this trainer, torchtitan) is torch's non-reentrant checkpoint, "
        "which stops once the tensors the backward needs are rebuilt, so full recompute does not redo a block's last "
        "matmul (bf16/fp32: a dense block's down projection, an MoE block's shared experts') nor the TP collective "
        "after it; false prices a reentrant implementation that "
        "redoes the whole block forward (Megatron-LM, DeepSpeed)."
    )
    moe_layer_overhead_ms: float | None = Field(
        None, ge=0, description="Fixed time per MoE layer and micro-batch (forward + backward), ms: the token "
        "dispatcher's host synchronisation and the launch-bound routing kernels; default 3.25 (0 on a CPU), fitted on "
        "published Megatron/NeMo MoE runs (docs/plan.md); 0 for a sync-free, CUDA-graphed MoE stack."
    )
    kernels: Literal["auto", "eager", "fused"] = Field(
        "auto", description="Kernel set the plan assumes (saved tensors and parameter-free ops): eager (our block as "
        "traced), fused (fused norm/activation/RoPE kernels, as torch.compile, Transformer Engine or LLM Foundry's "
        "Triton kernels), auto: fused with training.compile, else eager (what the trainer runs)."
    )
    fused_loss: bool | None = Field(
        None, description="Plan the cross-entropy as one fused kernel that keeps only the compute-dtype logits and "
        "writes their gradient in place (flash-attn's xentropy, Liger; LLM Foundry's MPT runs); null: with "
        "plan.kernels: fused. The trainer's loss is not fused (auto never assumes it)."
    )
    framework_reserve_gb: float = Field(
        3.0, ge=0, description="Memory per GPU the framework keeps (CUDA context, NCCL, allocator slack), GB."
    )
    causal_halving: bool = Field(False, description="Count only the unmasked half of causal attention FLOPs.")
    flash_attention: bool = Field(True, description="Attention keeps no seq×seq scores (FlashAttention/SDPA).")
    max_micro_batch: PositiveInt = Field(8, description="Largest micro-batch the layout search tries.")
    top_k: PositiveInt = Field(5, description="Layouts shown and kept as alternatives in plan.json.")
    trace: bool = Field(
        False, description="Also build the model under FakeTensorMode and print planned vs traced bytes (dense)."
    )


class WandbSpec(Section):
    """Weights & Biases tracking (observe/tracking.py)."""

    project: str = Field("leantrain", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user); default: the account's.")
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="offline writes under the run dir only (`wandb sync` later); online uploads."
    )
    dir: Path | None = Field(None, description="Folder W&B writes its `wandb/` dir into; default the run dir.")


class MlflowSpec(Section):
    """MLflow tracking (observe/tracking.py)."""

    tracking_uri: str | None = Field(
        None, description="MLflow tracking server or store URI; default a local file store in run dir/mlruns."
    )
    experiment: str = Field("leantrain", description="MLflow experiment name (created when missing).")


class MonitoringSpec(Section):
    """Metrics, sinks and alert delivery."""

    log_every: PositiveInt | None = Field(None, description="Overrides training.log_every when set.")
    comm_profile_every: PositiveInt = Field(
        10, description="Profile the collectives (`comm_s`) in one logging window of N, on the first rank of each "
        "node (the profiler costs a step's timing); the other windows log comm_s: null. 1: every window.")
    tensorboard: bool = Field(True, description="Write TensorBoard events under run dir/tb.")
    wandb: WandbSpec | None = Field(None, description="Log metrics to Weights & Biases (offline by default).")
    mlflow: MlflowSpec | None = Field(None, description="Log metrics to MLflow (a local store by default).")
    prometheus_port: int | None = Field(
        None, ge=0, le=65535, description="Serve Prometheus metrics on this port (rank 0); 0 picks a free port."
    )
    alert_console: bool = Field(True, description="Print alerts on the console as they fire and resolve.")
    webhook_url_env: str | None = Field(None, description="Env var holding the alert webhook URL.")
    webhook_token: SecretRef | None = Field(None, description="Alert webhook bearer token, as `${VAR}`.")
    alert_rules: Path | None = Field(None, description="Alert rules file; built-in defaults when absent.")
    hang_timeout_s: float = Field(90.0, gt=0, description="No step for this long: a hang alert, and with "
                                  "fault.hang_action: abort a restart (first step and saves not counted), seconds.")


class SecuritySpec(Section):
    """Secrets, permissions and encryption at rest."""

    encrypt_checkpoints: bool = Field(False, description="Encrypt checkpoint files at rest.")
    encryption_key: SecretRef | None = Field(None, description="Checkpoint encryption key, as `${VAR}`.")
    owner_only: bool = Field(True, description="Create run dirs and checkpoints with owner-only permissions.")
    audit_log: bool = Field(True, description="Append commands and checkpoint events to audit.log.")
    secret_env: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]] = Field(
        default_factory=list,
        description="More environment variables holding secrets: redacted from logs, taken from the "
        "Kubernetes Secret in job files (the spec's `${VAR}` references are included automatically).",
    )

    @model_validator(mode="after")
    def _key_when_encrypting(self) -> SecuritySpec:
        if self.encrypt_checkpoints and self.encryption_key is None:
            raise ValueError("encrypt_checkpoints needs encryption_key: ${VAR}")
        return self


class RunSpec(Section):
    """Where a run writes."""

    dir: Path = Field(Path("runs/run"), description="Run dir (metrics, checkpoints, lineage). A dir `prepare` wrote "
                      "(its manifest.json) is refused, as `prepare` refuses a run dir (its lineage.json): exit 2, "
                      "nothing written.")
    name: str | None = Field(None, description="Run name for registries and job files.")
    registry: Path | None = Field(
        None, description="SQLite run registry; default $LEANTRAIN_REGISTRY, $LEANTRAIN_HOME/runs.db, or runs.db "
        "next to the run dir (its parent folder)."
    )


class JobSpec(Section):
    """The whole job file."""

    task: Literal["pretrain", "continue_pretrain", "finetune"] = Field("pretrain", description="Kind of job.")
    model: ModelSpec = Field(description="Model size/shape.")
    finetune: FinetuneSpec = Field(default_factory=FinetuneSpec, description="Fine-tuning method (task: finetune).")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description="Parallel layout.")
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec, description="Numeric formats.")
    data: DataSpec = Field(description="Training data.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Optimisation and loop.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoints.")
    fault: FaultSpec = Field(default_factory=FaultSpec, description="Failure handling.")
    hardware: HardwareSpec = Field(default_factory=HardwareSpec, description="Cluster hardware.")
    budget: BudgetSpec = Field(default_factory=BudgetSpec, description="Time and money.")
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec, description="Observability.")
    security: SecuritySpec = Field(default_factory=SecuritySpec, description="Security.")
    run: RunSpec = Field(default_factory=RunSpec, description="Run output.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Cluster job files and data staging.")
    plan: PlanSpec = Field(default_factory=PlanSpec, description="Planner model knobs.")
    profiles: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Named overlays (scale and resources only), chosen by --profile."
    )

    @property
    def log_every(self) -> int:
        """Steps between metric records: `monitoring.log_every` when set, else `training.log_every`."""
        return self.monitoring.log_every or self.training.log_every

    @model_validator(mode="after")
    def _lora_targets_follow_attention(self) -> JobSpec:
        """Unset `finetune.lora.targets` name the model's own projections (MLA has no wk/wv); the value is
        written (not marked as set by the user) so a dumped spec says what runs."""
        lora = self.finetune.lora
        if "targets" not in lora.model_fields_set:
            lora.__dict__["targets"] = default_lora_targets(self.model.mla)
        return self

    @model_validator(mode="after")
    def _check_cross_fields(self) -> JobSpec:
        problems = cross_field_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self
