"""Clean evictions ([Note: clean evictions] in runtime/chunk.py): a chunk whose host copy is current leaves the
device without a copy, and the arithmetic does not change at all.

Eviction-heavy runs (a ``static`` budget of a few param chunks, ignoring activations as test_memory_limit.py
does) are compared bit for bit with unconstrained runs: losses and final weights. The traps are the writers a
stale host copy would hide: gradients stored in the param slots (mixed precision), the optimizer step (fused
kernels do not bump version counters), and a module that renormalises its own weight during forward.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import MemoryReport, PatrickStarStrategy
from tests.helpers import OptimSpec, TinyLM, fit, make_trainer
from tests.helpers.runs import tight

STEPS = 4
CHUNK = 1024
SPEC = OptimSpec(name="adamw", lr=3e-3, weight_decay=0.1)
ITEMSIZE = {"32-true": 4, "bf16-mixed": 2}
PRECISIONS = ["32-true", "bf16-mixed"]


class NoCleanEvictions(L.Callback):
    """Turns clean evictions off before training (every eviction copies, as before they existed)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy.chunk_manager.residency.clean_evictions = False


def _fit_tiny(precision: str, strategy: PatrickStarStrategy, *, clean: bool = True) -> tuple[Any, MemoryReport]:
    callbacks = [] if clean else [NoCleanEvictions()]
    result = fit(TinyLM(optim=SPEC), strategy=strategy, precision=precision, max_steps=STEPS, callbacks=callbacks)
    return result, strategy.memory_report()


def _same(got: Any, ref: Any, what: str) -> None:
    assert got.recorder.losses == ref.recorder.losses, what
    ref_state, got_state = ref.recorder.final_state, got.recorder.final_state
    assert sorted(ref_state) == sorted(got_state), what
    for name, value in ref_state.items():
        assert torch.equal(got_state[name], value), f"{what}: {name}"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_clean_evictions_copy_less_and_change_nothing(precision: str) -> None:
    free, _ = _fit_tiny(precision, PatrickStarStrategy(chunk_size=CHUNK, placement="static"))
    clean, report = _fit_tiny(precision, tight(CHUNK, 5, ITEMSIZE[precision]))
    dirty, dirty_report = _fit_tiny(precision, tight(CHUNK, 5, ITEMSIZE[precision]), clean=False)
    print(f"{precision}: clean evictions on {report}\noff {dirty_report}")
    _same(clean, free, f"{precision}, clean evictions on")
    _same(dirty, free, f"{precision}, clean evictions off")
    assert report.evictions > 0 and report.clean_moves > 0 and report.clean_bytes > 0
    assert dirty_report.clean_moves == 0 and dirty_report.host_copy_bytes == 0
    # same schedule, fewer copies: every clean move is a copy the other run made
    assert report.moves_off_device == report.clean_moves + report.dirty_moves
    assert report.d2h_bytes == dirty_report.d2h_bytes - report.clean_bytes
    assert report.h2d_bytes == dirty_report.h2d_bytes
    assert report.host_copy_bytes <= report.host_memory_limit if report.host_memory_limit else True


class RenormLM(L.LightningModule):
    """An embedding that renormalises the rows it looks up during forward, in place (``max_norm``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 16, max_norm=0.5)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = torch.relu(self.mid(self.emb(x)))
        return nn.functional.cross_entropy(self.head(h).float().flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9, fused=True)


class TwoStepLM(RenormLM):
    """Manual optimisation: two optimizer steps per batch, so chunks are fetched again after each step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.emb.max_norm = None
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        assert isinstance(opt, L.pytorch.core.optimizer.LightningOptimizer)
        x, y = batch
        for half in (slice(0, 2), slice(2, 4)):
            h = torch.relu(self.mid(self.emb(x[half])))
            loss = nn.functional.cross_entropy(self.head(h).float().flatten(0, 1), y[half].flatten())
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            self.losses.append(float(loss.detach()))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (STEPS * 4, 8), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, 1, dims=1)), batch_size=4)


def _fit_module(
    module: L.LightningModule, strategy: PatrickStarStrategy, precision: str
) -> tuple[dict[str, torch.Tensor], MemoryReport]:
    trainer = make_trainer(strategy=strategy, precision=precision, max_steps=2 * STEPS)
    trainer.fit(module, _loader())
    state = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    return state, strategy.memory_report()


# one param chunk of 1024 elements holds the embedding, the next ones the linear layers
SMALL_CHUNK = 1024


def _one_module_budget(precision: str) -> int:
    return 2 * SMALL_CHUNK * ITEMSIZE[precision]  # two param chunks: every module's fetch evicts another's


@pytest.mark.parametrize("precision", PRECISIONS)
def test_weights_written_in_forward_are_copied_back(precision: str) -> None:
    free, _ = _fit_module(RenormLM(), PatrickStarStrategy(chunk_size=SMALL_CHUNK, placement="static"), precision)
    strategy = PatrickStarStrategy(
        chunk_size=SMALL_CHUNK, placement="static", device_memory_limit=_one_module_budget(precision)
    )
    got, report = _fit_module(RenormLM(), strategy, precision)
    print(f"{precision}: {report}")
    assert report.evictions > 0 and report.dirty_moves > 0
    assert sorted(got) == sorted(free)
    for name, value in free.items():
        assert torch.equal(got[name], value), name
    # the renorm really wrote the weights (so a lost write would show)
    assert not torch.equal(free["emb.weight"], RenormLM().emb.weight.detach().float())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_optimizer_steps_between_fetches(precision: str) -> None:
    free_module, module = TwoStepLM(), TwoStepLM()
    free, _ = _fit_module(free_module, PatrickStarStrategy(chunk_size=SMALL_CHUNK, placement="static"), precision)
    strategy = PatrickStarStrategy(
        chunk_size=SMALL_CHUNK, placement="static", device_memory_limit=_one_module_budget(precision)
    )
    got, report = _fit_module(module, strategy, precision)
    print(f"{precision}: {report}")
    assert report.evictions > 0 and report.clean_moves > 0
    assert module.losses == free_module.losses and len(module.losses) == 2 * STEPS  # max_steps counts each step
    for name, value in free.items():
        assert torch.equal(got[name], value), name
