"""ChunkComm's bucket collectives between real processes: the reduction of a flat buffer (an exchange of parts
over gloo, [Note: gloo's reduce-scatter] in ``lightning_pstar/runtime/comm.py``; ``reduce_scatter_single`` over
NCCL) gives each rank the sum over ranks of its part, and an all-gather of packed buffers fills every rank's
part ([Note: buckets of chunk groups] in ``lightning_pstar/runtime/sharding.py``). The reference is plain
arithmetic on the inputs every rank can rebuild."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_pstar.runtime.comm import ChunkComm
from tests.distributed.launch import run_ranks

PART = 1000  # elements of one rank's part


def _inputs(rank: int, world: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(world * PART, generator=g).to(device)


def _collectives(rank: int, world: int, backend: str, on_cuda: bool) -> dict[str, Any]:
    # NCCL: a device per rank; CUDA tensors over gloo: the ranks may share one device
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        comm = ChunkComm(rank=rank, world_size=world, group=dist.group.WORLD)
        flat = _inputs(rank, world, device)
        work, mine = comm.start_reduce_scatter(flat)
        work.wait()
        work.wait()  # a second wait adds nothing
        expected = sum(_inputs(r, world, device) for r in range(world)).view(world, PART)[rank]
        send = torch.full((PART,), float(rank + 1), dtype=torch.bfloat16, device=device)
        buffers = [send if r == rank else torch.empty_like(send) for r in range(world)]
        comm.all_gather_chunks(buffers, rank).wait()
        return {
            # two ranks: a + b in either order, bitwise; more: another order of the additions
            "reduced_equal": bool(torch.equal(mine.cpu(), expected.cpu())),
            "reduced_close": bool(torch.allclose(mine.cpu(), expected.cpu(), rtol=1e-6, atol=1e-6)),
            "part_numel": mine.numel(),
            "gathered": [float(b.float().mean()) for b in buffers],
            "reduced_bytes": comm.reduced_bytes,
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawned ranks; tests/unit/test_sharding.py runs the bucket logic over a fake comm
@pytest.mark.parametrize(
    ("backend", "world", "on_cuda"),
    [
        ("gloo", 2, False),
        ("gloo", 3, False),
        pytest.param(  # process_group_backend="gloo" on GPUs: the in-place all-reduce
            "gloo",
            2,
            True,
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
        pytest.param(
            "nccl",
            2,
            True,
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices (one per rank)"),
            ],
        ),
    ],
)
def test_bucket_collectives_give_each_rank_its_parts_sum(backend: str, world: int, on_cuda: bool) -> None:
    results = run_ranks(_collectives, world, backend, on_cuda, timeout=300)
    for rank, got in enumerate(results):
        assert got["reduced_close"], rank
        if world == 2:
            assert got["reduced_equal"], rank
        assert got["part_numel"] == PART
        assert got["gathered"] == [float(r + 1) for r in range(world)]
        assert got["reduced_bytes"] == world * PART * 4
