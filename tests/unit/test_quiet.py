"""Issue 30: quiet by default.

A one-process sharded save and load raise none of torch's "torch.distributed is disabled" warnings (a
single process is what this package intends there), and a budgeted run logs one readable INFO line of its own:
the diagnostics (the placement yardstick, which optimizer families run on the device, host malloc) are DEBUG.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.checkpoint.sharded import read_sharded_tensors, stored_keys, write_sharded
from tests.helpers.killpoints import meta_of
from tests.helpers.runs import OptimSpec, TinyLM, fit_steps

SPEC = OptimSpec(name="adamw", lr=3e-3)


def test_one_process_sharded_save_and_load_warn_nothing(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    tensors = {"model/w": torch.arange(6.0)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        write_sharded(path, meta=meta_of(1), tensors=tensors, rank=0, barrier=lambda: None)
        loaded = read_sharded_tensors(path, stored_keys(path))
    assert [str(w.message) for w in caught] == []
    torch.testing.assert_close(loaded["model/w"], tensors["model/w"])


def test_a_budgeted_run_logs_one_short_info_line(caplog: pytest.LogCaptureFixture) -> None:
    free = fit_steps(TinyLM(optim=SPEC), PatrickStarStrategy(chunk_size=2048), steps=2).trainer.strategy
    report = free.memory_report()
    budget = report.peak_non_model_bytes + report.model_data_bytes  # a budget: the yardstick is computed
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="lightning_pstar"):
        fit_steps(TinyLM(optim=SPEC), PatrickStarStrategy(chunk_size=2048, device_memory_limit=budget), steps=3)
    ours = [
        r.getMessage() for r in caplog.records if r.name.startswith("lightning_pstar") and r.levelno >= logging.INFO
    ]
    assert len(ours) == 1, [m[:200] for m in ours]
    assert ours[0].startswith("PatrickStar: ") and len(ours[0]) < 200
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("fewest bytes any placement moves" in m and len(m) < 200 for m in debug), debug
