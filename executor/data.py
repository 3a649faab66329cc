"""Data: the token batches that a training step consumes.

This module owns three things:

* the sources of token batches. ``SyntheticTokens`` draws random ids, and
  ``CorpusTokens`` cuts windows out of a small real text (by default the
  built-in corpus in ``executor/corpus/``, tokenized one byte per token);
* loading and caching that corpus as token ids;
* splitting a global batch across data-parallel ranks (``dp_shard``; ``replica_shard``
  for a plan's shares, uneven on a mixed cluster where a faster replica takes more),
  and each sequence across context-parallel ranks (``context_shard``, at the token
  positions ``context_positions`` names).

Every source is a pure function of (seed, step). Every rank builds the same
global batch for a step and keeps its own slice of it, so ranks need no
communication to agree on data. A resumed run gets the same batches as a run
that never stopped.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from costmodel.specs.loading import path_kind
from costmodel.strategy import Strategy

BUILTIN_CORPUS = Path(__file__).parent / "corpus" / "python_reference.txt"
BYTE_VOCAB = 256  # a byte-level tokenizer uses ids 0..255

# The version goes into the cache file name, so a change to the tokenizer
# never reads ids that an older version wrote.
_TOKENIZER_TAG = "bytes-v1"


@runtime_checkable
class TokenSource(Protocol):
    def global_batch(self, step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 of shape [batch_size, seq_len]; targets are inputs shifted by one token.
        Same arguments -> same tensors, on every process, in every run."""
        ...


def _generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one (seed, stream) pair, e.g. stream = step or epoch.

    The seed is plain arithmetic, not hash(), because Python salts string hashes
    per process. Every process therefore gets the same numbers. Seeding each
    stream on its own means step k never depends on having drawn steps 0..k-1.

    torch's CPU generator (mt19937) uses only the low 32 bits of its seed, so
    the pair is folded into 32 bits. The seed shifts the stream by an odd
    multiple of 0x9E3779B9 (2**32 / golden ratio). One seed's streams stay
    distinct, and two nearby seeds meet only billions of steps apart.
    """
    return torch.Generator().manual_seed((stream + seed * 0x9E3779B9) % 2**32)


def _check_shape(step: int, batch_size: int, seq_len: int) -> None:
    if step < 0 or batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"data: need step >= 0, batch_size >= 1 and seq_len >= 1, got {step}, {batch_size}, {seq_len}"
        )


def _split(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T+1] windows -> (inputs, targets) of shape [B, T]. Targets are the next token."""
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


@dataclass(frozen=True)
class SyntheticTokens:
    """Uniformly random token ids. They carry no signal but cost nothing to make,
    which suits timing runs and smoke tests."""

    vocab_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"data: vocab_size must be >= 1, got {self.vocab_size}")

    def global_batch(self, step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        _check_shape(step, batch_size, seq_len)
        # Draw seq_len + 1 ids per row, so that targets are inputs shifted by one,
        # the same as for a real corpus.
        windows = torch.randint(
            0, self.vocab_size, (batch_size, seq_len + 1), generator=_generator(self.seed, step), dtype=torch.int64
        )
        return _split(windows)


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors with == is elementwise, not a bool
class CorpusTokens:
    """Windows of seq_len + 1 tokens cut from one long 1-D token tensor.

    The corpus splits into num_samples = (len(tokens) - 1) // seq_len windows.
    Window j starts at token j * seq_len. Each epoch visits all windows in a
    random order drawn from (seed, epoch). Step k takes samples
    k * batch_size .. (k + 1) * batch_size - 1, counted across epochs, so a
    batch that runs past the end of one epoch carries on into the next
    epoch's order. Every window is seen exactly once per epoch.
    """

    tokens: torch.Tensor
    seed: int = 0

    def __post_init__(self) -> None:
        tokens = torch.as_tensor(self.tokens, dtype=torch.int64)
        if tokens.dim() != 1:
            raise ValueError(f"data: corpus tokens must be 1-D, got shape {tuple(tokens.shape)}")
        object.__setattr__(self, "tokens", tokens)  # frozen dataclass: assign the converted tensor this way

    def num_samples(self, seq_len: int) -> int:
        # Each window needs one token past its end for the last target. That is
        # why the count uses len - 1. Neighbouring windows share that one token.
        return (len(self.tokens) - 1) // seq_len

    def _permutation(self, epoch: int, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=_generator(self.seed, epoch))

    def window_starts(self, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """Token offset of each sample's window in step `step`, shape [batch_size]."""
        _check_shape(step, batch_size, seq_len)
        n = self.num_samples(seq_len)
        if n < 1:
            raise ValueError(
                f"data: corpus of {len(self.tokens)} tokens is too small for one sample of seq_len={seq_len} "
                f"(needs {seq_len + 1} tokens)"
            )
        if n < batch_size:
            raise ValueError(
                f"data: corpus of {len(self.tokens)} tokens holds {n} samples of seq_len={seq_len}, "
                f"fewer than one batch of {batch_size}"
            )
        first = step * batch_size
        # batch_size <= n, so one batch touches at most two epochs. Drawing
        # their orders again on each call costs little (randperm of n) and
        # keeps the class stateless.
        orders: dict[int, torch.Tensor] = {}
        starts = []
        for sample in range(first, first + batch_size):
            epoch, position = divmod(sample, n)
            if epoch not in orders:
                orders[epoch] = self._permutation(epoch, n)
            starts.append(int(orders[epoch][position]) * seq_len)
        return torch.tensor(starts, dtype=torch.int64)

    def global_batch(self, step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.window_starts(step, batch_size, seq_len)
        # One gather: row b holds tokens[starts[b] : starts[b] + seq_len + 1].
        windows = self.tokens[starts[:, None] + torch.arange(seq_len + 1)]
        return _split(windows)


def byte_tokenize(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids 0..255. A byte-level tokenizer needs no vocabulary file."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def default_cache_dir() -> Path:
    return Path(os.environ.get("SHARDWISE_CACHE") or Path.home() / ".cache" / "shardwise")


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """Write the file under a temporary name and then rename it. A crash, or a
    second rank writing the same file, never leaves a half-written .npy behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_corpus(path: str | Path | None = None, cache_dir: str | Path | None = None) -> torch.Tensor:
    """The token ids of a UTF-8 text file (default: the built-in corpus) as a 1-D int64 tensor.

    The ids are cached as a .npy file under cache_dir (default: $SHARDWISE_CACHE
    or ~/.cache/shardwise). The file name holds the sha256 of the text bytes,
    so an edited text gets a new entry and never reads stale ids.
    """
    raw = Path(path if path is not None else BUILTIN_CORPUS).read_bytes()
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_file = cache_dir / f"{_TOKENIZER_TAG}-{hashlib.sha256(raw).hexdigest()}.npy"
    if cache_file.exists():
        ids = np.load(cache_file, allow_pickle=False)  # never unpickle: the cache dir may be shared
    else:
        ids = byte_tokenize(raw.decode("utf-8"))
        _save_npy_atomic(cache_file, ids)
    return torch.from_numpy(ids)


def make_source(name: str, vocab_size: int, seed: int = 0) -> TokenSource:
    """The token source called `name`: "synthetic", "corpus" (the built-in corpus) or the path to a .txt file."""
    if name == "synthetic":
        return SyntheticTokens(vocab_size, seed)
    if name != "corpus" and path_kind(name) != "file":
        raise ValueError(f"data: unknown data source {name!r}: expected 'synthetic', 'corpus' or the path to a text file")
    # Byte ids go up to 255, so a smaller embedding table would index out of range.
    if vocab_size < BYTE_VOCAB:
        raise ValueError(f"data: the byte-level corpus needs vocab_size >= {BYTE_VOCAB}, the model has {vocab_size}")
    return CorpusTokens(load_corpus(None if name == "corpus" else name), seed)


def check_source(name: str, vocab_size: int, global_batch: int, seq_len: int) -> None:
    """What a run's ranks would find wrong with its data, found before they start:
    an unknown source, a file that cannot be read or is not UTF-8 text, a corpus too
    short for one global batch. ValueError saying which."""
    if name == "synthetic":
        return
    try:
        make_source(name, vocab_size).window_starts(0, global_batch, seq_len)
    except OSError as err:
        raise ValueError(f"data: cannot read {name}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"data: {name} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def dp_shard(inputs: torch.Tensor, targets: torch.Tensor, dp_rank: int, dp: int,
             sizes: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's contiguous slice of the global batch, along dim 0:
    equal slices, or `sizes[r]` sequences for rank r (the sizes add up to the batch)."""
    if inputs.shape != targets.shape:
        raise ValueError(f"data: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ in shape")
    if dp < 1 or not 0 <= dp_rank < dp:
        raise ValueError(f"data: need 0 <= dp_rank < dp, got dp_rank={dp_rank}, dp={dp}")
    batch = inputs.shape[0]
    if sizes is not None:
        if len(sizes) != dp or sum(sizes) != batch or min(sizes) < 1:
            raise ValueError(f"data: shares {list(sizes)} of dp={dp} ranks do not split a global batch of {batch}")
        start = sum(sizes[:dp_rank])
        rows = slice(start, start + sizes[dp_rank])
        return inputs[rows], targets[rows]
    if batch % dp:
        raise ValueError(f"data: global batch of {batch} does not divide across dp={dp} ranks")
    per_rank = batch // dp
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return inputs[rows], targets[rows]


def replica_shard(inputs: torch.Tensor, targets: torch.Tensor, strategy: Strategy,
                  dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica `dp_rank`'s rows: its `Strategy.replica_share` of the global batch's
    micro-batches. An equal slice on a uniform plan; on a mixed cluster's replica
    groups each replica takes replica_microbatches[d] micro-batches."""
    if not strategy.replica_microbatches:
        return dp_shard(inputs, targets, dp_rank, strategy.dp)
    sizes = [strategy.replica_share(d)[1] * strategy.micro_batch_size for d in range(strategy.dp)]
    return dp_shard(inputs, targets, dp_rank, strategy.dp, sizes)


def context_positions(seq_len: int, cp_rank: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of the tokens context-parallel rank `cp_rank` of `cp` holds of a
    sequence of `seq_len`: chunks cp_rank and 2cp - 1 - cp_rank of 2cp equal chunks,
    concatenated (the load-balanced causal split, Llama 3, Dubey et al. 2024 §3.3.2:
    each rank holds an early and a late chunk, so the causal attention work is equal)."""
    if cp < 1 or not 0 <= cp_rank < cp or seq_len % (2 * cp):
        raise ValueError(f"data: need 0 <= cp_rank < cp and 2 cp dividing the sequence, got cp_rank={cp_rank}, "
                         f"cp={cp}, seq_len={seq_len}")
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in (cp_rank, 2 * cp - 1 - cp_rank)])


def context_shard(inputs: torch.Tensor, targets: torch.Tensor, cp_rank: int,
                  cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Context-parallel rank `cp_rank`'s tokens of every sequence, along dim 1, at
    `context_positions` (inputs and targets cut alike, after the next-token shift)."""
    if inputs.shape != targets.shape:
        raise ValueError(f"data: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ in shape")
    positions = context_positions(inputs.shape[1], cp_rank, cp, inputs.device)
    return inputs[:, positions], targets[:, positions]
