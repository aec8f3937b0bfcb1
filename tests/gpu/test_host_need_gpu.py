"""Issue 31 on a CUDA device: the setup's host figure counts each pinned host chunk as the block torch's caching
host allocator backs it with (an explicit chunk size that is not a power of two), so a host budget of exactly
that figure trains and one byte less is refused at setup. Runs in a fresh process so that no other test's
pinned blocks sit in the allocator's cache (the host budget counts idle cached blocks as held)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

_SCRIPT = textwrap.dedent(
    """
    import re
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pstar import PatrickStarStrategy
    from lightning_pstar.planning.requirements import MemoryBudgetError

    class M(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[nn.Linear(96, 96) for _ in range(6)])

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    def run(host: int, precision: str) -> None:
        strategy = PatrickStarStrategy(
            # 40,000 B fp32 chunks; the device budget leaves room for CUDA's own non-model memory (an H200 measured
            # 65.1 MiB at the backward, mostly a cuBLAS workspace: 64 MiB was refused there on 2026-12-04)
            chunk_size=10_000, device_memory_limit="256MiB", host_memory_limit=host
        )
        trainer = L.Trainer(
            accelerator="cuda", devices=1, strategy=strategy, precision=precision, max_steps=2,
            accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )
        data = DataLoader(TensorDataset(torch.randn(32, 96)), batch_size=8)
        trainer.fit(M(), data)
        assert trainer.global_step == 2

    for precision in ("32-true", "bf16-mixed"):
        try:
            run(1, precision)
            raise AssertionError("a 1-byte host budget trained")
        except MemoryBudgetError as err:
            message = str(err)
        assert "pinned-block rounding" in message, message
        need = int(re.search(r"leaves ([\\d,]+) bytes", message).group(1).replace(",", ""))
        try:
            run(need - 1, precision)
            raise AssertionError("one byte below the need trained")
        except MemoryBudgetError as err:
            assert f"host_memory_limit is {need - 1:,} bytes" in str(err), str(err)
        run(need, precision)
        print("ok", precision, need)
    """
)


def test_a_pinned_host_budget_is_refused_at_setup_or_trains() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok ") == 2, done.stdout
