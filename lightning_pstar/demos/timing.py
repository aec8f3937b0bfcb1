"""A step timer shared by the benchmarks (so no benchmark script defines its own copy)."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from typing_extensions import override

__all__ = ["StepTimer"]


class StepTimer(L.Callback):
    """Wall time and loss of every training batch (synchronised on CUDA), and the strategy's memory report at
    the end of training, read before teardown frees the chunks (``None`` for other strategies)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []
        self.report: dict[str, Any] | None = None
        self._start = 0.0

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)
        if isinstance(outputs, dict) and "loss" in outputs:
            self.losses.append(float(outputs["loss"]))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        report = getattr(trainer.strategy, "memory_report", None)
        self.report = report().as_dict() if callable(report) else None
