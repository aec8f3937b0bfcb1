"""Issue 12, item 8 on a CUDA device: a user's own peak reading survives the warm-up's resets, a CUDA
out-of-memory inside a step is a MemoryBudgetError naming the moment, and the step's measured non-model memory
holds no chunk bytes."""

from __future__ import annotations

from typing import Any

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


@pytest.mark.xfail(
    strict=True,
    reason="observed on an H200 (torch 2.11, 2026-12-04): max_memory_allocated() after the fit was 73,962,496 bytes"
    " against the user's 536,870,912 before it; the tracer restores the counter only from blocks the caching"
    " allocator holds free ([Note: peak counter] in runtime/tracer.py), and none that size was held then",
)
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
    report = _fit(_Net(), budget=budget).strategy.memory_report()  # type: ignore[attr-defined]

    def step_moment(r: Any) -> int:
        return next(n for n, label in zip(r.moment_non_model_bytes, r.moment_labels, strict=True) if label == "step")

    # against the run that offloads nothing: both hold the same workspaces at the step (on an H200 a cuBLAS
    # workspace of 64 MiB, recreated by each run: what stays allocated between runs did not include it)
    assert report.h2d_bytes > 0
    left = report.model_data_bytes - report.device_chunk_bytes
    assert step_moment(report) - step_moment(free) < left // 2, (step_moment(report), step_moment(free), left)
