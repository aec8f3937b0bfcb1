"""The disk tier on a CUDA device ([Note: disk families] in runtime/disk_tier.py): the param chunks live on the GPU
(pinned host copies for the host step), the fp32 masters and Adam states of the families the host budget cannot
hold on disk (the store's staging arena registered with cudaHostRegister). Serial and pipelined steps give the
losses, weights and optimizer states of the run without a disk tier, bitwise. Skipped without CUDA."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_pstar import PatrickStarStrategy
from tests.helpers import TinyLM
from tests.helpers.data import make_loader
from tests.helpers.runs import LossRecorder, quiet_trainer_options

pytestmark = pytest.mark.gpu


def _run(disk: Path | None, host: str, overlap: str) -> tuple[list[float], dict[str, torch.Tensor], Any, Any]:
    extra = {"disk_path": str(disk)} if disk is not None else {}
    strategy = PatrickStarStrategy(
        optimizer_placement="host", optimizer_overlap=overlap, chunk_size=4096, device_memory_limit="256MiB",
        host_memory_limit=host, **extra,
    )  # fmt: skip
    recorder = LossRecorder()
    options = {**quiet_trainer_options(), "use_distributed_sampler": False}
    trainer = L.Trainer(
        accelerator="cuda", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=3, callbacks=[recorder],
        **options,
    )  # fmt: skip
    trainer.fit(TinyLM(), train_dataloaders=make_loader(n_seq=12))
    state = trainer.optimizers[0].state_dict()["state"]
    return recorder.losses, recorder.final_state, state, strategy.memory_report()


@pytest.mark.parametrize("overlap", ["off", "auto"])
def test_disk_tier_on_cuda_is_bitwise_the_run_without_it(tmp_path: Path, overlap: str) -> None:
    losses, final, state, report = _run(tmp_path, "640KiB", overlap)
    want_losses, want_final, want_state, _ = _run(None, "64MiB", overlap)
    assert report.disk_families > 0, report
    assert losses == want_losses
    for name, value in want_final.items():
        assert torch.equal(final[name], value), name
    for index, entry in want_state.items():
        for key, value in entry.items():
            assert torch.equal(state[index][key].cpu(), value.cpu()), (index, key)
    assert os.listdir(tmp_path) == []
