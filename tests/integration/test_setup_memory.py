"""Setup memory (issue 12): materialising a meta-device model never holds the full fp32 model on the device,
and the LightningModule reports the root device afterwards."""

from __future__ import annotations

import lightning as L
import torch

from lightning_pstar import PatrickStarStrategy
from tests.helpers.runs import TinyLM, fit

CHUNK = 4096


class _SetupProbe(L.Callback):
    """Reads what setup left behind, while the chunks still exist."""

    def __init__(self) -> None:
        self.peak = -1
        self.budget = -1
        self.device: torch.device | None = None
        self.arange_device: torch.device | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, PatrickStarStrategy)
        residency = strategy.chunk_manager.residency
        self.peak = residency.setup_peak_device_bytes
        self.budget = residency.device_budget if residency.device_budget is not None else -1
        self.device = pl_module.device
        self.arange_device = torch.arange(3, device=pl_module.device).device


def _model_fp32_bytes(module: TinyLM) -> int:
    assert module.model is not None
    return sum(p.numel() * 4 for p in module.model.parameters())


def test_meta_model_larger_than_budget_materialises_within_budget() -> None:
    budget = 3 * CHUNK * 4  # three fp32 chunks; the model needs several times that
    probe = _SetupProbe()
    strategy = PatrickStarStrategy(chunk_size=CHUNK, placement="static", device_memory_limit=budget)
    result = fit(TinyLM(meta_init=True), strategy=strategy, max_steps=1, callbacks=[probe])
    model_bytes = _model_fp32_bytes(result.module)
    print(f"meta TinyLM: fp32 model {model_bytes:,} B, device budget {budget:,} B, setup peak {probe.peak:,} B")
    assert model_bytes > 2 * budget, "the test needs a model larger than the device budget"
    # chunks on the device plus one module's fp32 temporaries, never the whole fp32 model
    assert 0 < probe.peak <= budget, (probe.peak, budget, model_bytes)


def test_eager_model_setup_peak_is_the_chunks_only() -> None:
    budget = 3 * CHUNK * 4
    probe = _SetupProbe()
    strategy = PatrickStarStrategy(chunk_size=CHUNK, placement="static", device_memory_limit=budget)
    fit(TinyLM(), strategy=strategy, max_steps=1, callbacks=[probe])
    assert 0 < probe.peak <= budget


def test_module_reports_the_root_device_after_setup() -> None:
    probe = _SetupProbe()
    strategy = PatrickStarStrategy()
    fit(TinyLM(), strategy=strategy, max_steps=1, callbacks=[probe])
    assert probe.device == strategy.root_device
    assert probe.arange_device == strategy.root_device
