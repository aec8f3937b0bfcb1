"""Token data for the test models: learnable arithmetic sequences, fully determined by a seed."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from tests.helpers.models import BLOCK, VOCAB

DATA_SEED = 4321


def make_dataset(n_seq: int, seed: int = DATA_SEED, *, noise: float = 0.1) -> TensorDataset:
    """Arithmetic token sequences (start + k * stride mod VOCAB) with a share ``noise`` of random tokens.

    Learnable but not trivial, fully determined by ``seed``. Inputs and targets are shifted by one. With
    ``noise=0`` no random tokens are drawn, so the sequences are the noisy ones before the noise.
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n_seq, 1), generator=g)
    stride = torch.randint(1, 4, (n_seq, 1), generator=g)
    seq = (start + stride * torch.arange(BLOCK + 1)) % VOCAB  # (N, BLOCK + 1)
    if noise > 0:
        hit = torch.rand(seq.shape, generator=g) < noise
        seq = torch.where(hit, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


def make_loader(n_seq: int = 48, batch_size: int = 4, seed: int = DATA_SEED, *, noise: float = 0.1) -> DataLoader:
    """An unshuffled loader over :func:`make_dataset`."""
    return DataLoader(make_dataset(n_seq, seed, noise=noise), batch_size=batch_size, shuffle=False)


def global_batch_sampler(dataset: Dataset) -> DistributedSampler:
    """For one rank that must see, step by step, the global batches of a W-rank Trainer run.

    For training, Lightning injects ``DistributedSampler(shuffle=True)`` at W ranks whatever the loader's
    own sampler (a ``shuffle=False`` loader is shuffled too): every rank draws the same permutation for the epoch
    and rank r takes its indices r, r + W, r + 2W, ... At one rank no sampler is injected ([Note: one rank,
    auto's batches] in lightning_pstar/data_order.py), so a one-rank run with W times the batch puts this one in
    its loader: the same permutation unsplit, so its batch k holds exactly the samples of the W ranks' batches k.
    Lightning sets its epoch as it does for the injected one; the seed is Lightning's (``PL_GLOBAL_SEED`` or 0).
    """
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    return DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
