"""A character-level corpus built at run time from the Python standard library's own source files.

Every machine that runs this package has the corpus, so the examples, benchmarks and tests need no
download. The text is deterministic for a given Python installation (files in sorted order, cut at
``max_chars``), and the vocabulary does not depend on the text at all: printable ASCII, newline and one
unknown symbol, so a model trained under one Python version reads the same token ids under another.
"""

from __future__ import annotations

import logging
import os
import string
import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_pstar.demos.output import first_process

__all__ = [
    "UNKNOWN",
    "VOCAB",
    "CharDataset",
    "StdlibCharDataModule",
    "decode",
    "encode",
    "stdlib_source_files",
    "stdlib_text",
]

log = logging.getLogger(__name__)

UNKNOWN = "\ufffd"
"""Stands for every character outside :data:`VOCAB`'s printable ASCII and newline (tabs included)."""

VOCAB: tuple[str, ...] = (UNKNOWN, "\n", *sorted(set(string.printable) - set(string.whitespace) | {" "}))
"""Token id -> character. Id 0 is :data:`UNKNOWN`; 97 symbols in all."""

_ASCII_TO_ID = torch.zeros(128, dtype=torch.long)  # id 0 (UNKNOWN) for every code point not in VOCAB
for _i, _ch in enumerate(VOCAB[1:], start=1):
    _ASCII_TO_ID[ord(_ch)] = _i

# Directories under the stdlib path that are not ordinary standard-library code: third-party installs, test
# suites, and generated data (codec tables in encodings/, a giant docs string in pydoc_data/), which are so
# repetitive that a validation split landing on them would report a misleadingly low loss.
_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings", "pydoc_data"}
)


def encode(text: str) -> torch.Tensor:
    """Map ``text`` to a 1-D int64 tensor of token ids, one per character."""
    # utf-32 gives one fixed-width code point per character, so the mapping is a table look-up.
    codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).long()
    ids = _ASCII_TO_ID[codes.clamp(max=127)]
    return torch.where(codes < 128, ids, torch.zeros_like(ids))


def decode(ids: torch.Tensor | list[int]) -> str:
    """Map token ids back to text; unknown characters, and ids past the vocabulary (a model's vocab_size may
    be padded beyond it), come back as :data:`UNKNOWN`."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    return "".join(VOCAB[i] if 0 <= i < len(VOCAB) else UNKNOWN for i in values)


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """The ``*.py`` files of the standard library, sorted by their path relative to ``root``."""
    base = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        # Pruning in place keeps the walk out of site-packages, which can be far larger than the stdlib.
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def stdlib_text(max_chars: int = 2_000_000, root: Path | None = None) -> str:
    """Concatenate standard-library sources, in :func:`stdlib_source_files` order, up to ``max_chars``."""
    if max_chars < 2:
        raise ValueError(f"`max_chars` must be >= 2 (one input and one target), got {max_chars}.")
    parts: list[str] = []
    total = 0
    for path in stdlib_source_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text[: max_chars - total])
        total += len(parts[-1])
        if total >= max_chars:
            break
    if total < 2:
        raise RuntimeError(
            f"Found no Python sources under {root or sysconfig.get_paths()['stdlib']!r}."
            " HINT: this corpus needs a Python installation that ships its standard library as .py files."
        )
    return "".join(parts)


class CharDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows ``(x, y)`` of ``block_size`` token ids where ``y`` is ``x`` shifted by one position.

    Window ``i`` starts at ``i * stride``; the default stride, ``block_size``, makes windows that do not
    overlap, so one epoch reads every character once.
    """

    def __init__(self, data: torch.Tensor, block_size: int, stride: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"`block_size` must be >= 1, got {block_size}.")
        stride = block_size if stride is None else stride
        if stride < 1:
            raise ValueError(f"`stride` must be >= 1, got {stride}.")
        if data.dim() != 1 or data.numel() < block_size + 1:
            raise ValueError(
                f"`data` must be 1-D with at least block_size + 1 = {block_size + 1} tokens,"
                f" got shape {tuple(data.shape)}. HINT: raise max_chars or lower block_size."
            )
        self.data = data
        self.block_size = block_size
        self.stride = stride

    def __len__(self) -> int:
        return (self.data.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} windows")
        start = index * self.stride
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class StdlibCharDataModule(L.LightningDataModule):
    """Train/validation split of :func:`stdlib_text`: the first ``1 - val_fraction`` of the characters
    train, the rest validate (a contiguous tail, so no validation window overlaps a training one)."""

    vocab_size: int = len(VOCAB)

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 32,
        max_chars: int = 2_000_000,
        val_fraction: float = 0.1,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"`val_fraction` must be in (0, 1), got {val_fraction!r}.")
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1, got {batch_size}.")
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_chars = max_chars
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.train_set: CharDataset | None = None
        self.val_set: CharDataset | None = None

    def setup(self, stage: str) -> None:
        """Read and encode the corpus once; later stages reuse it."""
        if self.train_set is not None:
            return
        data = encode(stdlib_text(self.max_chars))
        n_val = int(data.numel() * self.val_fraction)
        if first_process():  # every rank reads the same corpus: one says so
            n_train = data.numel() - n_val
            log.info("stdlib corpus: %d characters (%d train, %d validation)", data.numel(), n_train, n_val)
        self.train_set = CharDataset(data[: data.numel() - n_val], self.block_size)
        self.val_set = CharDataset(data[data.numel() - n_val :], self.block_size)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        """Shuffled batches; the order follows the seed set by ``L.seed_everything``."""
        assert self.train_set is not None, "setup() must run before train_dataloader()"
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        """Batches in corpus order."""
        assert self.val_set is not None, "setup() must run before val_dataloader()"
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
