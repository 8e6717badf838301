"""Character-level language-modelling data: a tokenizer built from the text, and windows of it.

As in nanoGPT's shakespeare_char: the vocabulary is the sorted set of characters of the whole
file, the first 90% is the training split and the rest validation, and a training example is a
random contiguous window x = text[i : i + block_size] with targets y = text[i + 1 : i + 1 + block_size].
Training windows start at offsets drawn from (seed, epoch, index), so a resumed run sees the
windows an uninterrupted one would; validation windows are one fixed set (its own seed), so val
loss compares across runs and resumes.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from vit.data.sampling import ResumableSampler, resumable_loader
from vit.options import number, require, whole
from vit.seeds import RunSeed

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


class CharTokenizer:
    """One token per character; `vocab` is the string of all characters in token-id order."""

    def __init__(self, vocab: str) -> None:
        if not vocab or len(set(vocab)) != len(vocab):
            raise ValueError("a vocabulary must be a non-empty string of distinct characters")
        self.vocab = vocab
        self.stoi = {ch: i for i, ch in enumerate(vocab)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            raise ValueError(
                f"characters not in the vocabulary: {''.join(unknown)!r} ({len(unknown)}); the vocabulary is the "
                f"{len(self)} characters of the training text: {self.vocab!r}"
            )
        return [self.stoi[ch] for ch in text]

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's contents, with errors that name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e})") from e
    if not text:
        raise ValueError(f"{path} is empty; a language model needs text to learn from")
    return text


def _window(tokens: torch.Tensor, start: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = tokens[start : start + block_size + 1]
    return chunk[:-1], chunk[1:]


class RandomWindows(Dataset):
    """Training windows: item `(index, seed)` (from ResumableSampler) is the window starting at an
    offset drawn from `seed`. `length` only sets how many windows make an epoch."""

    def __init__(self, tokens: torch.Tensor, block_size: int, length: int) -> None:
        self.tokens, self.block_size, self.length = tokens, block_size, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, item: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        _, seed = item
        start = int(np.random.default_rng(seed).integers(len(self.tokens) - self.block_size))
        return _window(self.tokens, start, self.block_size)


class FixedWindows(Dataset):
    """Evaluation windows at given start offsets."""

    def __init__(self, tokens: torch.Tensor, block_size: int, starts: list[int]) -> None:
        self.tokens, self.block_size, self.starts = tokens, block_size, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _window(self.tokens, self.starts[i], self.block_size)


class TextDataModule(RunSeed, L.LightningDataModule):
    """Character-level language modelling on one UTF-8 text file.

    Args:
        path: the text file; None downloads Tiny Shakespeare (1.1 MB) to `download_dir` once.
        block_size: context length, the window size (the model's block_size defaults to it).
        batch_size: windows per step and process.
        val_fraction: the last part of the text held out for validation.
        val_holdout: a share of the training text (its end) held out as the validation split, for
            tuning: the `val_fraction` part is then the test split (`scripts/train.py test`) and
            validation never sees it. 0: validation scores the `val_fraction` part.
        val_windows: how many fixed windows (start offsets drawn with `val_seed`) validation (and
            the test) scores, at most one per start offset the split has.
        num_workers: loader processes; windows are slices of one tensor, so 0 is usually fastest.
    """

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 64,
        batch_size: int = 12,
        val_fraction: float = 0.1,
        val_holdout: float = 0.0,
        val_windows: int = 1000,
        val_seed: int = 0,
        num_workers: int = 0,
        download_dir: str = "data",
    ) -> None:
        super().__init__()
        whole(block_size, 1, "data.block_size", "characters of context")
        whole(batch_size, 1, "data.batch_size", "windows per batch")
        number(val_fraction, "data.val_fraction", "the share of the text held out, in (0, 1)", 0, 1, open_low=True)
        require(val_fraction < 1, "data.val_fraction", val_fraction, "the share of the text held out, in (0, 1)")
        number(val_holdout, "data.val_holdout", "the share of the training text held out, in [0, 1)", 0, 1)
        require(val_holdout < 1, "data.val_holdout", val_holdout, "the share of the training text held out, in [0, 1)")
        whole(val_windows, 1, "data.val_windows", "windows validation scores")
        whole(num_workers, 0, "data.num_workers", "loader processes; 0 loads in the training process")
        self.path = path
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.val_holdout = val_holdout
        self.val_windows = val_windows
        self.val_seed = val_seed
        self.num_workers = num_workers
        self.download_dir = download_dir
        self.tokenizer: CharTokenizer | None = None
        self.train_set: RandomWindows | None = None
        self.val_set: FixedWindows | None = None
        self.test_set: FixedWindows | None = None

    @property
    def text_path(self) -> Path:
        return Path(self.path) if self.path is not None else Path(self.download_dir) / "tinyshakespeare.txt"

    def prepare_data(self) -> None:
        if self.path is None and not self.text_path.is_file():
            self.text_path.parent.mkdir(parents=True, exist_ok=True)
            print(f"Downloading Tiny Shakespeare to {self.text_path}")
            partial = self.text_path.with_name(self.text_path.name + ".part")  # never read a broken download as text
            try:  # one try with a timeout: a cut network fails in seconds, and the way out is a local file
                with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=30) as response:
                    partial.write_bytes(response.read())
            except OSError as e:  # URLError, a timeout, a full disk
                partial.unlink(missing_ok=True)
                raise OSError(
                    f"could not download Tiny Shakespeare ({e}): fetch {TINY_SHAKESPEARE_URL} elsewhere "
                    f"and pass the file with --data.path /path/to/input.txt (or put it at {self.text_path})"
                ) from e
            partial.replace(self.text_path)

    def setup(self, stage: str | None = None) -> None:
        self.take_run_seed()  # a resume then restores the checkpoint's (RunSeed)
        if self.train_set is not None:
            return
        text = read_text(self.text_path)
        self.tokenizer = CharTokenizer.from_text(text)
        tokens = torch.tensor(self.tokenizer.encode(text), dtype=torch.long)
        n_train = int(len(tokens) * (1 - self.val_fraction))
        n_fit = n_train - int(n_train * self.val_holdout)
        train, held, test = tokens[:n_fit], tokens[n_fit:n_train], tokens[n_train:]
        splits = [("training", train), ("held-out validation", held)] if self.val_holdout else [("training", train)]
        for name, split in (*splits, ("validation" if not self.val_holdout else "test", test)):
            if len(split) <= self.block_size:
                raise ValueError(
                    f"the {name} split of {self.text_path} has {len(split)} characters, not more than "
                    f"block_size {self.block_size} (a window needs block_size + 1); use a longer text or a "
                    "smaller block_size"
                )
        self.train_set = RandomWindows(train, self.block_size, max(1, len(train) // self.block_size))
        self.test_set = self._fixed_windows(test)
        self.val_set = self._fixed_windows(held) if self.val_holdout else self.test_set

    def _fixed_windows(self, tokens: torch.Tensor) -> FixedWindows:
        """`val_windows` windows of `tokens` at start offsets drawn with `val_seed`."""
        rng = np.random.default_rng(self.val_seed)
        starts = rng.integers(len(tokens) - self.block_size, size=min(self.val_windows, len(tokens) - self.block_size))
        return FixedWindows(tokens, self.block_size, starts.tolist())

    def train_dataloader(self) -> DataLoader:
        return resumable_loader(
            self.train_set,
            ResumableSampler(self.train_set, shuffle=True, seed=self.seed),
            self.trainer,
            batch_size=self.batch_size,
            drop_last=len(self.train_set) > self.batch_size,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
