"""Issue 30: at two ranks the Trainer strategy still gets Lightning's ``DistributedSampler``, as ``ddp`` does
(at one rank none is injected: ``tests/integration/test_data_order.py``)."""

from __future__ import annotations

from datetime import timedelta

import lightning as L
import pytest
from launch import run_ranks
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pstar import PatrickStarStrategy
from tests.helpers.data import make_dataset
from tests.helpers.runs import OptimSpec, TinyLM, quiet_trainer_options

pytestmark = pytest.mark.slow  # two spawned ranks: tens of seconds on a busy machine

WORLD = 2


class _SamplerSpy(L.Callback):
    def __init__(self) -> None:
        self.sampler: object = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sampler = trainer.train_dataloader.sampler  # type: ignore[union-attr]


def sampler_in_rank(rank: int, world_size: int) -> tuple[str, int, int]:
    spy = _SamplerSpy()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=PatrickStarStrategy(timeout=timedelta(seconds=60)),
        precision="32-true",
        max_steps=1,
        callbacks=[spy],
        limit_val_batches=0,
        **quiet_trainer_options(),
    )
    loader = DataLoader(make_dataset(16), batch_size=4, shuffle=True)
    trainer.fit(TinyLM(optim=OptimSpec(name="sgd", lr=0.1)), train_dataloaders=loader)
    sampler = spy.sampler
    assert isinstance(sampler, DistributedSampler), type(sampler).__name__
    return type(sampler).__name__, sampler.num_replicas, sampler.rank


def test_two_ranks_still_get_a_distributed_sampler() -> None:
    results = run_ranks(sampler_in_rank, WORLD, timeout=240.0)
    assert [(r[1], r[2]) for r in results] == [(2, 0), (2, 1)]
