"""Issue 29 on a CUDA device: a host tensor's collective runs on the run's device (one group per run), the
reduction reads its tails on the host without a host sync, and the peak counter is restored without new
device memory. Skipped (by tests/conftest.py) without CUDA; the CPU halves are in tests/unit."""

from __future__ import annotations

import pytest
import torch

from lightning_pstar.runtime.comm import ChunkComm
from lightning_pstar.runtime.reduction import _HostCopy
from lightning_pstar.runtime.tracer import CudaAllocatorStats

pytestmark = pytest.mark.gpu


def test_a_host_tensor_is_staged_on_the_runs_device() -> None:
    cuda = torch.device("cuda", torch.cuda.current_device())
    comm = ChunkComm(rank=0, world_size=1, device=cuda)
    comm._staging[:] = [cuda]  # what an NCCL run finds
    seen: list[torch.device] = []
    value = torch.ones(3)
    comm._in_place(value, lambda t: seen.append(t.device) or t.mul_(2))
    assert seen == [cuda] and value.device.type == "cpu" and value.tolist() == [2.0, 2.0, 2.0]


def test_the_tails_come_to_the_host_without_a_sync() -> None:
    source = torch.arange(8, dtype=torch.float32, device="cuda")
    torch.cuda._sleep(10_000_000)  # queued work the copy must not make the host wait for
    torch.cuda.set_sync_debug_mode("error")
    try:
        copy = _HostCopy(source)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert copy.host.is_pinned()
    assert copy.values() == [float(i) for i in range(8)] and copy.ready()


def test_the_peak_counter_is_restored_from_free_blocks_only() -> None:
    cuda = torch.device("cuda", torch.cuda.current_device())
    big = torch.empty(256 << 20, dtype=torch.uint8, device=cuda)
    target = torch.cuda.max_memory_allocated(cuda)
    del big
    torch.cuda.reset_peak_memory_stats(cuda)
    reserved = torch.cuda.memory_reserved(cuda)
    CudaAllocatorStats(cuda).restore_peak(target)
    assert torch.cuda.memory_reserved(cuda) == reserved  # no new segment for a counter
    assert torch.cuda.max_memory_allocated(cuda) >= target - (1 << 20)
