"""`leantrain prepare`: raw corpora → cleaned, deduplicated, redacted, tokenized shards + the training sampler.

Public pieces other stages use: `PackedBatchSampler`/`Batch` (sampler), `write_token_data_dir` and
`load_manifest` (layout). The pipeline itself is `leantrain.data.pipeline.prepare_data`.
"""

from leantrain.data.layout import Manifest, MixtureStage, load_manifest, write_token_data_dir
from leantrain.data.sampler import Batch, PackedBatchSampler

__all__ = ["Batch", "Manifest", "MixtureStage", "PackedBatchSampler", "load_manifest", "write_token_data_dir"]
