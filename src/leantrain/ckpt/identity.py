"""What a checkpoint is, from its manifest: its step, and the model it holds (shape and a spec fingerprint).

The folder name `step-N` is only a name: a folder renamed or symlinked to another step would otherwise load as
step N and silently skip or repeat steps. Each manifest records `step` and `model` ({"shape", "fingerprint"}:
the resolved model shape plus the settings that change the parameter set, hashed), and a candidate whose
manifest disagrees with its folder name, or that holds another model, is not a resume point of this run:
it is named as such, skipped (never condemned or deleted: it may be someone's good checkpoint), and the newest
checkpoint that is this run's own is loaded instead. Manifests written before these fields were recorded are
trusted as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leantrain.spec import JobSpec

MODEL_KEY = "model"
MISNAMED = "misnamed"
OTHER_MODEL = "other_model"


def model_identity(spec: JobSpec) -> dict[str, Any]:
    """{"shape": the resolved model shape, "fingerprint": sha256 of it and the adapter settings} for a spec."""
    from leantrain.spec.shapes import resolve_shape

    shape = dataclasses.asdict(resolve_shape(spec.model))
    shape.pop("nominal_params", None)  # a label (size_billion × 1e9), not the parameter set
    ft = spec.finetune
    adapters = None if spec.task != "finetune" or ft.method == "full" else {
        "method": ft.method, "rank": ft.lora.rank, "targets": sorted(ft.lora.targets)}
    text = json.dumps({"shape": shape, "adapters": adapters}, sort_keys=True, default=str)
    return {"shape": shape, "fingerprint": hashlib.sha256(text.encode()).hexdigest()[:16]}


def _shape_summary(shape: dict[str, Any] | None) -> str:
    if not isinstance(shape, dict):
        return "?"
    keys = ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size")
    return ", ".join(f"{k} {shape.get(k)}" for k in keys if k in shape) + (" MoE" if shape.get("moe") else "")


def identity_problem(*, folder_step: int, manifest: dict[str, Any],
                     expected: dict[str, Any] | None) -> tuple[str, str] | None:
    """(kind, message) when the manifest's step is not the folder's, or its model is not `expected`; else None."""
    saved_step = manifest.get("step")
    if isinstance(saved_step, int) and saved_step != folder_step:
        return MISNAMED, (f"its manifest says step {saved_step}, not the step {folder_step} its folder name says "
                          "(renamed or linked): refused by name")
    saved = manifest.get(MODEL_KEY)
    if expected is None or not isinstance(saved, dict) or "fingerprint" not in saved:
        return None
    if saved["fingerprint"] != expected["fingerprint"]:
        shapes = (f"{_shape_summary(saved.get('shape'))}; this run's: {_shape_summary(expected.get('shape'))}"
                  if saved.get("shape") != expected.get("shape") else "the same shape with other adapters")
        return OTHER_MODEL, f"a checkpoint of another model ({shapes}), not this run's: skipped"
    return None
