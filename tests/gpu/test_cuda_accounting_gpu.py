"""Issue 12, item 8 on a CUDA device: a user's own peak reading survives the warm-up's resets, a CUDA
out-of-memory inside a step is a MemoryBudgetError naming the moment, and the step's measured non-model memory
holds no chunk bytes."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.planning.requirements import MemoryBudgetError

pytestmark = pytest.mark.gpu


class _Net(L.LightningModule):
    def __init__(self, explode_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
        self.explode_at = explode_at

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == self.explode_at:
            free, _ = torch.cuda.mem_get_info()
            torch.empty(2 * free, dtype=torch.uint8, device=self.device)  # the allocator's own OOM
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(module: L.LightningModule, budget: int | str | None = None) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=PatrickStarStrategy(chunk_size=256 * 257, device_memory_limit=budget),
        precision="bf16-mixed",
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(32, 256)), batch_size=8))
    return trainer


def test_a_users_peak_reading_survives_the_warm_up() -> None:
    torch.cuda.reset_peak_memory_stats()
    big = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    del big
    before = torch.cuda.max_memory_allocated()
    _fit(_Net())
    assert torch.cuda.max_memory_allocated() >= before


def test_a_cuda_out_of_memory_in_a_step_names_the_moment_and_the_budget() -> None:
    with pytest.raises(MemoryBudgetError, match=r"CUDA ran out of memory during .*device_memory_limit") as info:
        _fit(_Net(explode_at=2), budget="2GiB")
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert "HINT" in str(info.value)


def test_the_steps_non_model_memory_holds_no_chunk_bytes() -> None:
    """Offloaded, the step moves families to the host after the peak counter's reset: its measured non-model
    memory, above what stays allocated between runs (cuBLAS/cuBLASLt workspaces: issue 29), must stay far below
    the chunks that left."""
    free = _fit(_Net()).strategy.memory_report()  # type: ignore[attr-defined]
    budget = free.peak_non_model_bytes + free.model_data_bytes // 3
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()  # the workspaces the first run created stay allocated
    report = _fit(_Net(), budget=budget).strategy.memory_report()  # type: ignore[attr-defined]
    step = [n for n, label in zip(report.moment_non_model_bytes, report.moment_labels, strict=True) if label == "step"]
    assert step and report.h2d_bytes > 0
    left = report.model_data_bytes - report.device_chunk_bytes
    assert step[0] - baseline < left // 2, (step, baseline, left, report)
