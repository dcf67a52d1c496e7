"""Resume control: which checkpoint a run starts from, and refusals instead of silent surprises.

`--resume` (train and launch):
  auto    (default) the newest valid checkpoint of this run; a fresh start only when there is none at all
  latest  the same, but refuse when there is no checkpoint
  none    start over: refused when this run's checkpoint location already holds checkpoints (they would be
          overwritten); use a new --run-dir (and checkpoint.url when it is set)
  STEP    that step of this run (no fallback); newer checkpoints are marked abandoned once it loaded
  PATH    a checkpoint folder (`…/step-00000060`), a checkpoints folder, a run dir or an s3:// prefix
`--weights-only` (with --resume PATH) loads only the model weights into a new run: step 0, a fresh optimizer
and schedule, into a run dir without checkpoints.

A checkpoint's manifest records the schedule-defining settings (max steps, LR schedule, peak LR, batch). A
resume whose settings differ is refused (exit 2) with the choices, unless `--extend-schedule` says to go on
with the new settings (the LR curve is then laid over the new run length from the resumed step on).
A restarted worker (torchrun's attempt > 0) resumes this run's own newest checkpoint (durable or fast tier) once
the run has one: the choice was made by the first attempt; before that it repeats the first attempt's request
(ckpt/hook.py `load_latest`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import leantrain.ckpt.integrity as integ
from leantrain.errors import UserInputError

if TYPE_CHECKING:
    from leantrain.ckpt.storage import Store
    from leantrain.spec import JobSpec

MODES = ("auto", "none", "latest")
SCHEDULE_KEY = "schedule"
SCHEDULE_FIELDS = ("max_steps", "schedule", "lr", "min_lr_ratio", "warmup_steps", "decay_fraction",
                   "global_batch_tokens")


@dataclass(frozen=True)
class ResumeRequest:
    """What the user asked for on the command line."""

    mode: str = "auto"  # auto | none | latest | step | path
    step: int | None = None
    path: str | None = None
    weights_only: bool = False
    extend_schedule: bool = False

    def cli_args(self) -> list[str]:
        """The flags that reproduce this request (launch passes them to every rank's `train`)."""
        path = self.path if self.path is None or self.path.startswith("s3://") else str(Path(self.path).resolve())
        value = {"step": str(self.step), "path": path}.get(self.mode, self.mode)
        args = [] if self.mode == "auto" else ["--resume", str(value)]
        return args + (["--weights-only"] if self.weights_only else []) + (
            ["--extend-schedule"] if self.extend_schedule else [])


def parse_resume(text: str | None, *, weights_only: bool = False, extend_schedule: bool = False) -> ResumeRequest:
    """`--resume auto|none|latest|STEP|PATH` and the two flags → a request; contradictions are user errors."""
    text = (text or "auto").strip()
    if text in MODES:
        request = ResumeRequest(mode=text, weights_only=weights_only, extend_schedule=extend_schedule)
    elif text.isdigit():
        request = ResumeRequest(mode="step", step=int(text), weights_only=weights_only,
                                extend_schedule=extend_schedule)
    elif text.startswith("s3://") or Path(text).exists():
        request = ResumeRequest(mode="path", path=text, weights_only=weights_only, extend_schedule=extend_schedule)
    else:
        raise UserInputError(f"--resume {text!r}: expected auto, none, latest, a step number or an existing "
                             "checkpoint path (a step-NNNNNNNN folder, a checkpoints folder, a run dir, s3://…)")
    if weights_only and request.mode != "path":
        raise UserInputError("--weights-only starts a new run from another run's weights: give the checkpoint with "
                             "--resume PATH (a step folder or a run dir) and a new --run-dir")
    if request.mode == "none" and extend_schedule:
        raise UserInputError("--resume none starts over: --extend-schedule has nothing to extend")
    return request


def schedule_settings(spec: JobSpec, *, max_steps: int) -> dict[str, Any]:
    """The settings that define the LR curve and the data order per step (recorded in each manifest)."""
    t = spec.training
    return {"max_steps": int(max_steps), "schedule": t.schedule, "lr": t.lr, "min_lr_ratio": t.min_lr_ratio,
            "warmup_steps": t.warmup_steps, "decay_fraction": t.decay_fraction,
            "global_batch_tokens": t.global_batch_tokens}


def schedule_changes(saved: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """`training.lr 0.0003 → 0.0025` per changed field (nothing for checkpoints that recorded none)."""
    if not saved:
        return []
    return [f"training.{key} {saved.get(key)} → {now[key]}" for key in SCHEDULE_FIELDS
            if key in saved and saved[key] != now[key]]


def changed_schedule_message(run_dir: Path, *, step: int, where: str, changes: list[str]) -> str:
    return (f"run {run_dir} would resume from step {step} ({where}) with other schedule settings than it was "
            f"trained with ({'; '.join(changes)}); the learning rate would jump mid-run. Choose: "
            "`--extend-schedule` to go on from that step with the new settings; `--weights-only --resume "
            f"{where} --run-dir NEW_DIR` to start a new run from its weights; `--resume none --run-dir NEW_DIR` "
            "to start over; or restore the old settings.")


def finished_message(run_dir: Path, *, step: int, where: str | None) -> str:
    return (f"run {run_dir} is finished: step {step} of {step} (checkpoint {where}); nothing to train. To train "
            "longer: --max-steps N --extend-schedule; to start over: --resume none --run-dir NEW_DIR")


def source_location(spec: JobSpec, path: str) -> tuple[Store, int | None]:
    """The store a --resume PATH names and the step it names (None: its newest)."""
    from leantrain.ckpt.storage import FsspecStore, LocalStore, s3_options

    text = path.rstrip("/")
    tail = text.rsplit("/", 1)[-1]
    match = integ.STEP_RE.match(tail)
    step = int(match.group(1)) if match else None
    root = text.rsplit("/", 1)[0] if match else text
    if root.startswith("s3://"):  # the spec's endpoint and credentials, and the bounded client, whatever its store
        return FsspecStore(root, storage_options=s3_options(spec)), step
    folder = Path(root)
    if (folder / "checkpoints").is_dir() and not integ.STEP_RE.match(tail):
        folder = folder / "checkpoints"
    if not folder.is_dir():
        raise UserInputError(f"--resume {path}: {folder} is not a folder")
    return LocalStore(folder, owner_only=spec.security.owner_only), step


def same_store(a: Store, b: Store) -> bool:
    from leantrain.ckpt.storage import LocalStore

    if isinstance(a, LocalStore) and isinstance(b, LocalStore):
        return a.root.resolve() == b.root.resolve()
    return a.url.rstrip("/") == b.url.rstrip("/")


def run_length(spec: JobSpec, max_steps: int | None) -> int:
    """The trainer's max_steps: --max-steps, else training.max_steps, else tokens_total / global batch."""
    if max_steps is not None:
        return max_steps
    t = spec.training
    return t.max_steps or max(1, round(spec.data.tokens_total / t.global_batch_tokens))


def precheck(spec: JobSpec, *, run_dir: Path, request: ResumeRequest, max_steps: int | None) -> None:
    """The refusals that need no model, before anything is written to the run dir (its spec.yaml, plan.json and
    lineage.json would otherwise describe a run that was refused): `--resume none` over checkpoints, and a
    changed schedule against the newest committed checkpoint. The trainer's resume makes the full decision;
    a store that cannot be read here is left to it."""
    from leantrain.ckpt.errors import CheckpointLoadError
    from leantrain.ckpt.storage import open_store

    length = run_length(spec, max_steps)
    if request.mode not in ("auto", "latest", "none") or request.weights_only or length == 0:
        return
    try:
        store = open_store(spec, run_dir=run_dir)
        entries = integ.list_steps(store)
        newest, manifest = (None, {}) if request.mode == "none" else _newest_own(
            store, [e for e in entries if e.good_candidate], spec=spec)
    except Exception:  # noqa: BLE001 - decided by the trainer's resume, which reports storage errors
        return
    if request.mode == "none" and entries:
        raise CheckpointLoadError(
            f"--resume none starts over, but {store.url} already holds this run's checkpoints (steps "
            f"{', '.join(str(e.step) for e in entries)}), which its saves would overwrite: use a new --run-dir (and "
            "a new checkpoint.url when it is set), or move them away", user_input=True)
    changes = schedule_changes(manifest.get(SCHEDULE_KEY), schedule_settings(spec, max_steps=length))
    if newest is not None and changes and not request.extend_schedule:
        raise CheckpointLoadError(changed_schedule_message(run_dir, step=newest.step,
                                                           where=store.describe(newest.name), changes=changes),
                                  user_input=True)


def _newest_own(store: Store, good: list[integ.StepEntry], *, spec: JobSpec) -> tuple[integ.StepEntry | None, dict]:
    """The newest committed checkpoint that is this run's by its manifest (ckpt/identity.py), with the manifest:
    a misnamed folder or another model's checkpoint is the trainer's to name and skip, not a schedule change."""
    from leantrain.ckpt.identity import identity_problem, model_identity

    expected = model_identity(spec)
    for entry in reversed(good):
        try:
            manifest = integ.read_manifest(store, entry.name)
        except integ.IntegrityError:
            continue  # the trainer's verified load decides about it
        if identity_problem(folder_step=entry.step, manifest=manifest, expected=expected) is None:
            return entry, manifest
    return None, {}
