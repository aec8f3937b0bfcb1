"""CUDA-only halves of the issue-12 rules: host chunks allocate nothing on the device, copies on the side
stream keep the bytes exact, and the module reports the GPU. Skipped (by tests/conftest.py) without CUDA."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.runtime.chunk import Chunk, ChunkKind, TransferStats
from lightning_pstar.runtime.state import Tier
from tests.helpers.runs import TinyLM, make_loader, quiet_trainer_options

pytestmark = pytest.mark.gpu


def _chunk(capacity: int) -> Chunk:
    return Chunk(
        chunk_id=0,
        kind=ChunkKind.MASTER,
        dtype=torch.float32,
        capacity=capacity,
        slots=[],
        device=torch.device("cuda", 0),
        stats=TransferStats(),
    )


def test_host_chunk_allocates_nothing_on_the_device() -> None:
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    chunk = _chunk(1 << 24)  # 64 MiB
    chunk.allocate(Tier.HOST)
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved
    assert chunk.host_buffer is not None and chunk.host_buffer.is_pinned()


def test_side_stream_round_trips_are_exact() -> None:
    chunk = _chunk(1 << 20)
    chunk.allocate(Tier.HOST, zero=False)
    values = torch.randn(1 << 20)
    chunk.data.copy_(values)
    stream = torch.cuda.Stream()
    for _ in range(3):
        chunk.move_to(Tier.DEVICE, stream=stream)
        chunk.data.mul_(2.0)  # compute-stream work on the fetched bytes
        chunk.move_to(Tier.HOST, stream=stream)  # eviction on the copy stream
        values.mul_(2.0)
    assert torch.equal(chunk.data, values)


def test_module_device_is_cuda_during_training() -> None:
    seen: list[torch.device] = []

    class _Probe(TinyLM):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            seen.append(torch.arange(2, device=self.device).device)
            return super().training_step(batch, batch_idx)

    trainer = L.Trainer(
        accelerator="cuda", devices=1, strategy=PatrickStarStrategy(), max_steps=1, **quiet_trainer_options()
    )
    trainer.fit(_Probe(), train_dataloaders=make_loader())
    assert seen and seen[0].type == "cuda"
