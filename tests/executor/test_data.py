"""Executor data: determinism of the sources, next-token targets, corpus epoch coverage and
continuation, dp sharding, the context-parallel split of sequences, the corpus cache, and
the error messages."""

import os

import numpy as np
import pytest
import torch

import executor.data as data
from executor.data import (
    BUILTIN_CORPUS,
    CorpusTokens,
    SyntheticTokens,
    TokenSource,
    byte_tokenize,
    context_positions,
    context_shard,
    dp_shard,
    load_corpus,
    make_source,
)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """Keep every cache this file writes (make_source uses the default dir) under tmp_path."""
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def arange_corpus(n, seed=0):
    # Token t has id t, so a window's first input token tells where the window starts.
    return CorpusTokens(torch.arange(n, dtype=torch.int64), seed)


def test_synthetic_is_deterministic_per_step_and_in_range():
    src = SyntheticTokens(vocab_size=50, seed=3)
    x, y = src.global_batch(7, 4, 16)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    x2, y2 = SyntheticTokens(vocab_size=50, seed=3).global_batch(7, 4, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    # Step 7 does not depend on having drawn steps 0..6 first.
    for step in range(7):
        src.global_batch(step, 4, 16)
    assert torch.equal(src.global_batch(7, 4, 16)[0], x)
    assert not torch.equal(src.global_batch(8, 4, 16)[0], x)
    assert not torch.equal(SyntheticTokens(vocab_size=50, seed=4).global_batch(7, 4, 16)[0], x)
    # torch keeps 32 bits of a generator seed; the seed must still matter, and not swap with the step.
    assert not torch.equal(SyntheticTokens(50, seed=0).global_batch(1, 4, 16)[0], SyntheticTokens(50, seed=1).global_batch(0, 4, 16)[0])
    big = src.global_batch(0, 64, 64)[0]
    assert int(big.min()) == 0 and int(big.max()) == 49  # covers the range, never leaves it


@pytest.mark.parametrize(
    "src", [SyntheticTokens(vocab_size=300, seed=1), arange_corpus(1000, seed=1)], ids=["synthetic", "corpus"]
)
def test_targets_are_inputs_shifted_by_one(src):
    assert isinstance(src, TokenSource)
    for step in (0, 5):
        x, y = src.global_batch(step, 3, 10)
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_corpus_windows_are_the_documented_slices():
    tokens = torch.arange(100, 200, dtype=torch.int64)
    src = CorpusTokens(tokens, seed=2)
    starts = src.window_starts(1, 4, 8)
    x, y = src.global_batch(1, 4, 8)
    for b, s in enumerate(starts.tolist()):
        assert s % 8 == 0
        assert torch.equal(x[b], tokens[s : s + 8]) and torch.equal(y[b], tokens[s + 1 : s + 9])


def test_corpus_sees_every_window_once_per_epoch():
    seq_len, batch = 4, 5
    src = arange_corpus(41, seed=7)  # (41 - 1) // 4 = 10 windows, 2 steps per epoch
    assert src.num_samples(seq_len) == 10
    seen = [int(j) for step in range(2) for j in src.global_batch(step, batch, seq_len)[0][:, 0] // seq_len]
    assert sorted(seen) == list(range(10))
    assert seen != list(range(10))  # shuffled, not read in order
    # The next epoch draws a new order over the same windows.
    seen_next = [int(j) for step in range(2, 4) for j in src.global_batch(step, batch, seq_len)[0][:, 0] // seq_len]
    assert sorted(seen_next) == list(range(10)) and seen_next != seen


def test_corpus_batches_continue_across_epochs():
    seq_len, batch = 4, 4
    src = arange_corpus(41, seed=0)  # 10 windows: step 2 holds epoch 0's last 2 and epoch 1's first 2
    order0 = torch.randperm(10, generator=data._generator(0, 0)).tolist()
    order1 = torch.randperm(10, generator=data._generator(0, 1)).tolist()
    assert order0 != order1
    steps = [(src.global_batch(step, batch, seq_len)[0][:, 0] // seq_len).tolist() for step in range(5)]
    flat = [j for s in steps for j in s]
    assert flat == order0 + order1  # 20 samples = exactly two epochs, back to back
    assert steps[2] == order0[8:] + order1[:2]


def test_corpus_is_deterministic_and_seeded():
    a = arange_corpus(500, seed=1).global_batch(3, 6, 7)[0]
    assert torch.equal(a, arange_corpus(500, seed=1).global_batch(3, 6, 7)[0])
    assert not torch.equal(a, arange_corpus(500, seed=2).global_batch(3, 6, 7)[0])


def test_dp_shard_slices_concatenate_to_the_global_batch():
    x, y = SyntheticTokens(vocab_size=100).global_batch(0, 8, 5)
    shards = [dp_shard(x, y, rank, 4) for rank in range(4)]
    assert all(sx.shape == (2, 5) for sx, _ in shards)
    assert torch.equal(shards[1][0], x[2:4]) and torch.equal(shards[1][1], y[2:4])
    assert torch.equal(torch.cat([sx for sx, _ in shards]), x)
    assert torch.equal(torch.cat([sy for _, sy in shards]), y)
    with pytest.raises(ValueError, match="does not divide across dp=3"):
        dp_shard(x, y, 0, 3)
    with pytest.raises(ValueError, match="dp_rank"):
        dp_shard(x, y, 4, 4)


def test_byte_tokenize_is_utf8_bytes():
    ids = byte_tokenize("hé!")
    assert ids.dtype == np.int64
    assert ids.tolist() == [104, 0xC3, 0xA9, 33]


def test_load_corpus_caches_the_ids(tmp_path, monkeypatch):
    text = tmp_path / "tiny.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n", encoding="utf-8")
    cache = tmp_path / "cache"
    first = load_corpus(text, cache)
    assert first.dtype == torch.int64 and first.tolist() == list(text.read_bytes())
    (cached,) = cache.glob("*.npy")
    assert not list(cache.glob("*.tmp"))  # the temporary file was renamed into place
    assert np.array_equal(np.load(cached, allow_pickle=False), first.numpy())
    mtime = os.stat(cached).st_mtime_ns

    def no_tokenizing(_text):
        raise AssertionError("the second load must read the cache, not tokenize again")

    monkeypatch.setattr(data, "byte_tokenize", no_tokenizing)
    assert torch.equal(load_corpus(text, cache), first)
    assert os.stat(cached).st_mtime_ns == mtime
    # A changed text has a new sha256, so it misses the cache and tokenizes afresh.
    text.write_text("a different text\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="second load"):
        load_corpus(text, cache)


def test_builtin_corpus_is_real_text_within_size(cache_dir):
    assert 50_000 <= BUILTIN_CORPUS.stat().st_size <= 300_000
    ids = load_corpus()
    assert len(ids) == BUILTIN_CORPUS.stat().st_size
    assert 0 <= int(ids.min()) and int(ids.max()) <= 255
    assert b"statement" in bytes(ids[:2000].tolist())
    assert len(list(cache_dir.glob("*.npy"))) == 1  # $SHARDWISE_CACHE is the default cache dir


def test_make_source(tmp_path, cache_dir):
    assert make_source("synthetic", 17, seed=2) == SyntheticTokens(17, 2)
    corpus = make_source("corpus", 256, seed=5)
    assert isinstance(corpus, CorpusTokens) and corpus.seed == 5
    assert len(corpus.tokens) == BUILTIN_CORPUS.stat().st_size
    text = tmp_path / "mine.txt"
    text.write_text("abcdefghij" * 10, encoding="utf-8")
    mine = make_source(str(text), 512)
    assert mine.tokens.tolist() == list(text.read_bytes())


def test_errors_name_the_problem(tmp_path, cache_dir):
    with pytest.raises(ValueError, match=r"byte-level corpus needs vocab_size >= 256, the model has 128"):
        make_source("corpus", 128)
    with pytest.raises(ValueError, match="'wikitext'"):
        make_source("wikitext", 50_000)
    with pytest.raises(ValueError, match=r"too small for one sample of seq_len=8"):
        arange_corpus(8).global_batch(0, 1, 8)  # 8 tokens, needs 9
    with pytest.raises(ValueError, match=r"holds 2 samples of seq_len=8, fewer than one batch of 3"):
        arange_corpus(17).global_batch(0, 3, 8)
    with pytest.raises(ValueError, match="1-D"):
        CorpusTokens(torch.zeros(2, 3, dtype=torch.int64))


def test_context_positions_give_each_rank_an_early_and_a_late_chunk():
    """Load-balanced causal split (Llama 3 §3.3.2): 2 cp chunks, rank i holding chunks i and
    2cp - 1 - i; together the ranks hold every position once."""
    assert context_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert context_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert context_positions(16, 1, 4).tolist() == [2, 3, 12, 13]
    assert context_positions(6, 0, 1).tolist() == list(range(6))
    every = torch.cat([context_positions(48, r, 3) for r in range(3)])
    assert sorted(every.tolist()) == list(range(48))
    with pytest.raises(ValueError, match="2 cp dividing the sequence"):
        context_positions(12, 0, 4)


def test_context_shard_cuts_inputs_and_targets_at_the_same_positions():
    x, y = arange_corpus(100).global_batch(0, 2, 8)
    xs, ys = context_shard(x, y, 1, 2)
    assert xs.shape == ys.shape == (2, 4)
    assert torch.equal(xs, x[:, 2:6]) and torch.equal(ys, y[:, 2:6])
    assert torch.equal(ys, xs + 1)   # each target still the token after its input
