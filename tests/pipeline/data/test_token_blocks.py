"""Token shards read by global block index: in place (memory-mapped) and by ranged reads from an S3
server (moto), the same blocks either way, and each training rank reads only its share."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pyarrow.fs as pafs
import pytest

from pipeline.store.artifacts import write_manifest
from pipeline.data import packing
from pipeline.data.token_blocks import TokenBlocks
from pipeline.store.contracts import SplitTokens, TokenIndex, tokens_file
from pipeline.store.backends import ObjectStore
from pipeline.training.loader import BlockLoader
from pipeline.training.layout import ParallelDims

SEQ = 15
BLOCK = SEQ + 1


def make_tokens(folder, n_shards=5, seed=0):
    """A tokenize artifact folder with a train split of ``n_shards`` document shards (one of them
    empty), packed as the stage packs; returns the sealed artifact."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    dtype = np.dtype(np.uint16)
    writer = packing.SplitWriter(folder, "train", BLOCK, dtype)
    first = 0
    for k in range(n_shards):
        docs = [] if k == 1 else [rng.integers(5, 900, size=rng.integers(1, 60)).tolist() for _ in range(40)]
        writer.add(k, packing.pack(*packing.segment(docs, False, dtype), BLOCK, first, dtype))
        first += len(docs)
    shards, dropped = writer.finish()
    blocks = sum(shards)
    index = TokenIndex(seq_len=SEQ, dtype="uint16", vocab_size=1000, add_bos=False, splits={"train": SplitTokens(
        blocks=blocks, tokens=blocks * BLOCK, dropped_tail_tokens=dropped, documents=writer.documents, bytes=1,
        tokens_in_documents=writer.total - writer.documents, shards=shards)})
    index.write(folder)
    return write_manifest(folder, stage="tokenize", hash_="t" * 8, stage_config={}, run_config={}, inputs={},
                          counts=index.to_dict(), started_at=time.time())


@pytest.fixture
def in_store(moto_s3, tmp_path):
    """The same token artifact twice: in a local folder, and published to a fresh S3 bucket."""
    name = f"conduit-{uuid.uuid4().hex[:10]}"
    pafs.S3FileSystem(endpoint_override=moto_s3, scheme="http", allow_bucket_creation=True).create_dir(name)
    local = make_tokens(tmp_path / "local")
    store = ObjectStore(f"s3://{name}/art?endpoint_override={moto_s3}&scheme=http", scratch=tmp_path / "scratch")
    remote = store.publish(make_tokens(tmp_path / "build"))
    assert remote.uri is not None
    return local, remote


def test_global_blocks_are_the_shards_in_order_read_in_place_or_by_ranges(in_store):
    local, remote = in_store
    counts = local.manifest["counts"]["splits"]["train"]["shards"]
    assert len(counts) == 6 and counts[1] == 0 and all(counts[k] for k in (0, 2, 3, 4))
    want = np.concatenate([np.load(local.path / tokens_file("train", k)) for k, n in enumerate(counts) if n])
    here, there = TokenBlocks.of_artifact(local, "train"), TokenBlocks.of_artifact(remote, "train")
    assert here.source.fs is None and there.source.fs is not None  # memory-mapped; ranged reads
    assert len(here) == len(there) == len(want) == sum(counts)
    rng = np.random.default_rng(1)
    idx = rng.integers(0, len(want), size=200)  # any order, repeats, runs across shard ends
    idx[:6] = [counts[0] - 1, counts[0], 3, 4, 5, len(want) - 1]
    for blocks in (here, there):
        assert np.array_equal(blocks.take(idx), want[idx])
        assert np.array_equal(blocks.head(7), want[:7])
        assert np.array_equal(np.concatenate(list(blocks.shard_arrays())), want)
    with pytest.raises(IndexError, match=r"block index out of range \[0, \d+\)"):
        there.take([len(want)])
    there.close()


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_its_share_of_the_store_and_the_batches_of_the_local_loader(in_store, world):
    """One epoch over the split: every rank's ranged reads come to 1/W of the token bytes plus one
    header per shard it opened, and its batches are the ones the in-place loader serves."""
    local, remote = in_store
    n = local.manifest["counts"]["splits"]["train"]["blocks"]
    per_rank_micro = 2
    global_batch = world * per_rank_micro * 2  # two micro-batches per step
    steps = n // global_batch
    dims = ParallelDims(world, 1, global_batch, per_rank_micro, SEQ)
    row_bytes = BLOCK * 2  # uint16
    for rank in range(world):
        there = TokenBlocks.of_artifact(remote, "train")
        ranged = BlockLoader(there, dims, rank, seed=3)
        in_place = BlockLoader(TokenBlocks.of_artifact(local, "train"), dims, rank, seed=3)
        for _ in range(steps):
            for (x, y), (x0, y0) in zip(ranged.next_step(), in_place.next_step()):
                assert x.equal(x0) and y.equal(y0)
        share = steps * global_batch // world * row_bytes
        headers = there.bytes_read - share
        opened = len(there._open)
        assert 0 < headers <= opened * 128 and opened <= 5  # a .npy header is 64-byte aligned, 128 here
        assert there.bytes_read <= n * row_bytes / world + 5 * 128
