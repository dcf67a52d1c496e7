"""Lineage: what produced a run and each of its checkpoints, written as `lineage.json`.

A run dir gets `lineage.json` when training starts (rank 0 calls `write_lineage`), and each committed
checkpoint dir gets its own copy with the step (the checkpoint manager calls `write_checkpoint_lineage`):
the code (git commit, dirty flag, diff hash), the spec hash, the data manifest and tokenizer hashes, Python /
torch / CUDA / cuDNN / NCCL / driver versions, a hash of every installed package and version, the hardware,
and the container image digest when running in one. Secrets never enter: the spec keeps `${VAR}` references
and every string is passed through `security.redact` before it is written.

A resumed run keeps its run_id; the run lineage is rewritten for the new attempt and lists the earlier
attempts' key hashes under `previous_attempts`, so a change of code or packages between attempts shows.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from leantrain.data.shards import sha256_file
from leantrain.errors import UserInputError
from leantrain.security import redact_obj, write_private_text
from leantrain.spec import JobSpec

LINEAGE_FILE_NAME = "lineage.json"
LINEAGE_VERSION = 1
IMAGE_INFO_FILE = Path("/etc/leantrain/image.json")  # written by docker/Dockerfile at build time
DIGEST_RE = re.compile(r"@(sha256:[0-9a-f]{64})")
SOURCE_DIR = Path(__file__).resolve().parents[1]


def spec_sha256(spec: JobSpec) -> str:
    """Hash of the parsed spec (profile and overrides applied; secrets are `${VAR}` references)."""
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(SOURCE_DIR), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def code_info() -> dict[str, Any]:
    """The leantrain code that runs: package version and, in a source checkout, git commit and dirty flag."""
    try:
        version = importlib.metadata.version("leantrain")
    except importlib.metadata.PackageNotFoundError:
        version = None
    info: dict[str, Any] = {"package_version": version, "git": None}
    commit = _git("rev-parse", "HEAD")
    if commit:
        status = _git("status", "--porcelain") or ""
        diff = _git("diff", "HEAD") or ""
        info["git"] = {
            "commit": commit.strip(),
            "dirty": bool(status.strip()),
            "num_changed_paths": len(status.splitlines()),
            "diff_sha256": hashlib.sha256(diff.encode("utf-8")).hexdigest() if diff else None,
        }
    return info


def packages_info() -> dict[str, Any]:
    """A hash over every installed distribution's `name==version`, so any package change shows."""
    dists = importlib.metadata.distributions()
    pins = sorted({f"{(d.metadata['Name'] or '').lower().replace('_', '-')}=={d.version}" for d in dists})
    return {"num_packages": len(pins), "sha256": hashlib.sha256("\n".join(pins).encode()).hexdigest()}


def _driver_version() -> str | None:
    proc_file = Path("/proc/driver/nvidia/version")
    if proc_file.exists():
        match = re.search(r"Kernel Module\s+([0-9.]+)", proc_file.read_text(errors="replace"))
        if match:
            return match.group(1)
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=False,
            ).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out[0] if out else None
    return None


def software_versions() -> dict[str, Any]:
    """Python, torch, CUDA, cuDNN, NCCL and driver versions of this process (None where absent)."""
    import torch

    cuda_ok = torch.cuda.is_available()
    nccl = None
    if cuda_ok and torch.distributed.is_nccl_available():
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": str(cudnn) if cudnn else None,
        "nccl": nccl,
        "driver": _driver_version(),
    }


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        match = re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text(errors="replace"))
        if match:
            return match.group(1).strip()
    return platform.processor() or platform.machine()


def hardware_info(spec: JobSpec | None = None) -> dict[str, Any]:
    """This node's hardware, and the accelerator the spec plans for."""
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = [torch.cuda.get_device_name(i) for i in range(num_gpus)]
    try:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory_bytes = None
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "num_cpus": os.cpu_count(),
        "memory_bytes": memory_bytes,
        "gpus": gpus,
        "spec_accelerator": spec.hardware.accelerator if spec else None,
    }


def in_container() -> bool:
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists() or "KUBERNETES_SERVICE_HOST" in os.environ:
        return True
    cgroup = Path("/proc/1/cgroup")
    return cgroup.exists() and bool(re.search(r"docker|kubepods|containerd|libpod", cgroup.read_text(errors="replace")))


def container_info() -> dict[str, Any]:
    """Image reference and digest: from LEANTRAIN_IMAGE (set by our job files, ideally `name@sha256:...`),
    LEANTRAIN_IMAGE_DIGEST, and the build record the Dockerfile leaves in /etc/leantrain/image.json."""
    image = os.environ.get("LEANTRAIN_IMAGE")
    digest = os.environ.get("LEANTRAIN_IMAGE_DIGEST")
    if digest is None and image and (match := DIGEST_RE.search(image)):
        digest = match.group(1)
    build = None
    if IMAGE_INFO_FILE.exists():
        try:
            build = json.loads(IMAGE_INFO_FILE.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            build = None
    return {"in_container": in_container(), "image": image, "image_digest": digest, "build": build}


def data_info(data_dir: Path | None, *, data_url: str | None = None) -> dict[str, Any]:
    """Hashes that identify the prepared data: manifest.json and the tokenizer. A manifest that cannot be parsed
    is still hashed (training refuses it later, naming it, before anything is trained)."""
    info: dict[str, Any] = {"dir": str(data_dir) if data_dir else None, "url": data_url,
                            "manifest_sha256": None, "tokenizer_sha256": None, "num_shards": None}
    if data_dir is None:
        return info
    manifest_path = Path(data_dir) / "manifest.json"
    if manifest_path.is_file():
        info["manifest_sha256"] = sha256_file(manifest_path)
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            manifest = None  # damaged: the hash identifies it; the trainer's manifest check refuses it, naming it
        manifest = manifest if isinstance(manifest, dict) else {}
        tokenizer, shards = manifest.get("tokenizer"), manifest.get("shards")
        info["tokenizer_sha256"] = tokenizer.get("sha256") if isinstance(tokenizer, dict) else None
        info["num_shards"] = len(shards) if isinstance(shards, list) else None
    tokenizer_path = Path(data_dir) / "tokenizer.json"
    if info["tokenizer_sha256"] is None and tokenizer_path.is_file():
        info["tokenizer_sha256"] = sha256_file(tokenizer_path)
    return info


def collect_lineage(spec: JobSpec, *, data_dir: Path | None = None, spec_path: Path | None = None) -> dict[str, Any]:
    """Everything lineage.json records, for this process, now (no file is written)."""
    return {
        "version": LINEAGE_VERSION,
        "created_at": time.time(),
        "run": {"name": spec.run.name, "dir": str(spec.run.dir)},
        "run_name": spec.run.name,  # flat copy for readers that want just the name (observe's report)
        "command": list(sys.argv),
        "code": code_info(),
        "spec": {"sha256": spec_sha256(spec), "path": str(spec_path) if spec_path else None},
        "data": data_info(data_dir if data_dir is not None else spec.data.dir, data_url=spec.cluster.data_url),
        "software": {**software_versions(), "packages": packages_info()},
        "hardware": hardware_info(spec),
        "container": container_info(),
    }


def read_lineage(directory: Path) -> dict[str, Any] | None:
    """The lineage.json in a run or checkpoint dir, or None. A file that is not a lineage record (garbled,
    truncated, not a JSON object) is refused naming it; it is never overwritten, since it is the
    only record of the run's earlier attempts."""
    path = Path(directory) / LINEAGE_FILE_NAME
    if not path.is_file():
        return None
    try:
        lineage = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserInputError(f"{path}: not a lineage record ({error}); restore it or move it aside") from None
    if not isinstance(lineage, dict):
        raise UserInputError(f"{path}: not a lineage record (not a JSON object); restore it or move it aside")
    return lineage


def trained_by_other_code(run_dir: Path) -> str | None:
    """Why a finished run's losses may come from other code than this process's, or None: it was started more
    than once (a finished run started again records an attempt but keeps the first attempt's losses), or by
    another leantrain (commit and uncommitted diff, else the package version), or its lineage is missing. The
    fault drill reuses a run as its reference only when this is None: a data order or kernel changed since
    would fail the drill on the comparison, not on the fault."""
    try:
        lineage = read_lineage(run_dir)
    except UserInputError as err:
        return str(err)
    if lineage is None:
        return f"{Path(run_dir) / LINEAGE_FILE_NAME} is missing, so the code that trained it is unknown"
    if lineage.get("previous_attempts"):
        return "it was started more than once (lineage.json lists earlier attempts), maybe by other code"
    if lineage.get("code") != code_info():
        return "another version of leantrain trained it (lineage.json's code differs from this one's)"
    return None


def _attempt_summary(lineage: dict[str, Any]) -> dict[str, Any]:
    git = lineage.get("code", {}).get("git") or {}
    return {
        "attempt": lineage.get("attempt", 0),
        "created_at": lineage.get("created_at"),
        "git_commit": git.get("commit"),
        "git_dirty": git.get("dirty"),
        "spec_sha256": lineage.get("spec", {}).get("sha256"),
        "packages_sha256": lineage.get("software", {}).get("packages", {}).get("sha256"),
    }


def write_lineage(
    run_dir: Path, spec: JobSpec, *, data_dir: Path | None = None, spec_path: Path | None = None
) -> dict[str, Any]:
    """Write `run_dir/lineage.json` for this attempt (rank 0 only); keeps the run_id of an earlier attempt."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lineage = collect_lineage(spec, data_dir=data_dir, spec_path=spec_path)
    lineage["run"]["dir"] = str(run_dir.resolve())
    earlier = read_lineage(run_dir)
    if earlier and "run_id" not in earlier:
        raise UserInputError(f"{run_dir / LINEAGE_FILE_NAME}: not a run's lineage record (no run_id); restore it or "
                             "move it aside")
    if earlier:
        lineage["run_id"] = earlier["run_id"]
        lineage["attempt"] = int(earlier.get("attempt", 0)) + 1
        lineage["previous_attempts"] = [*earlier.get("previous_attempts", []), _attempt_summary(earlier)]
    else:
        lineage["run_id"] = uuid.uuid4().hex[:16]
        lineage["attempt"] = 0
        lineage["previous_attempts"] = []
    lineage = redact_obj(lineage, spec=spec)
    write_private_text(run_dir / LINEAGE_FILE_NAME, json.dumps(lineage, indent=2, sort_keys=True) + "\n", spec=spec)
    return lineage


def write_checkpoint_lineage(
    checkpoint_dir: Path, *, run_dir: Path, step: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write `checkpoint_dir/lineage.json`: the run's lineage (current attempt) plus the step. Call it before
    the checkpoint's manifest is hashed and committed, so the lineage is covered by the manifest."""
    run_lineage = read_lineage(run_dir)
    if run_lineage is None:
        raise FileNotFoundError(f"{Path(run_dir) / LINEAGE_FILE_NAME} is missing: call write_lineage first")
    lineage = {
        **run_lineage,
        "checkpoint": {"step": int(step), "dir": str(Path(checkpoint_dir).resolve()), "saved_at": time.time(),
                       **(extra or {})},
    }
    lineage = redact_obj(lineage)
    write_private_text(Path(checkpoint_dir) / LINEAGE_FILE_NAME, json.dumps(lineage, indent=2, sort_keys=True) + "\n")
    return lineage
