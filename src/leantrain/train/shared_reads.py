"""The data dir's manifest read by rank 0 alone and broadcast (`leantrain.rank0.from_rank0`), with the sampler
index rank 0 writes before the other ranks map it."""

from __future__ import annotations

from pathlib import Path

from leantrain.data.layout import SPLITS, Manifest, load_manifest
from leantrain.data.sample_index import ensure_sample_index, load_buckets, load_index
from leantrain.data.sampler import check_shard_files
from leantrain.rank0 import from_rank0


def shared_manifest(data_dir: Path) -> Manifest:
    """The data dir's manifest on every rank; rank 0 also checks every shard's size (one stat each: a damaged
    shard fails every rank here, `data.sampler.check_shard_files`), writes any missing sampler index
    (`data.sample_index`) before the others can map it (the broadcast is the barrier), and hands every rank the
    index's bucket totals with the manifest (8 B per 1,024 documents: no other rank reads them)."""

    def read() -> Manifest:
        manifest = load_manifest(Path(data_dir))
        check_shard_files(manifest, Path(data_dir))
        for split in SPLITS:
            ensure_sample_index(Path(data_dir), manifest, split=split)
            for name in manifest.source_names:  # carried in the broadcast: no rank but this one reads them
                shards = manifest.shards_for(split=split, source=name)
                if shards:
                    index = load_index(Path(data_dir), split=split, shards=shards)
                    manifest.bucket_totals[f"{split}/{name}"] = load_buckets(
                        Path(data_dir), split=split, shards=shards, index=index)
        return manifest

    return from_rank0(read)
