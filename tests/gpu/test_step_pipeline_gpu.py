"""The pipelined host step on CUDA ([Note: the step pipeline] in runtime/pipeline.py): copies on the pipeline's
side streams, steps inside the backward and their copies back inside it too ([Note: copies back inside the
backward] in optim/overlap.py), where the H2D copy on its stream runs while the compute stream goes on with the
backward. Losses, weights and optimizer states equal the serial step's, bitwise. Skipped without CUDA."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest

from lightning_pstar import PatrickStarStrategy
from tests.helpers import assert_states_equal
from tests.helpers.models import TinyGPT
from tests.helpers.runs import LM, fit_steps

pytestmark = pytest.mark.gpu
ACCELERATOR = os.environ.get("PSTAR_TEST_ACCELERATOR", "cuda")  # "cpu": the same test on this machine's CPU


class Peek(L.Callback):
    """The memory report at the end of training (while the engine still runs)."""

    report = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.report = trainer.strategy.memory_report()  # type: ignore[attr-defined]


def _serial_and_pipelined(precision: str, what: str, **kwargs: Any) -> tuple[Any, Any]:
    """The same run with ``optimizer_overlap`` "off" and "pipeline": bitwise the same losses and weights; both
    memory reports."""
    runs, reports = [], []
    for overlap in ("off", "pipeline"):
        strategy = PatrickStarStrategy(optimizer_placement="host", optimizer_overlap=overlap, chunk_size=4096)
        peek = Peek()
        options = {"precision": precision, "steps": 5, "callbacks": [peek], "accelerator": ACCELERATOR}
        runs.append(fit_steps(LM(lambda: TinyGPT()), strategy, **options, **kwargs))
        reports.append(peek.report)
    serial, pipelined = runs
    assert pipelined.losses == serial.losses
    assert_states_equal(pipelined.final, serial.final, what=f"{what} against 'off'")
    return reports[0], reports[1]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_copies_back_inside_the_backward_on_cuda_are_the_serial_step(precision: str) -> None:
    _, report = _serial_and_pipelined(precision, "copies back inside the backward")
    assert report.host_steps_in_backward > 0 and report.host_copies_back_in_backward > 0, report


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_accumulation_sums_aside_and_pipelined_steps_on_cuda_are_the_serial_step(precision: str) -> None:
    """Gradient accumulation with the optimizer on the host: the accumulating micro-batches' gradients go to pinned
    memory on a side stream and are summed on a host lane ([Note: sums beside the backward] in
    runtime/grad_sums.py), and the last micro-batch's jobs add the slot's gradient to those sums ([Note: gradient
    parts] in optim/host_step.py):
    the serial step's bits (what the first GPU run's offloaded row, accumulation 4, ran serially)."""
    serial, report = _serial_and_pipelined(precision, "accumulation", accumulate_grad_batches=3)
    assert report.host_sums_in_backward > 0 and report.host_step_jobs > 0, report
    assert serial.host_sums_in_backward == 0 and serial.host_step_jobs == 0
