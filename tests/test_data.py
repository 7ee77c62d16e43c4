"""Dataset fetch/verify, vocabulary and split, and the deterministic global-sample sampler."""

import hashlib
import os

import numpy as np
import pytest
from conftest import TINYSHAKESPEARE_SHA256
from ddplab.data import (
    CharVocab,
    DataError,
    WindowSampler,
    fetch_dataset,
    get_batch,
    load_dataset,
    rank_sample_indices,
)
from ddplab.lr import plan_batch


@pytest.fixture(scope="module")
def shakespeare(data_path):
    return load_dataset(data_path, None, TINYSHAKESPEARE_SHA256)


def test_vocab_and_split(shakespeare):
    ds = shakespeare
    assert len(ds.vocab) == 65
    assert ds.train.dtype == np.uint16 and ds.val.dtype == np.uint16
    total = len(ds.train) + len(ds.val)
    assert total == 1_115_394
    assert len(ds.train) == int(total * 0.9)
    text = ds.path.read_text()
    assert ds.vocab.decode(ds.train[:50]) == text[:50]
    assert ds.vocab.decode(ds.val[-50:]) == text[-50:]


def test_vocab_roundtrip_non_ascii():
    vocab = CharVocab.from_text("héllo wörld")
    ids = vocab.encode("wörld héllo")
    assert ids.dtype == np.uint16
    assert vocab.decode(ids) == "wörld héllo"
    with pytest.raises(KeyError):
        CharVocab.from_text("abc").encode("abd")


def test_wrong_checksum_is_rejected_and_file_untouched(data_path, tmp_path):
    copy = tmp_path / "input.txt"
    copy.write_bytes(data_path.read_bytes()[:5000])
    before = copy.read_bytes()
    with pytest.raises(DataError, match="sha256 .* expected"):
        fetch_dataset(copy, None, TINYSHAKESPEARE_SHA256)
    assert copy.read_bytes() == before


def test_missing_file_without_url(tmp_path):
    with pytest.raises(DataError, match="does not exist and no data_url"):
        fetch_dataset(tmp_path / "nope.txt", None, None)


def test_download_via_url_verifies_and_renames_atomically(data_path, tmp_path):
    dest = tmp_path / "dl" / "input.txt"
    got = fetch_dataset(dest, data_path.as_uri(), TINYSHAKESPEARE_SHA256)
    assert got == dest
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == TINYSHAKESPEARE_SHA256
    assert sorted(os.listdir(dest.parent)) == [".input.txt.lock", "input.txt"]


def test_download_with_wrong_checksum_leaves_nothing(data_path, tmp_path):
    dest = tmp_path / "dl" / "input.txt"
    with pytest.raises(DataError, match="expected 0000"):
        fetch_dataset(dest, data_path.as_uri(), "0" * 64)
    assert not dest.exists()
    assert [n for n in os.listdir(dest.parent) if n.endswith(".part")] == []


def test_download_failure_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="cannot download"):
        fetch_dataset(tmp_path / "x.txt", (tmp_path / "absent.txt").as_uri(), None)


def test_block_size_larger_than_data(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("to be or not to be, that is the question\n" * 3)
    ds = load_dataset(small)
    ds.check_block_size(8)
    with pytest.raises(DataError, match="block_size 64 is larger than the data"):
        ds.check_block_size(64)


def test_sampler_epoch_covers_disjoint_windows_in_bounds():
    n_tokens, block = 10_000, 31
    sampler = WindowSampler(n_tokens, block, seed=5)
    per_epoch = sampler.windows_per_epoch
    assert per_epoch == (n_tokens - block) // (block + 1)
    for epoch in range(3):
        starts = sampler.starts(np.arange(epoch * per_epoch, (epoch + 1) * per_epoch))
        assert starts.min() >= 0 and starts.max() + block + 1 <= n_tokens
        order = np.sort(starts)
        assert np.all(np.diff(order) == block + 1)  # every window once, no overlap
    e0 = sampler.starts(np.arange(per_epoch))
    e1 = sampler.starts(np.arange(per_epoch, 2 * per_epoch))
    assert not np.array_equal(e0, e1)


def test_sampler_is_a_pure_function_of_seed_and_index():
    a = WindowSampler(50_000, 63, seed=1)
    b = WindowSampler(50_000, 63, seed=1)
    idx = np.array([0, 7, 123_456, 3, 999_999])
    assert np.array_equal(a.starts(idx), b.starts(idx))
    assert np.array_equal(a.starts(idx[::-1]), b.starts(idx)[::-1])  # order of queries is irrelevant
    c = WindowSampler(50_000, 63, seed=2)
    assert not np.array_equal(a.starts(np.arange(100)), c.starts(np.arange(100)))
    with pytest.raises(ValueError):
        a.starts(np.array([-1]))


def consumed_by_step(samples_seen, world_size, plan):
    """Global indices read by all ranks at one step, in (micro-step, rank) order."""
    out = []
    for micro in range(plan.grad_accum_steps):
        for rank in range(world_size):
            out.append(rank_sample_indices(samples_seen, rank, world_size, plan.per_rank_batch_size, micro))
    return np.concatenate(out)


@pytest.mark.parametrize("policy", ["keep_per_rank", "keep_global"])
def test_same_global_sample_sequence_at_world_sizes_1_2_3(shakespeare, policy):
    """A run whose world size goes 3 -> 1 -> 2 reads exactly the windows of an all-1 run."""
    sampler = WindowSampler(len(shakespeare.train), 64, seed=1337)
    seen, consumed = 0, []
    for world_size, steps in ((3, 4), (1, 3), (2, 5)):
        plan = plan_batch(policy, world_size, 12, 36, global_batch_size=36)
        for _ in range(steps):
            idx = consumed_by_step(seen, world_size, plan)
            assert np.array_equal(np.sort(idx), np.arange(seen, seen + plan.global_batch_size))
            consumed.append(idx)
            seen += plan.global_batch_size
    consumed = np.concatenate(consumed)
    assert np.array_equal(np.sort(consumed), np.arange(seen))  # nothing repeated or skipped
    # the windows each rank reads are those a single process reads for the same indices
    x_all, y_all = get_batch(shakespeare.train, sampler, np.arange(seen))
    x_parts, y_parts = get_batch(shakespeare.train, sampler, consumed)
    order = np.argsort(consumed)
    assert np.array_equal(x_parts.numpy()[order], x_all.numpy())
    assert np.array_equal(y_parts.numpy()[order], y_all.numpy())


def test_batch_targets_are_inputs_shifted(shakespeare):
    sampler = WindowSampler(len(shakespeare.train), 16, seed=3)
    x, y = get_batch(shakespeare.train, sampler, np.arange(4))
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype
    assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())
