"""The memory report's text: the one byte formatter, bytes/param with and without padding, the rank summary,
and the reports after the run (``memory_report_all()`` after ``fit``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import MemoryReport, PatrickStarStrategy
from lightning_pstar.report import format_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (30_000, "29.3 KiB"),
        (300_000, "293 KiB"),
        (2**20, "1.00 MiB"),
        (30_923_776, "29.5 MiB"),
        (150_258_692, "143 MiB"),
        (20_220_792_012, "18.8 GiB"),
        (3 * 2**40, "3.00 TiB"),
        (-2048, "-2.00 KiB"),
        (None, "unlimited"),
    ],
)
def test_format_bytes(n: int | None, text: str) -> None:
    assert format_bytes(n) == text


def test_format_bytes_exact_leads_with_the_count() -> None:
    assert format_bytes(1_572_864, exact=True) == "1,572,864 bytes (1.50 MiB)"
    assert format_bytes(512, exact=True) == "512 bytes (512 B)"
    assert format_bytes(None, exact=True) == "unlimited"


def make_report(**overrides: Any) -> MemoryReport:
    fields: dict[str, Any] = dict(
        precision="bf16-mixed",
        num_params=1000,
        num_chunks=2,
        chunk_size=600,
        chunk_utilisation=1000 / 1200,
        model_data_bytes=16_800,  # 1200 slots x 14 bytes: padding included
        model_data_bytes_per_param=14.0,
        device_chunk_bytes=2048,
        host_chunk_bytes=14_752,
        peak_device_chunk_bytes=4096,
        h2d_bytes=300,
        d2h_bytes=0,
        evictions=0,
        device_memory_limit=8 * 2**30,
        host_memory_limit=None,
        optimizer_tier="host",
    )
    fields.update(overrides)
    return MemoryReport(**fields)


def test_report_says_bytes_per_param_with_and_without_padding() -> None:
    report = make_report()
    assert report.padded_bytes_per_param == pytest.approx(16.8)
    text = str(report)
    (line,) = [line for line in text.splitlines() if "model data / param" in line]
    assert "14.00 B excluding chunk padding" in line and "16.80 B with it" in line
    assert "16.4 KiB (16,800 B)" in text  # small counts in KiB, with the exact count beside them
    assert "300 B" in text and "0.0" not in text
    assert "8.00 GiB" in text and "unlimited" in text


def test_rank_summary_prints_small_counts_in_kib() -> None:
    reports = [make_report(rank=r, world_size=2, model_data_bytes=8400) for r in range(2)]
    summary = PatrickStarStrategy.format_rank_summary(reports)
    assert "0.0 MiB" not in summary
    assert "8.20 KiB" in summary and "total model data over 2 ranks: 16.4 KiB" in summary


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_tiny(strategy: PatrickStarStrategy, tmp_path: Path, *, steps: int) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=2))


def test_memory_report_all_after_fit(tmp_path: Path) -> None:
    strategy = PatrickStarStrategy()
    with pytest.raises(RuntimeError, match="not set up yet"):
        strategy.memory_report_all()
    _fit_tiny(strategy, tmp_path, steps=2)
    (report,) = strategy.memory_report_all()  # the reports gathered at teardown, no engine needed
    assert report == strategy.memory_report()
    assert report.num_params == 8 * 8 + 8 and report.rank == 0 and report.world_size == 1


def test_unknown_traffic_per_iteration_reads_unknown_not_unlimited() -> None:
    (line,) = [line for line in str(make_report()).splitlines() if "moved / iteration" in line]
    assert "unknown" in line and "unlimited" not in line
    (line,) = [line for line in str(make_report(moved_bytes_per_iteration=2048)).splitlines() if "moved /" in line]
    assert "2.00 KiB" in line


def test_chunk_line_counts_the_larger_chunks(tmp_path: Path) -> None:
    """Issue 30: a parameter larger than ``chunk_size`` gets a chunk of its own, and the line says so."""
    assert make_report().__str__().count("2 x 600 elements") == 1
    strategy = PatrickStarStrategy(chunk_size=16)
    _fit_tiny(strategy, tmp_path, steps=1)
    report = strategy.memory_report()  # Linear(8, 8): the 64-element weight > 16, the 8-element bias fits
    assert (report.num_chunks, report.chunk_size, report.larger_chunks) == (2, 16, 1)
    assert report.largest_chunk >= 64
    (line,) = [line for line in str(report).splitlines() if "chunks (families)" in line]
    assert line.endswith(f"2: 1 of 16 elements, 1 larger (up to {report.largest_chunk:,})")
