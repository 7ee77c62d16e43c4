"""Tiny-shakespeare: fetch and verify, character vocabulary, uint16 train/val split, and a
deterministic sampler that maps a *global sample index* to a training window.

Why global sample indices: the position in the data is the number of samples the whole group has
consumed (``samples_seen``), not a per-rank iterator state. At an optimizer step with world size
``W``, micro-batch ``m`` and ``A`` accumulation micro-steps, micro-step ``k`` of rank ``r`` takes the
indices ``samples_seen + k*W*m + r*m + [0, m)``; the step consumes exactly
``[samples_seen, samples_seen + W*m*A)``. Window ``i`` depends only on ``(seed, i)``, so a restart
at any world size continues the same sequence, with no index repeated or skipped.

Window order: the token stream is cut into ``n`` non-overlapping windows of ``block_size + 1``
tokens; epoch ``e = i // n`` visits them in a pseudo-random permutation (a sort by a SplitMix64
hash of (seed, stream, epoch, window), Steele et al. 2014) and shifts the cut by an offset drawn
from the same hash, so every window is seen once per epoch and epochs see different alignments.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock

from ddplab.lr import equal_shares
from ddplab.outputs import OutputError, check_writable_dir, fsync_dir

TRAIN_FRACTION = 0.9
#: Sampler streams: training order, evaluation windows of the val split, evaluation windows of train.
STREAM_TRAIN, STREAM_VAL_EVAL, STREAM_TRAIN_EVAL = 0, 1, 2


class DataError(ValueError):
    """The dataset is missing, fails its checksum, or is too small for the configuration."""


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_lock(path: str | Path) -> FileLock:
    """Exclusive advisory lock on ``path`` for the processes of one node (``filelock``: flock(2)
    on Linux; the lock file stays). Use as a context manager; it blocks until the lock is free."""
    return FileLock(str(path))


def download(url: str, dest: str | Path, sha256: str | None, timeout_s: float = 60.0) -> Path:
    """Download ``url`` to ``dest`` atomically: temp file in the same folder, verify, rename.

    Raises:
        DataError: the download fails or its sha256 differs from ``sha256`` (nothing is left
            at ``dest`` then).
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (http/file)
                    while block := resp.read(1 << 20):
                        digest.update(block)
                        out.write(block)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                raise DataError(f"cannot download dataset from {url}: {exc}") from None
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if sha256 is not None and got != sha256:
            raise DataError(
                f"dataset downloaded from {url} has sha256 {got}, expected {sha256}: "
                "fix data_url or data_sha256"
            )
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _exists(path: Path) -> bool:
    """Whether the dataset ``path`` exists (True for anything there: :func:`fetch_dataset` then
    checks that it is a readable file), False when nothing is there.

    Raises:
        DataError: ``path`` is a symbolic link to nothing (it is never downloaded over the link),
            a folder on the way cannot be searched by this uid, or another stat failure (a link loop).
    """
    try:
        path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            raise DataError(f"dataset {path} is a symbolic link to {target}, which does not exist: fix "
                            "the link (or data_path), or remove it to download the dataset") from None
        return False
    except PermissionError as exc:
        raise DataError(f"dataset {path} cannot be reached by uid {os.getuid()} ({exc.strerror}: a "
                        "folder on its path is not searchable by it): fix the folders' permissions "
                        "(chmod o+x, or a group of the training user) or point data_path elsewhere"
                        ) from None
    except OSError as exc:  # ELOOP, ENOTDIR, EIO...
        raise DataError(f"dataset {path} cannot be reached: {exc.strerror or exc}; fix data_path") from None
    return True


def _unreadable(path: Path, exc: OSError) -> DataError:
    """The one-line error of a dataset file that cannot be opened, with its owner and mode."""
    try:
        st = path.stat()
        owner = f"; owner uid {st.st_uid}, mode {st.st_mode & 0o7777:04o}"
    except OSError:
        owner = ""
    if not isinstance(exc, PermissionError):
        return DataError(f"cannot read dataset {path}: {exc.strerror or exc}")
    return DataError(f"dataset {path} is not readable by uid {os.getuid()} ({exc.strerror or exc}{owner}): "
                     f"fix its permissions (e.g. chmod a+r {path}, or make the training user its owner)")


def check_readable_file(path: Path) -> None:
    """Raises DataError (one line) unless ``path`` is a regular file this process can open."""
    if path.is_dir():
        raise DataError(f"dataset {path} is a folder, not a regular file: point data_path at the text "
                        "file (e.g. .../input.txt)")
    if not path.is_file():
        raise DataError(f"dataset {path} is not a regular file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise _unreadable(path, exc) from None


def dataset_present(path: str | Path, url: str | None) -> bool:
    """For ``--check``, touching nothing: True when the dataset file exists (verify it with
    :func:`load_dataset`), False when it would be downloaded from ``url``.

    Raises:
        DataError: missing with no ``url``, its folder could not be created or written, or the
            path cannot be reached (see :func:`_exists`).
    """
    path = Path(path).expanduser()
    if _exists(path):
        return True
    if not url:
        raise DataError(f"dataset {path} does not exist and no data_url is set")
    try:
        check_writable_dir(path.parent, "dataset", create=False)
    except OutputError as exc:
        raise DataError(str(exc)) from None
    return False


def fetch_dataset(path: str | Path, url: str | None, sha256: str | None) -> Path:
    """Return a verified local copy of the dataset: ``path`` if present, else download ``url``.

    Processes of one node share a lock so that only one of them downloads.

    Raises:
        DataError: missing with no URL, download failure, or sha256 mismatch (the local file is
            left untouched in that case).
    """
    path = Path(path).expanduser()
    if not _exists(path):
        if not url:
            raise DataError(f"dataset {path} does not exist and no data_url is set")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataError(f"cannot create dataset folder {path.parent}: {exc.strerror}") from None
        with file_lock(path.parent / f".{path.name}.lock"):
            if not path.exists():
                download(url, path, sha256)
    check_readable_file(path)
    if sha256 is not None:
        try:
            got = sha256_file(path)
        except OSError as exc:
            raise DataError(f"cannot read dataset {path}: {exc.strerror}") from None
        if got != sha256:
            raise DataError(
                f"dataset {path} has sha256 {got}, expected {sha256}: "
                "replace the file (delete it to re-download) or fix data_sha256"
            )
    return path


class CharVocab:
    """Character vocabulary: the sorted set of characters of a text, ids 0..V-1."""

    def __init__(self, chars: str) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("vocabulary characters must be unique")
        if len(chars) > np.iinfo(np.uint16).max:
            raise DataError(f"vocabulary of {len(chars)} characters does not fit uint16")
        self.chars = chars
        self._index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """Text -> uint16 ids (N,). Raises KeyError for a character outside the vocabulary."""
        raw = text.encode("utf-8")
        if len(raw) == len(text) and all(ord(c) < 128 for c in self.chars):  # ASCII: table lookup
            lut = np.full(256, -1, dtype=np.int32)
            for i, c in enumerate(self.chars):
                lut[ord(c)] = i
            ids = lut[np.frombuffer(raw, dtype=np.uint8)]
            if ids.size and ids.min() < 0:
                missing = sorted({chr(b) for b in np.frombuffer(raw, dtype=np.uint8)[ids < 0]})
                raise KeyError(f"characters outside the vocabulary: {missing!r}")
            return ids.astype(np.uint16)
        return np.fromiter((self._index[c] for c in text), dtype=np.uint16, count=len(text))

    def decode(self, ids) -> str:
        """Iterable of ids -> text."""
        return "".join(self.chars[int(i)] for i in ids)


@dataclass
class CharDataset:
    """Encoded corpus: ``train`` and ``val`` are uint16 arrays (first 90 % / last 10 %)."""

    vocab: CharVocab
    train: np.ndarray
    val: np.ndarray
    path: Path

    def check_block_size(self, block_size: int) -> None:
        """Raises DataError when a split cannot hold one window of ``block_size + 1`` tokens."""
        for name, split in (("train", self.train), ("val", self.val)):
            if len(split) < block_size + 1:
                raise DataError(
                    f"block_size {block_size} is larger than the data: the {name} split of "
                    f"{self.path} has {len(split)} characters, a window needs {block_size + 1}; "
                    "lower block_size or use a larger dataset"
                )


def load_dataset(path: str | Path, url: str | None = None, sha256: str | None = None) -> CharDataset:
    """Fetch/verify the text, build the vocabulary and the 90/10 uint16 split.

    Raises:
        DataError: see :func:`fetch_dataset`; also an undecodable or empty file.
    """
    path = fetch_dataset(path, url, sha256)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"dataset {path} is not UTF-8 text: {exc}") from None
    except OSError as exc:  # changed since fetch_dataset checked it, or a read error (EIO)
        raise _unreadable(path, exc) from None
    if len(text) < 2:
        raise DataError(f"dataset {path} is empty")
    vocab = CharVocab.from_text(text)
    ids = vocab.encode(text)
    cut = int(len(ids) * TRAIN_FRACTION)
    return CharDataset(vocab=vocab, train=ids[:cut], val=ids[cut:], path=path)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (Steele, Lea & Flood 2014), element-wise on a uint64 array."""
    z = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def mix(*keys: int) -> int:
    """Hash a tuple of non-negative ints into one uint64 (as a Python int)."""
    h = np.zeros(1, dtype=np.uint64)
    for key in keys:
        h = splitmix64(h ^ np.array([key & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    return int(h[0])


class WindowSampler:
    """Map global sample indices to window start offsets in a token array, deterministically.

    Args:
        n_tokens: length of the split.
        block_size: context length T; a window holds T + 1 tokens (inputs and shifted targets).
        seed: run seed.
        stream: independent stream id (see the ``STREAM_*`` constants).

    Raises:
        DataError: the split is shorter than one window.
    """

    def __init__(self, n_tokens: int, block_size: int, seed: int, stream: int = STREAM_TRAIN) -> None:
        span = block_size + 1
        if n_tokens < span:
            raise DataError(f"{n_tokens} tokens cannot hold one window of {span}")
        self.block_size = block_size
        self.seed = seed
        self.stream = stream
        self.windows_per_epoch = max(1, (n_tokens - block_size) // span)
        self.slack = n_tokens - self.windows_per_epoch * span  # room to shift the cut per epoch
        self._cache: OrderedDict[int, tuple[int, np.ndarray]] = OrderedDict()

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        if epoch in self._cache:
            self._cache.move_to_end(epoch)
            return self._cache[epoch]
        key = mix(self.seed, self.stream, epoch)
        offset = mix(key, 1) % (self.slack + 1)
        order = np.argsort(
            splitmix64(np.uint64(key) ^ np.arange(self.windows_per_epoch, dtype=np.uint64)),
            kind="stable",
        )
        self._cache[epoch] = (offset, order)
        while len(self._cache) > 4:
            self._cache.popitem(last=False)
        return offset, order

    def starts(self, indices: np.ndarray) -> np.ndarray:
        """Global sample indices (N,) int64 >= 0 -> window start offsets (N,) int64."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and indices.min() < 0:
            raise ValueError("sample indices must be >= 0")
        out = np.empty_like(indices)
        epochs = indices // self.windows_per_epoch
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            offset, order = self._epoch(int(epoch))
            slot = indices[sel] % self.windows_per_epoch
            out[sel] = offset + order[slot] * (self.block_size + 1)
        return out


def rank_sample_indices(
    samples_seen: int, rank: int, world_size: int, micro_batch: int, micro_step: int = 0
) -> np.ndarray:
    """Global sample indices (micro_batch,) of ``rank`` at accumulation micro-step ``micro_step``."""
    first = samples_seen + micro_step * world_size * micro_batch + rank * micro_batch
    return np.arange(first, first + micro_batch, dtype=np.int64)


def share_sample_indices(samples_seen: int, rank: int, shares: Sequence[int]) -> np.ndarray:
    """Global sample indices (``shares[rank]``,) int64 of position ``rank``: the contiguous block
    ``rank`` of ``[samples_seen, samples_seen + sum(shares))``."""
    first = samples_seen + sum(shares[:rank])
    return np.arange(first, first + shares[rank], dtype=np.int64)


def participant_sample_indices(
    samples_seen: int, rank: int, participants: int, global_batch: int
) -> np.ndarray:
    """Global sample indices of participant ``rank`` of ``participants`` at one step of a group
    whose participants may change from step to step (the replica-group engines).

    The step consumes ``[samples_seen, samples_seen + global_batch)``, cut into ``participants``
    contiguous blocks in rank order of :func:`ddplab.lr.equal_shares` sizes (the first
    ``global_batch % participants`` blocks hold one sample more). Committed steps advance
    ``samples_seen`` by ``global_batch``, so over any sequence of quorums every index is taken by
    exactly one participant of exactly one committed step (an uncommitted step is retried from
    the same ``samples_seen``).

    Returns an int64 array of ``global_batch // participants`` (+1) indices, possibly empty.

    Raises:
        ValueError: ``rank`` is not in ``[0, participants)`` or a size is negative.
    """
    if participants < 1 or not 0 <= rank < participants:
        raise ValueError(f"rank {rank} is not a participant rank of {participants}")
    if samples_seen < 0 or global_batch < 0:
        raise ValueError("samples_seen and global_batch must be >= 0")
    return share_sample_indices(samples_seen, rank, equal_shares(global_batch, participants))


def batch_from_starts(
    tokens: np.ndarray, starts: np.ndarray, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (B, T) int64 for windows starting at ``starts`` (B,)."""
    offsets = starts[:, None] + np.arange(block_size + 1)[None, :]
    window = torch.from_numpy(tokens[offsets].astype(np.int64))
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def get_batch(
    tokens: np.ndarray, sampler: WindowSampler, indices: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch (inputs, targets), each (len(indices), block_size) int64, for global indices."""
    return batch_from_starts(tokens, sampler.starts(indices), sampler.block_size)
