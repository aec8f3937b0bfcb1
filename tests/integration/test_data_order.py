"""Issue 30: at one rank the strategy sees the batches ``strategy="auto"`` sees.

Lightning and Fabric inject a ``DistributedSampler`` for every ``DDPStrategy`` subclass, even at world size 1,
where its own seeded shuffle reorders the data against ``auto``'s ``RandomSampler`` (and the Trainer's shuffles an
unshuffled loader too). The comparison a user makes first (the same seed, data and weights under ``auto`` and
``patrickstar``, 32-true) must give the same losses: the Trainer runs with Lightning's defaults
(``use_distributed_sampler`` left on) and a shuffled or an unshuffled loader. A
``DistributedSampler`` the user puts in the loader is kept. At two ranks the sampler is still injected
(``tests/distributed/test_data_order_distributed.py`` for the Trainer; here for Fabric's strategy property).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.environments import LightningEnvironment
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarStrategy
from tests.helpers.asserts import LOSS_RTOL
from tests.helpers.data import make_dataset
from tests.helpers.models import build_model, lm_loss
from tests.helpers.runs import LossRecorder, OptimSpec, TinyLM, quiet_trainer_options

STEPS = 6


class _SamplerSpy(L.Callback):
    def __init__(self) -> None:
        self.sampler: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sampler = trainer.train_dataloader.sampler  # type: ignore[union-attr]


def _fit(strategy: Any, loader: DataLoader) -> tuple[list[float], Any]:
    torch.manual_seed(0)  # the RandomSampler draws from the global generator, as under `auto`
    recorder, spy = LossRecorder(), _SamplerSpy()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision="32-true",
        max_steps=STEPS,
        callbacks=[recorder, spy],
        **quiet_trainer_options(),  # Lightning's default use_distributed_sampler=True stays
    )
    trainer.fit(TinyLM(optim=OptimSpec(name="sgd", lr=0.1, momentum=0.9)), train_dataloaders=loader)
    return recorder.losses, spy.sampler


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "unshuffled"])
def test_one_rank_trainer_sees_autos_batches(shuffle: bool) -> None:
    """Lightning's injected sampler would draw its own permutation for a shuffled loader, and shuffle an unshuffled
    one too (it always shuffles for training)."""
    data = make_dataset(48)
    kind = RandomSampler if shuffle else SequentialSampler
    reference, ref_sampler = _fit("auto", DataLoader(data, batch_size=4, shuffle=shuffle))
    losses, sampler = _fit(PatrickStarStrategy(), DataLoader(data, batch_size=4, shuffle=shuffle))
    assert isinstance(ref_sampler, kind)
    assert isinstance(sampler, kind), f"a {type(sampler).__name__} was injected at one rank"
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=LOSS_RTOL, atol=0.0)


def test_one_rank_trainer_keeps_the_users_distributed_sampler() -> None:
    data = make_dataset(16)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    _, seen = _fit(PatrickStarStrategy(), DataLoader(data, batch_size=4, sampler=sampler))
    assert isinstance(seen, DistributedSampler)
    assert seen.seed == 3


def _fabric_losses(strategy: Any) -> tuple[list[float], Any]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
    fabric.launch()
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    model, optimizer = fabric.setup(model, optimizer)
    torch.manual_seed(0)
    loader = fabric.setup_dataloaders(DataLoader(make_dataset(48), batch_size=4, shuffle=True))
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    if isinstance(fabric.strategy, PatrickStarFabricStrategy):
        fabric.strategy.teardown()
    return losses, loader.sampler


def test_one_rank_fabric_sees_autos_batches() -> None:
    reference, ref_sampler = _fabric_losses("auto")
    losses, sampler = _fabric_losses(PatrickStarFabricStrategy())
    assert isinstance(ref_sampler, RandomSampler)
    assert isinstance(sampler, RandomSampler), f"a {type(sampler).__name__} was injected at one rank"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=LOSS_RTOL, atol=0.0)


def test_fabric_strategy_asks_for_a_distributed_sampler_at_two_ranks() -> None:
    one = PatrickStarFabricStrategy(parallel_devices=[torch.device("cpu")])
    two = PatrickStarFabricStrategy(
        parallel_devices=[torch.device("cpu")] * 2, cluster_environment=LightningEnvironment()
    )
    assert one.distributed_sampler_kwargs is None
    two._set_world_ranks()
    assert two.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
