"""CUDA-only half of clean evictions ([Note: clean evictions] in runtime/chunk.py): a prefetch on the copy stream
keeps its pinned host source, a clean eviction frees only the device storage (after the fetch that read the host
bytes is done), and a dirty one copies back on the stream. Skipped (by tests/conftest.py) without CUDA."""

from __future__ import annotations

import pytest
import torch

from lightning_pstar.runtime.chunk import Chunk, ChunkKind, Slot, TransferStats
from lightning_pstar.runtime.state import Tier

pytestmark = pytest.mark.gpu

N = 1 << 20


def test_clean_and_dirty_evictions_on_the_copy_stream_keep_the_bytes_exact() -> None:
    stats = TransferStats()
    chunk = Chunk(
        chunk_id=0,
        kind=ChunkKind.PARAM,
        dtype=torch.float32,
        capacity=N,
        slots=[Slot(name="w", offset=0, numel=N, shape=torch.Size([N]))],
        device=torch.device("cuda", 0),
        stats=stats,
    )
    chunk.allocate(Tier.HOST, zero=False)
    values = torch.randn(N)
    chunk.data.copy_(values)
    stream = torch.cuda.Stream()
    for step in range(4):
        chunk.move_to(Tier.DEVICE, stream=stream, keep_host_copy=True)
        assert chunk.host_buffer is not None and chunk.host_buffer.is_pinned()
        if step % 2:
            chunk.data.mul_(2.0)  # a write: the next eviction copies
            values.mul_(2.0)
        chunk.move_to(Tier.HOST, stream=stream)
        chunk.data.add_(1.0)  # a host-side write (a host optimizer step) right after the eviction
        values.add_(1.0)
    assert torch.equal(chunk.data, values)
    assert stats.clean_moves == 2 and stats.dirty_moves == 2
    assert stats.d2h_bytes == 2 * chunk.nbytes and stats.host_copy_bytes == 0
