"""`leantrain doctor [RUN_DIR]`: environment checks, then a diagnosis of the run for the usual failures.

Each finding has evidence (numbers and lines from the run dir), a cause and a fix. Cases: ranks stuck at
start, low utilisation (data / batch / communication / stragglers), OOM (with the planner's memory numbers),
divergence (LR, warm-up, bad data, precision), flapping nodes, metric jumps after resume (optimizer, LR
schedule or data position not restored). Hangs mid-run are found by replaying the hang rule over the
metrics' time stamps.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from leantrain.ckpt.rank_records import HANG, OOM, merged_events, read_rank_records
from leantrain.errors import UserInputError
from leantrain.launch.health import job_wide_crashes, read_health
from leantrain.observe.alerts import AlertRules, replay
from leantrain.observe.logs import log_errors
from leantrain.observe.report_card import human_bytes
from leantrain.observe.report_data import (
    COMM_BOUND_SHARE,
    DATA_BOUND_SHARE,
    RunData,
    absent_ranks,
    as_float,
    is_run_dir,
    load_run,
    median_finite,
    nonfinite_steps,
    resume_points,
    steady,
    step_share,
)

Severity = Literal["ok", "info", "warning", "problem"]
STUCK_RE = re.compile(r"connection refused|timed out|timeout|rendezvous|name or service not known|"
                      r"address already in use|connectFullMesh|NCCL WARN|unhandled system error", re.IGNORECASE)
OOM_RE = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)
MIN_FREE_DISK_BYTES = 10 * 2**30
LOW_MFU_FRACTION = 0.5
STRAGGLER_RATIO = 1.3
SMALL_BATCH_TOKENS_PER_GPU = 8192
RESUME_JUMP_REL = 0.05


@dataclass(frozen=True)
class Finding:
    """One diagnosis: what was seen, why it happens, what to change."""

    severity: Severity
    area: str
    title: str
    evidence: str
    cause: str = ""
    fix: str = ""


# -- environment ---------------------------------------------------------------------------------------------
def environment_findings(run_dir: Path | None, run: RunData | None) -> list[Finding]:
    out = [_torch_finding(), _port_finding()]
    for name in [socket.gethostname(), *([os.environ["MASTER_ADDR"]] if os.environ.get("MASTER_ADDR") else [])]:
        try:
            address = socket.gethostbyname(name)
            out.append(Finding("ok", "env", "hostname resolves", f"{name} → {address}"))
        except OSError as err:
            out.append(Finding("problem", "env", "hostname does not resolve", f"{name}: {err}",
                               "ranks cannot reach each other by name",
                               "add the host to DNS or /etc/hosts; set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME"))
    where = run_dir if run_dir is not None else Path.cwd()
    usage = shutil.disk_usage(where)
    need = _planned_checkpoint_bytes(run)
    low = usage.free < max(MIN_FREE_DISK_BYTES, need)
    out.append(Finding("warning" if low else "ok", "env", "disk space",
                       f"{usage.free / 2**30:.1f} GiB free at {where}"
                       + (f"; planned checkpoints need {human_bytes(need)}" if need else ""),
                       "checkpoints will fail to write" if low else "",
                       "free space or point checkpoint.url elsewhere" if low else ""))
    out.append(_data_finding(run))
    return out


def _torch_finding() -> Finding:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as err:
        return Finding("problem", "env", "torch missing", str(err), "", "install the pinned torch (make install)")
    parts = [f"torch {torch.__version__}", f"CUDA build {torch.version.cuda or 'none'}"]
    num_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_devices:
        names = {torch.cuda.get_device_name(i) for i in range(num_devices)}
        parts.append(f"{num_devices} CUDA device(s): {', '.join(sorted(names))}")
        try:
            nccl = torch.cuda.nccl.version()  # a (major, minor, patch) tuple; an int on old builds
            parts.append("NCCL " + (".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
        except Exception as err:  # NCCL missing from a build is a finding, not a crash
            parts.append(f"NCCL unavailable ({err})")
    else:
        parts.append("no CUDA device: CPU only")
    backends = [b for b in ("gloo", "nccl") if getattr(dist, f"is_{b}_available", lambda: False)()]
    parts.append(f"distributed backends: {', '.join(backends) or 'none'}")
    return Finding("ok" if dist.is_available() else "problem", "env", "torch and devices", "; ".join(parts))


def _port_finding() -> Finding:
    """Whether the rendezvous port (MASTER_PORT, else 29500) is a port number and free on this host."""
    raw = os.environ.get("MASTER_PORT", "29500")
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        return Finding("problem", "env", "MASTER_PORT is not a port",
                       f"MASTER_PORT={raw!r}; a port is a whole number in 1-65535",
                       "the rendezvous cannot listen on it, so no rank can join",
                       "set MASTER_PORT to a free port in 1-65535 (e.g. 29500), or unset it")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
            return Finding("ok", "env", "rendezvous port free", f"port {port} (MASTER_PORT or 29500) can be bound")
        except OSError as err:
            return Finding("warning", "env", "rendezvous port in use", f"port {port}: {err}",
                           "another job or a stale torchrun holds it",
                           "set MASTER_PORT to a free port, or stop the stale process")


def _planned_checkpoint_bytes(run: RunData | None) -> float:
    if run is None:
        return 0.0
    per = as_float(run.plan_get("storage.checkpoint_bytes"))
    keep = as_float(run.spec_get("checkpoint.keep_last"))
    if math.isfinite(per) and math.isfinite(keep):
        return per * keep
    return per if math.isfinite(per) else 0.0


def _data_finding(run: RunData | None) -> Finding:
    data_dir = None
    if run is not None:
        data_dir = run.spec_get("data.dir") or (run.lineage or {}).get("data_dir")
    if not data_dir:
        return Finding("info", "env", "data readable", "no data dir known (no spec.yaml or lineage.json with it)")
    manifest = Path(str(data_dir)) / "manifest.json"
    try:
        shards = json.loads(manifest.read_text(encoding="utf-8")).get("shards", [])
        for shard in shards[:2]:
            path = Path(str(data_dir)) / str(shard.get("path", ""))
            for candidate in (path, path.with_suffix(".bin")):
                if candidate.is_file():
                    with candidate.open("rb") as handle:
                        handle.read(16)
        return Finding("ok", "env", "data readable", f"{manifest} lists {len(shards)} shard(s); first ones read")
    except (OSError, ValueError, AttributeError) as err:
        return Finding("problem", "env", "data not readable", f"{manifest}: {err}",
                       "the data dir is missing, on an unmounted volume, or not readable by this user",
                       "run `leantrain prepare SPEC` or stage the data dir to this node; check permissions")


# -- run diagnosis --------------------------------------------------------------------------------------------
def stuck_findings(run: RunData) -> list[Finding]:
    out, world, joined = [], run.world_size(), {e.get("rank") for e in run.events_of("rank_joined")}
    log_hits = [f"{log.label}: {line.strip()[:160]}" for log in run.logs for line in log.tail
                if STUCK_RE.search(line)]
    unread = [line for line in run.bad_lines if line.startswith("metrics.jsonl")]  # records exist, not readable
    if (not run.metrics and not unread) or (joined and len(joined) < world and world > 1):
        missing = absent_ranks(world, joined) if joined else []
        evidence = "no metric records" if not run.metrics else f"ranks {missing} never joined"
        if log_hits:
            evidence += "; " + "; ".join(log_hits[:3])
        out.append(Finding(
            "problem", "start", "ranks stuck at start", evidence,
            "ports between nodes are closed or collective initialisation failed",
            "open MASTER_PORT and the NCCL/Gloo port range between nodes, check that hostnames resolve on every "
            "node, set NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME to the right interface; `leantrain launch --preflight` "
            "names the rank that cannot join"))
    out += watchdog_hang_findings(run)
    hangs = [a for a in replay(run.metrics, rules=AlertRules(), events=run.events, hang_timeout_s=_hang_timeout(run))
             if a.rule == "hang" and a.state == "firing"]
    for alert in hangs[:3]:
        out.append(Finding("problem", "hang", "run stalled", alert.message,
                           "a rank blocked in a collective, in data loading, or on storage",
                           "look at the rank logs at that time (py-spy dump on the stuck rank); set "
                           "monitoring.hang_timeout_s so the watchdog alerts while it happens"))
    return out


def watchdog_hang_findings(run: RunData) -> list[Finding]:
    """One finding per attempt the hang watchdog aborted, from the ranks' own records (ckpt/rank_records.py)."""
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for record in read_rank_records(run.run_dir, HANG):
        by_attempt.setdefault(_count(record.get("attempt")), []).append(record)
    out = []
    world = run.world_size()
    for attempt, records in sorted(by_attempt.items()):
        aborted = sorted({_count(r.get("rank")) for r in records if math.isfinite(as_float(r.get("rank")))})
        suspects = absent_ranks(world, set(aborted)) if world > 1 else []
        idle = max(_count(r.get("idle_s"), float) for r in records)  # a value that is no number reads as 0
        step = max(_count(r.get("last_step")) for r in records)
        out.append(Finding(
            "problem", "hang", "hang (watchdog abort)",
            f"attempt {attempt}: ranks {aborted} saw no step for {idle:.0f} s after step {step} and aborted "
            f"(monitoring.hang_timeout_s={records[0].get('timeout_s')}); ranks that did not: {suspects or 'none'}",
            "a rank froze (stuck GPU, NIC, or a stopped process): the others waited for it in a collective",
            "check the suspect ranks' hosts (dmesg, nvidia-smi, py-spy dump); the job restarted from its newest "
            "checkpoint, see the `restart` event with cause hang"))
    return out


def _count(value: Any, kind: type = int) -> Any:
    """A number from a best-effort run record (hang records, node_health.json); 0 when it is none."""
    return kind(as_float(value)) if math.isfinite(as_float(value)) else kind(0)


def _hang_timeout(run: RunData) -> float:
    return value if math.isfinite(value := as_float(run.spec_get("monitoring.hang_timeout_s"))) else 600.0


def utilisation_findings(run: RunData) -> list[Finding]:
    out = []
    _, mfus = run.series("mfu")
    mfu = float(np.median(steady(mfus))) if steady(mfus).size else math.nan
    plan_mfu = as_float(run.plan_get("throughput.mfu"))
    low = math.isfinite(mfu) and math.isfinite(plan_mfu) and mfu < LOW_MFU_FRACTION * plan_mfu
    mfu_text = f"MFU {mfu:.1%}" + (f" vs plan {plan_mfu:.1%}" if math.isfinite(plan_mfu) else "")
    shares = {key: step_share(run, key) for key in ("data_wait_s", "comm_s")}
    if math.isfinite(shares["data_wait_s"]) and shares["data_wait_s"] > DATA_BOUND_SHARE:
        out.append(Finding("problem", "utilisation", "data-bound",
                           f"{mfu_text}; steps wait for data {shares['data_wait_s']:.0%} of the time",
                           "storage bandwidth or preprocessing cannot keep up",
                           "stage data to node-local disk, raise DataLoader workers/prefetch, pre-tokenize"))
    if math.isfinite(shares["comm_s"]) and shares["comm_s"] > COMM_BOUND_SHARE:
        out.append(Finding("problem", "utilisation", "communication-bound",
                           f"{mfu_text}; collectives take {shares['comm_s']:.0%} of the step",
                           "the layout sends too much over slow links (TP across nodes, small buckets)",
                           "keep tensor parallel inside a node, use HSDP (data_parallel_replicate), overlap "
                           "communication, compare layouts with `leantrain plan --top 5`"))
    per_rank = (run.metrics[-1] if run.metrics else {}).get("rank_step_time_s")
    times = np.array([as_float(v) for v in per_rank] if isinstance(per_rank, list) else [])
    if np.isfinite(times).sum() >= 2:
        slow = int(np.nanargmax(times))
        median = float(np.nanmedian(np.delete(times, slow)))
        if median > 0 and times[slow] / median > STRAGGLER_RATIO:
            out.append(Finding("warning", "utilisation", "straggler rank",
                               f"rank {slow} step time {times[slow]:.3g} s is {times[slow] / median:.2f}× the median",
                               "a slow or throttled GPU/host holds back every synchronous step",
                               f"check rank {slow}'s host (thermals, clocks, ECC, NIC); exclude it via node health"))
    tokens_per_gpu = _tokens_per_step_per_gpu(run)
    if low and not out and math.isfinite(tokens_per_gpu) and tokens_per_gpu < SMALL_BATCH_TOKENS_PER_GPU:
        out.append(Finding("problem", "utilisation", "batch too small",
                           f"{mfu_text}; {tokens_per_gpu:.0f} tokens per GPU per step",
                           "kernels are too small to fill the device",
                           "raise training.micro_batch (memory allows: see plan memory) or global_batch_tokens"))
    elif low and not out:
        out.append(Finding("warning", "utilisation", "low MFU, cause unclear", mfu_text,
                           "neither data wait nor communication explains it",
                           "profile one step (torch.profiler); try torch.compile and a larger micro-batch"))
    return out


def _tokens_per_step_per_gpu(run: RunData) -> float:
    batch = as_float(run.spec_get("training.global_batch_tokens"))
    if not math.isfinite(batch):
        batch = median_finite(run.series("tokens_per_s")[1] * run.series("step_time_s")[1])
    return batch / max(1, run.world_size())


def oom_findings(run: RunData) -> list[Finding]:
    events = merged_events(run.events_of("oom"), read_rank_records(run.run_dir, OOM))  # every rank's record
    lines = [f"{log.label}: {line.strip()[:160]}" for log in run.logs for line in log.error_lines
             if OOM_RE.search(line)]
    if not events and not lines:
        return []
    evidence = [f"{len(events)} oom event(s)" + (f" (steps {[e.get('step') for e in events][:5]})" if events else "")]
    evidence += lines[:2]
    per_gpu = run.plan_get("memory.per_gpu")
    per_gpu = per_gpu if isinstance(per_gpu, dict) else {}  # plan.json is a best-effort record here
    limit, source = run.memory_limit_bytes()
    parts = {k: as_float(v) for k, v in per_gpu.items() if k != "total" and math.isfinite(as_float(v))}
    if parts:
        total = as_float(per_gpu.get("total"))
        evidence.append("plan per GPU: " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in parts.items())
                        + (f", total {total / 2**30:.1f} GiB" if math.isfinite(total) else "")
                        + (f" of {limit / 2**30:.1f} GiB ({source})" if limit else ""))
        largest = max(parts, key=lambda k: parts[k])
    else:
        largest = "activations"
        evidence.append("no plan.json memory breakdown in the run dir (run `leantrain plan SPEC --json`)")
    fixes = {
        "activations": "lower training.micro_batch, or set training.activation_checkpointing: selective/full",
        "optimizer": "precision.optimizer_state: 8bit (or bf16), or parallelism.zero_stage ≥ 1 to shard it",
        "grads": "parallelism.zero_stage ≥ 2 to shard gradients",
        "params": "parallelism.zero_stage: 3, or more tensor/pipeline parallel",
        "buffers": "smaller communication buckets; lower micro_batch",
    }
    return [Finding("problem", "memory", "out of memory", "; ".join(evidence),
                    f"the largest planned share is {largest}",
                    fixes.get(largest, fixes["activations"]) + "; re-check with `leantrain plan` before relaunch")]


def log_error_findings(run: RunData) -> list[Finding]:
    """Errors in any rank's log (torchrun's per-rank files, Slurm's output, the pod's) that neither the planned
    fault nor the OOM and start-up findings already explain."""
    planned = sum(1 for e in run.events_of("restart") if e.get("planned") or e.get("cause") == "drill")
    errors = [e for e in log_errors(run.logs, planned_restarts=planned)
              if not e.planned and not OOM_RE.search(e.line) and not STUCK_RE.search(e.line)]
    if not errors:
        return []
    files = list(dict.fromkeys(e.path for e in errors))
    evidence = f"{len(errors)} error line(s) in {len(files)} of {len(run.logs)} log file(s): " + \
        "; ".join(str(e) for e in errors[:3])
    return [Finding("problem", "logs", "errors in rank logs", evidence,
                    "a rank raised or crashed; the earliest attempt and the lowest rank named usually hold the cause",
                    f"read {run.run_dir / files[0]} (the traceback above the first error line)")]


def divergence_findings(run: RunData) -> list[Finding]:
    bad = nonfinite_steps(run, "loss") + nonfinite_steps(run, "grad_norm")
    spikes = [a for a in replay(run.metrics, rules=AlertRules()) if a.rule == "loss_spike" and a.state == "firing"]
    if not bad and not spikes:
        return []
    step = min(bad) if bad else spikes[0].step
    evidence = [f"non-finite at steps {sorted(set(bad))[:5]}" if bad else spikes[0].message]
    causes, fixes = [], []
    steps, lrs = run.series("lr")
    peak_lr = float(np.nanmax(lrs)) if np.any(np.isfinite(lrs)) else math.nan
    lr_at = next((float(v) for s, v in zip(steps, lrs, strict=True) if s >= (step or 0) and math.isfinite(v)), math.nan)
    warmup = as_float(run.spec_get("training.warmup_steps"))
    if math.isfinite(lr_at) and math.isfinite(peak_lr) and lr_at >= 0.9 * peak_lr:
        evidence.append(f"LR {lr_at:.3g} at the event, near its peak {peak_lr:.3g}"
                        + (f" (warm-up {warmup:.0f} steps)" if math.isfinite(warmup) else ""))
        causes.append("learning rate too high or warm-up too short")
        fixes.append("lower training.lr (e.g. ÷2) or lengthen training.warmup_steps")
    source = _worst_source(run, step)
    if source:
        evidence.append(source[1])
        causes.append(f"bad samples in source {source[0]!r}")
        fixes.append(f"inspect source {source[0]!r} near this step (the sampler position is in the checkpoint); "
                     "re-run prepare with stricter filters")
    compute = run.spec_get("precision.compute")
    _, grads = run.series("grad_norm")
    if compute in ("fp16", "fp8") or (nonfinite_steps(run, "grad_norm") and not nonfinite_steps(run, "loss")):
        evidence.append(f"precision.compute {compute}" if compute else "grad norm non-finite while loss finite")
        causes.append("low-precision overflow (loss scaling / fp8 scaling unstable)")
        fixes.append("use bf16, or keep fp8 for matmuls only; check loss scaling")
    if not causes:
        causes.append("unclear: neither LR, a data source nor precision stands out")
        fixes.append("resume from the last good checkpoint with a lower LR and skip the batch at that step")
    return [Finding("problem", "convergence", "divergence", "; ".join(evidence),
                    " or ".join(causes), "; ".join(fixes))]


def _worst_source(run: RunData, step: int | None) -> tuple[str, str] | None:
    """The data source whose loss jumped most at `step` against its own earlier median."""
    history: dict[str, list[float]] = {}
    at: dict[str, float] = {}
    for record in run.metrics:
        by_source = record.get("loss_by_source")
        if not isinstance(by_source, dict):
            continue
        for name, value in by_source.items():
            if record.get("step") == step:
                at[name] = as_float(value)
            elif step is not None and as_float(record.get("step")) < step:
                history.setdefault(name, []).append(as_float(value))
    jumps = {n: v / median_finite(history[n]) for n, v in at.items() if history.get(n) and math.isfinite(v)}
    if not jumps:
        return None
    worst = max(jumps, key=lambda n: jumps[n])
    others = [j for n, j in jumps.items() if n != worst]
    if jumps[worst] < 1.5 or (others and jumps[worst] < 2 * max(others)):
        return None
    return worst, f"source {worst!r} loss is {jumps[worst]:.1f}× its earlier median at step {step}"


def flapping_findings(run: RunData) -> list[Finding]:
    counts: Counter[str] = Counter()
    for event in run.events_of("restart", "node_lost", "error", "oom"):
        host = event.get("host")
        if host:
            counts[str(host)] += 1
    try:  # crashes 3+ hosts had at once were the job's (health.job_wide_crashes), not a flapping node's
        hosts = read_health(run.run_dir)
        job_wide = job_wide_crashes(hosts)
        for host, info in hosts.items():
            counts[str(host)] = max(counts[str(host)], _count(info.crashes) - job_wide.get(host, 0))
    except (ValueError, AttributeError, TypeError):
        pass
    return [Finding("problem", "nodes", f"flapping node {host}", f"{host} failed {n} times in this run",
                    "hardware faults, network jitter or overheating on that node",
                    f"isolate {host} (node_health.json / Slurm --exclude); check its GPUs (dcgmi diag), NIC, "
                    "thermals")
            for host, n in counts.most_common() if n >= 2]


def resume_findings(run: RunData) -> list[Finding]:
    out = []
    records = [r for r in run.metrics if "step" in r]
    for index in resume_points(run):
        after = records[index]
        step = after.get("step")
        before_all = [r for r in records[:index] if math.isfinite(as_float(r.get("loss")))]
        if not before_all:
            continue
        same = [r for r in before_all if r.get("step") == step]
        before = same[-1] if same else before_all[-1]
        loss_b, loss_a = as_float(before.get("loss")), as_float(after.get("loss"))
        if not (math.isfinite(loss_a) and math.isfinite(loss_b)):
            continue
        jump = (loss_a - loss_b) / max(abs(loss_b), 1e-12)
        lr_b, lr_a = as_float(before.get("lr")), as_float(after.get("lr"))
        tokens_b = max((as_float(r.get("tokens_seen")) for r in before_all if r.get("step", 0) <= step),
                       default=math.nan)
        tokens_a = as_float(after.get("tokens_seen"))
        evidence = (f"step {before.get('step')} → resumed at {step}: loss {loss_b:.4g} → {loss_a:.4g} ({jump:+.0%})")
        if same and math.isfinite(lr_a) and math.isfinite(lr_b) and abs(lr_a - lr_b) > 0.01 * abs(lr_b):
            out.append(Finding("problem", "resume", "LR schedule not restored",
                               evidence + f"; LR {lr_b:.3g} before vs {lr_a:.3g} after at the same step",
                               "the scheduler state (or step counter) was not part of the checkpoint",
                               "save and load the LR scheduler state with the model and optimizer"))
        elif math.isfinite(tokens_a) and math.isfinite(tokens_b) and tokens_a < 0.5 * tokens_b:
            out.append(Finding("problem", "resume", "data position not restored",
                               evidence + f"; tokens_seen {tokens_b:.4g} before vs {tokens_a:.4g} after",
                               "the sampler restarted from the beginning, so the model sees data twice",
                               "restore the sampler's global sample index from the checkpoint"))
        elif abs(jump) > RESUME_JUMP_REL:
            out.append(Finding("problem", "resume", "metrics jump after resume", evidence,
                               "optimizer state (Adam moments) not restored, or a different data position",
                               "check that the checkpoint holds the optimizer state and the sampler position and "
                               "that both are loaded; compare with `leantrain drill`"))
    return out


def diagnose_run(run: RunData) -> list[Finding]:
    findings = [
        *stuck_findings(run), *oom_findings(run), *log_error_findings(run), *divergence_findings(run),
        *utilisation_findings(run), *flapping_findings(run), *resume_findings(run),
    ]
    if not findings:
        findings.append(Finding("ok", "run", "no known problem",
                                f"{len(run.metrics)} records checked for a stuck start, a hang, OOM, log errors, "
                                "divergence, low utilisation, flapping nodes and jumps after resume"))
    if run.bad_lines:  # left out of the diagnosis above: said, not read as "no records" (a stuck start)
        findings.insert(0, Finding("warning", "run", "unreadable run files", "; ".join(run.bad_lines[:3]),
                                   "cut short, edited by hand or damaged", "restore them or move them aside"))
    return findings


def doctor(run_dir: Path | None) -> list[Finding]:
    if run_dir is not None and not Path(run_dir).is_dir():
        raise UserInputError(f"run dir {run_dir} does not exist")
    if run_dir is not None and not is_run_dir(Path(run_dir)):
        hint = "; its manifest.json marks a data dir" if (Path(run_dir) / "manifest.json").is_file() else ""
        raise UserInputError(
            f"{run_dir} is not a run dir: it holds none of spec.yaml, lineage.json, metrics.jsonl, events.jsonl, "
            f"checkpoints/ or logs/, which train and launch write before the first step{hint}. Give the spec's "
            "run.dir, or run `leantrain doctor` without a folder for the environment checks alone")
    run = load_run(Path(run_dir)) if run_dir is not None else None
    findings = environment_findings(Path(run_dir) if run_dir else None, run)
    if run is not None:
        findings += diagnose_run(run)
    return findings


def render(findings: list[Finding], *, console: Any) -> None:
    from rich.markup import escape

    colour = {"ok": "green", "info": "cyan", "warning": "yellow", "problem": "bold red"}
    for f in findings:
        console.print(f"[{colour[f.severity]}]{f.severity:>7}[/] [bold]{f.area}: {escape(f.title)}[/]  "
                      f"{escape(f.evidence)}")
        if f.cause:
            console.print(f"          cause: {escape(f.cause)}")
        if f.fix:
            console.print(f"          fix:   {escape(f.fix)}")


def run(*, console: Any, run_dir: Path | None = None) -> list[Finding]:
    """CLI entry: print every finding (doctor reports; it does not fail on findings)."""
    findings = doctor(run_dir)
    render(findings, console=console)
    return findings


def demo_stage(ctx: Any) -> str:
    findings = doctor(ctx.out_dir / "run")
    render(findings, console=ctx.console)
    problems = [f.title for f in findings if f.severity == "problem"]
    return f"doctor: {len(problems)} problem(s)" + (f": {', '.join(problems)}" if problems else "")
