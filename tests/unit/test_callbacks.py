"""PatrickStarMonitor (pstar/* metrics through a real logger, the tide PNG) and plot_tide."""

from __future__ import annotations

import csv
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import MemoryReport, PatrickStarStrategy
from lightning_pstar.callbacks import PatrickStarMonitor, plot_tide

VOCAB, WIDTH, SEQ, BATCH, STEPS = 32, 16, 8, 4, 6
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class TinyTokenModel(L.LightningModule):
    """nn.Embedding and two Linear layers over random tokens: the smallest model with a few chunks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        logits = self.head(torch.relu(self.hidden(self.embed(x))))  # (B, T, V)
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


def random_tokens() -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


def fit(tmp_path: Path, strategy: Any, monitor: PatrickStarMonitor) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=STEPS,
        logger=CSVLogger(tmp_path, name="logs", version=0),
        log_every_n_steps=1,
        callbacks=[monitor],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(TinyTokenModel(), train_dataloaders=random_tokens())
    return trainer


def read_metrics(tmp_path: Path) -> list[dict[str, str]]:
    with open(tmp_path / "logs" / "version_0" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def pstar_strategy() -> PatrickStarStrategy:
    return PatrickStarStrategy(device_memory_limit=None, chunk_size=256)


def test_monitor_logs_pstar_metrics_through_the_csv_logger(tmp_path: Path) -> None:
    trainer = fit(tmp_path, pstar_strategy(), PatrickStarMonitor(log_every_n_steps=2))
    rows = [r for r in read_metrics(tmp_path) if r.get("pstar/device_chunk_bytes")]
    expected = {
        "pstar/device_chunk_bytes",
        "pstar/host_chunk_bytes",
        "pstar/h2d_bytes",
        "pstar/d2h_bytes",
        "pstar/evictions",
        "pstar/moves_off_device",
        "pstar/prefetches",
        "pstar/peak_non_model_bytes",
    }
    assert expected <= set(rows[0]), sorted(rows[0])
    assert len(rows) == STEPS // 2  # every second optimizer step
    report = trainer.strategy.memory_report()
    last = rows[-1]
    # no budget: every chunk stays on the (simulated) device and nothing moves
    assert float(last["pstar/device_chunk_bytes"]) == report.device_chunk_bytes > 0
    assert float(last["pstar/host_chunk_bytes"]) == 0
    assert all(float(r["pstar/h2d_bytes"]) == float(r["pstar/d2h_bytes"]) == 0 for r in rows)
    assert all(float(r["pstar/evictions"]) == float(r["pstar/moves_off_device"]) == 0 for r in rows)
    assert float(last["pstar/peak_non_model_bytes"]) == report.peak_non_model_bytes > 0


def test_monitor_logs_bytes_moved_since_the_previous_log(tmp_path: Path) -> None:
    """Under a tight budget chunks move every iteration; the per-window deltas add up to the totals. (One schedule of
    the host-side step: "auto" switches while it times both, and the first serial step after a pipelined one finds
    every param chunk's host copy current and moves nothing.)"""
    strategy = PatrickStarStrategy(
        device_memory_limit=12 * 1024, chunk_size=256, placement="static", optimizer_overlap="pipeline"
    )
    trainer = fit(tmp_path, strategy, PatrickStarMonitor(log_every_n_steps=1))
    rows = [r for r in read_metrics(tmp_path) if r.get("pstar/h2d_bytes")]
    assert len(rows) == STEPS
    report = trainer.strategy.memory_report()
    moved = [float(r["pstar/h2d_bytes"]) + float(r["pstar/d2h_bytes"]) for r in rows]
    assert min(moved[1:]) > 0, moved
    assert sum(moved) <= report.h2d_bytes + report.d2h_bytes  # setup-time copies precede the first window
    assert float(rows[-1]["pstar/host_chunk_bytes"]) > 0


def test_monitor_saves_the_tide_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plots" / "tide.png"
    monitor = PatrickStarMonitor(log_every_n_steps=50, save_tide_png=str(png))
    fit(tmp_path, pstar_strategy(), monitor)
    assert monitor.tide_saved
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_monitor_warns_once_and_does_nothing_with_another_strategy(tmp_path: Path) -> None:
    monitor = PatrickStarMonitor(log_every_n_steps=1, save_tide_png=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, "auto", monitor)
        fit(tmp_path / "again", "auto", monitor)  # a second run with the same monitor stays quiet
    ours = [w for w in caught if "PatrickStarMonitor does nothing" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "HINT:" in str(ours[0].message)
    rows = read_metrics(tmp_path)
    assert rows and "train_loss" in rows[0]  # the logger works ...
    assert not any(key.startswith("pstar/") for key in rows[0])  # ... and the monitor logged nothing


def test_monitor_warns_when_the_trainer_drops_its_steps(tmp_path: Path) -> None:
    monitor = PatrickStarMonitor(log_every_n_steps=3)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=pstar_strategy(),
        max_steps=1,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=2,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    with pytest.warns(UserWarning, match="divides 3"):
        trainer.fit(TinyTokenModel(), train_dataloaders=random_tokens())


def test_monitor_rejects_a_negative_interval() -> None:
    with pytest.raises(ValueError, match=r"`log_every_n_steps` must be an int >= 0, got -1.*HINT"):
        PatrickStarMonitor(log_every_n_steps=-1)


def make_report(**overrides: Any) -> MemoryReport:
    fields: dict[str, Any] = dict(
        precision="bf16-mixed",
        num_params=1000,
        num_chunks=4,
        chunk_size=256,
        chunk_utilisation=0.98,
        model_data_bytes=14 * 1024,
        model_data_bytes_per_param=14.0,
        device_chunk_bytes=2048,
        host_chunk_bytes=12 * 1024,
        peak_device_chunk_bytes=4096,
        h2d_bytes=0,
        d2h_bytes=0,
        evictions=0,
        device_memory_limit=8 * 1024,
        host_memory_limit=None,
        optimizer_tier="host",
        placement="auto",
        peak_non_model_bytes=5000,
        moment_non_model_bytes=[100 * i for i in range(30)] + [100 * i for i in range(30, 0, -1)] + [0],
        moment_device_chunk_bytes=[2048] * 61,
        moment_labels=[f"fwd:{i}" for i in range(30)] + [f"bwd:{i}" for i in range(29, -1, -1)] + ["step"],
    )
    fields.update(overrides)
    return MemoryReport(**fields)


def test_plot_tide_on_a_hand_made_report(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = plot_tide(make_report(), tmp_path / "sub" / "tide.png")
    assert path == tmp_path / "sub" / "tide.png"
    assert path.read_bytes().startswith(PNG_MAGIC)
    # without a budget there is no line to draw, and the plot still works
    assert plot_tide(make_report(device_memory_limit=None), tmp_path / "free.png").stat().st_size > 1000


def test_plot_tide_rejects_a_report_without_moments(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    empty = make_report(moment_non_model_bytes=[], moment_device_chunk_bytes=[], moment_labels=[])
    with pytest.raises(ValueError, match="no moments to plot.*HINT"):
        plot_tide(empty, tmp_path / "tide.png")
    with pytest.raises(ValueError, match="disagree in length"):
        plot_tide(make_report(moment_labels=["step"]), tmp_path / "tide.png")


def test_missing_matplotlib_raises_an_import_error_with_a_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError
    with pytest.raises(ImportError, match=r"HINT: `pip install matplotlib`.*plot"):
        plot_tide(make_report(), tmp_path / "tide.png")
    with pytest.raises(ImportError, match="pip install matplotlib"):
        PatrickStarMonitor(save_tide_png=tmp_path / "tide.png")
    assert PatrickStarMonitor(save_tide_png=None).save_tide_png is None  # no plot asked, no matplotlib needed


def _texts(figure: Any) -> list[str]:
    ax = figure.axes[0]
    return [t.get_text() for t in ax.texts] + [t.get_text() for t in ax.get_legend().get_texts()]


def test_tide_scales_to_the_data_and_draws_a_far_budget_as_a_note() -> None:
    pytest.importorskip("matplotlib")
    from lightning_pstar.callbacks import tide_figure

    # the callback docstring's own budget over a tide of a few KiB: the tide must fill the plot
    report = make_report(device_memory_limit=8 * 2**30)
    ax = tide_figure(report).axes[0]
    peak = max(a + b for a, b in zip(report.moment_non_model_bytes, report.moment_device_chunk_bytes, strict=True))
    assert ax.get_ylabel() == "KiB"
    bottom, top = ax.get_ylim()
    assert bottom == 0 and peak / 2**10 < top <= 1.5 * peak / 2**10
    assert not ax.lines, "a budget far above the tide is no line on its scale"
    (note,) = [t for t in _texts(ax.figure) if "device budget" in t]
    assert "8.00 GiB" in note and "above this plot" in note


def test_tide_draws_a_near_budget_as_a_horizontal_line() -> None:
    pytest.importorskip("matplotlib")
    from lightning_pstar.callbacks import tide_figure

    ax = tide_figure(make_report(device_memory_limit=8 * 1024)).axes[0]
    (line,) = ax.lines
    assert set(line.get_ydata()) == {8.0}  # KiB, on the tide's own axis
    assert ax.get_ylim()[1] > 8.0
    assert any("device budget (8.00 KiB)" in t for t in _texts(ax.figure))


def test_tide_labels_moments_with_the_given_module_names() -> None:
    pytest.importorskip("matplotlib")
    from lightning_pstar.callbacks import tide_figure

    modules = ["embed", "hidden", "head"]
    labels = [f"fwd:{m}" for m in modules] + [f"bwd:{m}" for m in reversed(modules)] + ["step"]
    report = make_report(
        moment_non_model_bytes=[100, 200, 300, 300, 200, 100, 0],
        moment_device_chunk_bytes=[2048] * 7,
        moment_labels=labels,
    )
    ax = tide_figure(report).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == labels
