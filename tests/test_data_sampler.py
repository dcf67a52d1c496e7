"""The packed sampler: determinism across world sizes, one-integer resume, packing, mixture weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from leantrain.data import MixtureStage, PackedBatchSampler, write_token_data_dir
from leantrain.data.sampler import BLOCK_SAMPLES, largest_remainder_counts
from leantrain.errors import UserInputError

SEQ_LEN = 16


def _docs(seed: int, *, low: int, high: int, num_docs: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(low, high, int(rng.integers(2, 40))).tolist() for _ in range(num_docs)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data")
    docs = {"en": _docs(1, low=1, high=100, num_docs=60), "zh": _docs(2, low=100, high=200, num_docs=40)}
    valid = {"en": _docs(3, low=1, high=100, num_docs=5)}
    write_token_data_dir(path, docs, vocab_size=256, eos_id=0, weights={"en": 0.75, "zh": 0.25},
                         valid_docs_by_source=valid, shard_size_tokens=200)
    return path


def _sampler(path: Path, *, rank: int = 0, size: int = 1, micro_batch: int = 2, **kw: object) -> PackedBatchSampler:
    return PackedBatchSampler(path, seq_len=SEQ_LEN, micro_batch=micro_batch, dp_rank=rank, dp_size=size,
                              seed=7, **kw)  # type: ignore[arg-type]


def _global_rows(path: Path, *, size: int, steps: int, micro_batch: int = 2) -> np.ndarray:
    """Rows of `steps` batches from every rank, put back in global-index order."""
    samplers = [_sampler(path, rank=r, size=size, micro_batch=micro_batch) for r in range(size)]
    rows = []
    for _ in range(steps):
        for sampler in samplers:
            rows.append(sampler.next_batch().tokens.numpy())
    return np.concatenate(rows)


def test_same_global_sequence_at_world_sizes_1_2_4(data_dir: Path) -> None:
    one = _global_rows(data_dir, size=1, steps=16)
    two = _global_rows(data_dir, size=2, steps=8)
    four = _global_rows(data_dir, size=4, steps=4)
    assert one.shape == (32, SEQ_LEN + 1)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_array_equal(one, four)


def test_resume_from_one_integer_at_another_world_size(data_dir: Path) -> None:
    reference = _global_rows(data_dir, size=1, steps=12)
    first = _sampler(data_dir, size=1)
    for _ in range(4):
        first.next_batch()
    state = first.state_dict()
    assert state == {"global_sample_index": 8}
    resumed = [_sampler(data_dir, rank=r, size=2) for r in range(2)]
    for sampler in resumed:
        sampler.load_state_dict(state)
    rows = np.concatenate([s.next_batch().tokens.numpy() for _ in range(4) for s in resumed])
    np.testing.assert_array_equal(rows, reference[8:24])


def test_seed_changes_order_and_batch_layout(data_dir: Path) -> None:
    batch = _sampler(data_dir).next_batch()
    assert batch.tokens.dtype.is_floating_point is False and batch.tokens.shape == (2, SEQ_LEN + 1)
    assert batch.source_ids.shape == batch.tokens.shape
    other = PackedBatchSampler(data_dir, seq_len=SEQ_LEN, micro_batch=2, dp_rank=0, dp_size=1, seed=8).next_batch()
    assert not np.array_equal(batch.tokens.numpy(), other.tokens.numpy())


def test_samples_are_windows_of_the_packed_epoch_stream(data_dir: Path) -> None:
    """Rebuild the stream of each source from its epoch permutations and compare every window."""
    sampler = _sampler(data_dir)
    for global_index in range(0, 200, 7):
        tokens, source = sampler.sample(global_index)
        name = sampler.source_names[source]
        tokens_ids = tokens.tolist()
        assert set(tokens_ids) <= ({0} | set(range(1, 100)) if name == "en" else {0} | set(range(100, 200)))
    stream = sampler._streams[0]
    assert stream is not None
    # the documents straight from the shards (not through the sampler's cached index), in manifest order
    from leantrain.data.layout import load_manifest
    from leantrain.data.shards import ShardReader

    readers = [ShardReader(data_dir / s.path) for s in load_manifest(data_dir).shards_for(
        split="train", source=sampler.source_names[0])]
    docs = [reader.doc(i).tolist() for reader in readers for i in range(reader.num_docs)]
    epochs = [stream._epoch(e).order() for e in range(3)]
    flat = [token for order in epochs for doc in order for token in docs[int(doc)]]
    out = np.empty(SEQ_LEN + 1, dtype=np.int64)
    for local in (0, 1, 5, stream.tokens_per_epoch // SEQ_LEN, stream.tokens_per_epoch // SEQ_LEN + 3):
        stream.sample(local, out)
        assert out.tolist() == flat[local * SEQ_LEN : local * SEQ_LEN + SEQ_LEN + 1]
        assert flat[local * SEQ_LEN + SEQ_LEN] == out[-1]  # windows overlap by one token


def test_mixture_weights_are_exact_per_block(data_dir: Path) -> None:
    sampler = _sampler(data_dir)
    counts = np.bincount([sampler._schedule.locate(g)[0] for g in range(BLOCK_SAMPLES)], minlength=2)
    assert counts.tolist() == [768, 256]
    assert largest_remainder_counts(np.array([1.0, 1.0, 1.0]), 10).tolist() == [4, 3, 3]


def test_curriculum_stages_switch_weights(tmp_path: Path) -> None:
    docs = {"a": _docs(4, low=1, high=50, num_docs=20), "b": _docs(5, low=50, high=99, num_docs=20)}
    stages = [MixtureStage(weights={"a": 1.0}, until_tokens=BLOCK_SAMPLES * SEQ_LEN),
              MixtureStage(weights={"a": 0.5, "b": 0.5})]
    write_token_data_dir(tmp_path, docs, vocab_size=100, eos_id=0, stages=stages)
    sampler = _sampler(tmp_path)
    first = [sampler._schedule.locate(g)[0] for g in range(BLOCK_SAMPLES)]
    second = [sampler._schedule.locate(g)[0] for g in range(BLOCK_SAMPLES, 2 * BLOCK_SAMPLES)]
    assert set(first) == {0} and second.count(1) == BLOCK_SAMPLES // 2
    # source "a" local indices continue across the stage boundary without a gap or repeat
    a_local = [sampler._schedule.locate(g)[1] for g in range(2 * BLOCK_SAMPLES) if sampler._schedule.locate(g)[0] == 0]
    assert a_local == list(range(len(a_local)))


def test_valid_split_uses_only_sources_with_valid_data(data_dir: Path) -> None:
    sampler = _sampler(data_dir, split="valid", micro_batch=4)
    batch = sampler.next_batch()
    assert set(batch.source_ids.flatten().tolist()) == {0}
    assert sampler.tokens_per_epoch()["zh"] == 0


def test_bad_inputs_are_user_errors(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="dp_rank"):
        _sampler(data_dir, rank=2, size=2)
    with pytest.raises(UserInputError, match="manifest.json not found"):
        _sampler(tmp_path)


def test_the_document_index_is_built_once_and_memory_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data dir holds the sampler's index (written with the manifest); a sampler maps it and opens no `.idx`
    file and only the shards its samples touch; a data dir without it (an older one) gets it on first use, and a
    read-only one still samples the same tokens from an index built in memory."""
    import os
    import sys

    from leantrain.data.layout import load_manifest, write_token_data_dir
    from leantrain.data.sample_index import INDEX_DIR, buckets_path, ensure_sample_index, index_path
    from leantrain.data.shuffle import bucket_totals

    rng = np.random.default_rng(0)
    docs = {"web": [rng.integers(1, 100, 30).tolist() for _ in range(64)]}
    write_token_data_dir(tmp_path / "d", docs, vocab_size=128, eos_id=0, shard_size_tokens=200)
    manifest = load_manifest(tmp_path / "d")
    shards = manifest.shards_for(split="train", source="web")
    assert len(shards) >= 8
    assert index_path(tmp_path / "d", split="train", shards=shards).is_file()
    opened: list[str] = []

    def audit(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], (str, os.PathLike)) and str(tmp_path) in os.fsdecode(args[0]):
            opened.append(os.path.basename(os.fsdecode(args[0])))

    sys.addaudithook(audit)
    sampler = PackedBatchSampler(tmp_path / "d", seq_len=SEQ_LEN, micro_batch=2, dp_rank=0, dp_size=1, seed=0)
    first = sampler.next_batch().tokens.clone()
    seen = list(opened)
    opened.clear()
    assert not [name for name in seen if name.endswith(".idx")], seen
    assert len([name for name in seen if name.endswith(".bin")]) <= 4, seen  # two windows of 17 tokens
    # the epoch order's bucket totals lie beside the index (data.shuffle): read, not recomputed from every length
    index = index_path(tmp_path / "d", split="train", shards=shards)
    assert sorted(p.name for p in (tmp_path / "d" / INDEX_DIR).iterdir()) == sorted(
        [index.name, buckets_path(index).name])
    assert np.array_equal(np.load(buckets_path(index)), bucket_totals(np.load(index)[2]))
    # an index written before the bucket totals were: they are added on first use, same samples
    buckets_path(index).unlink()
    assert ensure_sample_index(tmp_path / "d", manifest, split="train") and buckets_path(index).is_file()
    again = PackedBatchSampler(tmp_path / "d", seq_len=SEQ_LEN, micro_batch=2, dp_rank=0, dp_size=1, seed=0)
    assert np.array_equal(again.next_batch().tokens.numpy(), first.numpy())
    # an older data dir without the index: built on first use, same samples
    for path in (tmp_path / "d" / INDEX_DIR).iterdir():
        path.unlink()
    assert ensure_sample_index(tmp_path / "d", manifest, split="train")
    again = PackedBatchSampler(tmp_path / "d", seq_len=SEQ_LEN, micro_batch=2, dp_rank=0, dp_size=1, seed=0)
    assert np.array_equal(again.next_batch().tokens.numpy(), first.numpy())
    # a data dir that cannot be written (read-only mount) and has no index: built in memory, same samples
    import leantrain.data.sample_index as sample_index

    for path in (tmp_path / "d" / INDEX_DIR).iterdir():
        path.unlink()

    def read_only(*args: object, **kwargs: object) -> None:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(sample_index, "write_index", read_only)
    assert not ensure_sample_index(tmp_path / "d", manifest, split="train")
    memory = PackedBatchSampler(tmp_path / "d", seq_len=SEQ_LEN, micro_batch=2, dp_rank=0, dp_size=1, seed=0)
    assert np.array_equal(memory.next_batch().tokens.numpy(), first.numpy())


def test_the_prefetching_loader_hands_out_the_samplers_batches_and_its_consumed_state(tmp_path: Path) -> None:
    """Read-ahead on a thread changes nothing a run sees: the same batches in the same order, a state that is the
    position after the last batch handed out (not the read-ahead one), a resume from it continuing exactly, and an
    error in the producer raised in the consumer."""
    from leantrain.data.prefetch import PrefetchingSampler

    rng = np.random.default_rng(1)
    docs = {"web": [rng.integers(1, 100, 30).tolist() for _ in range(64)]}
    write_token_data_dir(tmp_path / "d", docs, vocab_size=128, eos_id=0)

    def plain() -> PackedBatchSampler:
        return PackedBatchSampler(tmp_path / "d", seq_len=SEQ_LEN, micro_batch=2, dp_rank=1, dp_size=2, seed=3)

    reference = plain()
    expected = [reference.next_batch().tokens.numpy().copy() for _ in range(12)]
    loader = PrefetchingSampler(plain(), depth=4)
    try:
        for i in range(5):
            assert np.array_equal(loader.next_batch().tokens.numpy(), expected[i])
        import time

        time.sleep(0.2)  # let the producer read ahead
        after_five = plain()
        for _ in range(5):
            after_five.next_batch()
        assert loader.state_dict() == after_five.state_dict() == {"global_sample_index": 5 * 2 * 2}
        assert loader.global_sample_index == 20 and loader.source_names == ["web"]
        resumed = PrefetchingSampler(plain(), depth=3)
        resumed.load_state_dict(loader.state_dict())
        for i in range(5, 12):
            assert np.array_equal(resumed.next_batch().tokens.numpy(), expected[i])
        resumed.close()
    finally:
        loader.close()

    class Broken:
        def state_dict(self) -> dict:
            return {}

        def next_batch(self) -> None:
            raise UserInputError("shard 3: the .mask is missing")

    failing = PrefetchingSampler(Broken())
    for _ in range(2):
        with pytest.raises(UserInputError, match="mask is missing"):
            failing.next_batch()
    failing.close()


def test_a_truncated_shard_or_mask_is_refused_when_first_opened_naming_it(tmp_path: Path) -> None:
    """A shard's size is checked against the manifest when the sampler first opens it (one stat, no read): a
    building sampler opens nothing, and the batch that needs the damaged shard raises a user error naming it."""
    import json
    import os

    from leantrain.data.chat import mask_path
    from leantrain.data.layout import load_manifest

    write_token_data_dir(tmp_path / "d", {"web": _docs(4, low=1, high=100, num_docs=8)}, vocab_size=128, eos_id=0)
    shard = load_manifest(tmp_path / "d").shards[0]
    bin_path = tmp_path / "d" / shard.path
    os.truncate(bin_path, shard.num_bytes - 2)  # a copy cut short by one token
    sampler = _sampler(tmp_path / "d")
    with pytest.raises(UserInputError, match=f"{bin_path}: .* bytes, expected {shard.num_bytes:,}"):
        sampler.next_batch()
    # a chat source's loss mask: one byte per token, checked the same way
    write_token_data_dir(tmp_path / "c", {"chat": _docs(5, low=1, high=100, num_docs=8)}, vocab_size=128, eos_id=0)
    raw = json.loads((tmp_path / "c" / "manifest.json").read_text())
    raw["sources"][0].update(loss_mask=True, pad_multiple=SEQ_LEN)
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(raw))
    shard = load_manifest(tmp_path / "c").shards[0]
    mask = mask_path(tmp_path / "c" / shard.path)
    mask.write_bytes(b"\x01" * (shard.num_tokens - 1))
    with pytest.raises(UserInputError, match=f"{mask}: .* expected one per token of the shard"):
        _sampler(tmp_path / "c").next_batch()


def test_the_trainer_start_refuses_a_damaged_shard_that_no_batch_has_touched(tmp_path: Path) -> None:
    """Rank 0 stats every shard and mask while it reads the manifest for the others (`shared_manifest`): one rank
    meeting the damage mid-run would fail alone while the others wait in the step's collectives."""
    import json
    import os

    from leantrain.data.chat import mask_path
    from leantrain.data.layout import load_manifest
    from leantrain.train.shared_reads import shared_manifest

    write_token_data_dir(tmp_path / "d", {"web": _docs(4, low=1, high=100, num_docs=64)}, vocab_size=128, eos_id=0,
                         shard_size_tokens=64)
    shards = load_manifest(tmp_path / "d").shards
    assert len(shards) > 2
    shared_manifest(tmp_path / "d")  # intact: passes
    os.truncate(tmp_path / "d" / shards[-1].path, shards[-1].num_bytes - 2)
    with pytest.raises(UserInputError, match=f"{tmp_path / 'd' / shards[-1].path}: .* bytes, expected"):
        shared_manifest(tmp_path / "d")
    (tmp_path / "d" / shards[-1].path).unlink()
    with pytest.raises(UserInputError, match="missing"):
        shared_manifest(tmp_path / "d")
    write_token_data_dir(tmp_path / "c", {"chat": _docs(5, low=1, high=100, num_docs=8)}, vocab_size=128, eos_id=0)
    raw = json.loads((tmp_path / "c" / "manifest.json").read_text())
    raw["sources"][0].update(loss_mask=True, pad_multiple=SEQ_LEN)
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(raw))
    shard = load_manifest(tmp_path / "c").shards[0]
    with pytest.raises(UserInputError, match="this shard's .mask is missing"):
        shared_manifest(tmp_path / "c")
    mask_path(tmp_path / "c" / shard.path).write_bytes(b"\x01" * (shard.num_tokens + 3))
    with pytest.raises(UserInputError, match="expected one per token"):
        shared_manifest(tmp_path / "c")
