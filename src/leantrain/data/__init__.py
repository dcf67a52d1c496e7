"""`leantrain prepare`: raw corpora → cleaned, deduplicated, redacted, tokenized shards + the training sampler.

Public pieces other stages use: `PackedBatchSampler`/`Batch` (sampler), `write_token_data_dir` and
`load_manifest` (layout). The pipeline itself is `leantrain.data.pipeline.prepare_data`.
Importing `leantrain.data` (or any of its preparation modules) does not import torch: only the sampler,
which hands tensors to the trainer, needs it, and it is imported on first use of its names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from leantrain.data.layout import Manifest, MixtureStage, load_manifest, write_token_data_dir

if TYPE_CHECKING:
    from leantrain.data.sampler import Batch, PackedBatchSampler

__all__ = ["Batch", "Manifest", "MixtureStage", "PackedBatchSampler", "load_manifest", "write_token_data_dir"]


def __getattr__(name: str) -> Any:
    if name in ("Batch", "PackedBatchSampler"):
        from leantrain.data import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module 'leantrain.data' has no attribute {name!r}")
