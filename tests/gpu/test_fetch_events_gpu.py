"""CUDA half of [Note: fetch and prefetch] (runtime/lookahead.py) and issue 29 item 5: demand fetches copy on the
copy stream and the CPU does not wait for them, parameters point at a device buffer only once the compute stream
waits on its copy, evictions in flight hold their blocks against the budget, and prefetch by bytes keeps the
arithmetic. Skipped (by tests/conftest.py) without CUDA; the CPU halves are tests/unit/test_fetch_events.py,
tests/unit/test_lookahead.py and tests/integration/test_lookahead_prefetch.py."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.config import PStarConfig
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.state import Tier

pytestmark = pytest.mark.gpu

WIDTH = 512


def _manager() -> ChunkManager:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    config = PStarConfig.from_flat(chunk_size=WIDTH * WIDTH + WIDTH, placement="static")
    cuda = torch.device("cuda", torch.cuda.current_device())
    manager = ChunkManager(model, config=config, compute_dtype=torch.float32, device=cuda)
    manager.materialise()
    return manager


def _storage(t: torch.Tensor | None) -> int:
    assert t is not None
    return t.untyped_storage().data_ptr()


def test_a_demand_fetch_does_not_block_the_cpu_and_reads_the_fetched_bytes() -> None:
    manager = _manager()
    residency, family = manager.residency, manager.families[0]
    want = [r.param.detach().clone() for r in family.records]
    residency.move_param_chunk(family, Tier.HOST)
    family.param_chunk.wait()  # the eviction's copy is done (the CPU reads host bytes next)
    torch.cuda._sleep(50_000_000)  # queued compute the fetch's copy must be ordered after, without a CPU wait
    torch.cuda.set_sync_debug_mode("error")  # a blocking copy or a synchronize() raises
    try:
        residency.fetch(family, protect=set())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert residency.stats.demand_fetches == 1 and family.param_chunk.ready
    for record, value in zip(family.records, want, strict=True):
        assert record.param.is_cuda and torch.equal(record.param, value)


def test_a_prefetched_chunk_is_read_from_the_device_only_after_the_wait() -> None:
    manager = _manager()
    residency, family = manager.residency, manager.families[1]
    want = [r.param.detach().clone() for r in family.records]
    residency.move_param_chunk(family, Tier.HOST)
    torch.cuda._sleep(50_000_000)
    residency.move_param_chunk(family, Tier.DEVICE, asynchronous=True)
    chunk = family.param_chunk
    assert chunk.pending
    for record in family.records:  # still the host bytes: nothing can read the device block being written
        assert not record.param.is_cuda and _storage(record.param) == _storage(chunk.host_buffer)
    residency.fetch(family, protect=set())
    for record, value in zip(family.records, want, strict=True):
        assert record.param.is_cuda and _storage(record.param) == _storage(chunk.device_buffer)
        assert torch.equal(record.param, value)  # read on the compute stream, after its wait on the copy


def test_an_eviction_holds_its_block_until_its_copy_ends() -> None:
    manager = _manager()
    residency, family = manager.residency, manager.families[0]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the eviction's copy waits for this compute
    residency.move_param_chunk(family, Tier.HOST)
    assert residency.evicting.held() == family.param_chunk.nbytes
    torch.cuda.synchronize()
    assert residency.evicting.held() == 0


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 128)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)) for _ in range(8)
        )
        self.head = nn.Linear(128, 64)
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        loss = nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


class _Mode(L.Callback):
    def __init__(self, mode: str) -> None:
        self.mode = mode

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy.chunk_manager.residency.prefetcher.mode = self.mode  # type: ignore[attr-defined]


def _fit(budget: Any, mode: str) -> tuple[list[float], Any]:
    module = _Module()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (64, 32), generator=g)
    strategy = PatrickStarStrategy(chunk_size=65536 + 512, device_memory_limit=budget, optimizer_placement="host")
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=strategy,
        precision="32-true",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[_Mode(mode)],
    )
    trainer.fit(module, DataLoader(TensorDataset(x, x), batch_size=8))
    return module.losses, strategy.memory_report()


def test_prefetch_by_bytes_keeps_the_arithmetic_and_the_budget_on_cuda() -> None:
    _, free = _fit("4GiB", "off")
    budget = free.peak_non_model_bytes + free.model_data_bytes // 8  # about half the param chunks fit
    off, off_report = _fit(budget, "off")
    ahead, report = _fit(budget, "lookahead")
    assert ahead == off
    assert report.peak_device_chunk_bytes <= budget
    assert report.h2d_bytes == off_report.h2d_bytes and report.prefetches > 0
    assert report.demand_fetches < off_report.demand_fetches
