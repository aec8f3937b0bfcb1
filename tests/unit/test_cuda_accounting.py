"""Issue 12, item 8 on CPU: the tracer's CUDA accounting with a fake allocator (the step's measurement, a user's
own peak counter, the device-side step's temporaries) and the translation of a CUDA out-of-memory error."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.planning.requirements import MemoryBudgetError, step_temporary_bytes
from lightning_pstar.runtime.tracer import (
    CudaAllocatorStats,
    MemoryTracer,
    MomentKind,
    take_free_blocks,
)

MIB = 1 << 20


class _FakeAllocator(CudaAllocatorStats):
    """Counters driven by the test: ``allocate``/``free`` move the allocated bytes and the peak as CUDA's do."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.now = 0
        self.high = 0
        self.resets = 0
        self.free_list: list[int] = [8 * MIB]  # large blocks the caching allocator holds free
        self.held: list[list[int]] = []  # the requests of each restore

    def allocate(self, nbytes: int) -> None:
        self.now += nbytes
        self.high = max(self.high, self.now)

    def free(self, nbytes: int) -> None:
        self.now -= nbytes

    def peak(self) -> int:
        return self.high

    def allocated(self) -> int:
        return self.now

    def reset_peak(self) -> None:
        self.resets += 1
        self.high = self.now

    def free_blocks(self) -> list[int]:
        return list(self.free_list)

    def _hold_and_free(self, sizes: list[int]) -> None:
        self.held.append(list(sizes))
        for n in sizes:
            self.allocate(n)
        for n in sizes:
            self.free(n)


class _Chunks:
    def __init__(self, fake: _FakeAllocator) -> None:
        self.fake = fake
        self.nbytes = 0

    def __call__(self) -> int:
        return self.nbytes

    def fetch(self, nbytes: int) -> None:
        self.nbytes += nbytes
        self.fake.allocate(nbytes)

    def evict(self, nbytes: int) -> None:
        self.nbytes -= nbytes
        self.fake.free(nbytes)


def _tracer() -> tuple[MemoryTracer, _FakeAllocator, _Chunks]:
    fake = _FakeAllocator()
    chunks = _Chunks(fake)
    return MemoryTracer(torch.device("cpu"), chunks, allocator=fake), fake, chunks


def test_the_steps_measurement_excludes_chunks_resident_at_the_reset() -> None:
    """Forward: chunks arrive with the peak (subtract those at the end). Step: chunks leave after the peak
    (subtract those resident at the reset), so the step's non-model memory is its temporaries only."""
    tracer, fake, chunks = _tracer()
    tracer.start_recording()
    tracer.moment(MomentKind.FORWARD, 0, (0,))
    chunks.fetch(600)
    fake.allocate(300)  # activations, freed by the end of the backward
    fake.free(300)
    tracer.moment(MomentKind.STEP, 0, (0,))
    fake.allocate(100)  # a step temporary beside all 600 chunk bytes: the peak of the step
    fake.free(100)
    chunks.evict(500)  # the step moves families to the host
    tracer.stop_recording()
    forward, step = tracer.trace.moments
    assert forward.non_model_bytes == 300
    assert step.non_model_bytes == 100  # not 600: the 500 chunk bytes that left are not activations


def test_a_users_own_peak_reading_survives_the_warm_up() -> None:
    tracer, fake, chunks = _tracer()
    fake.allocate(5000)
    fake.free(5000)  # the user's model peaked at 5000 before fit
    tracer.start_recording()
    tracer.moment(MomentKind.FORWARD, 0, (0,))
    chunks.fetch(200)
    tracer.stop_recording()
    assert fake.resets >= 2  # the tracer did reset the counter per moment...
    assert fake.peak() == 5000 and fake.allocated() == 200  # ...and raised it back to the user's peak after


def test_a_higher_peak_during_the_warm_up_is_kept() -> None:
    tracer, fake, chunks = _tracer()
    tracer.start_recording()
    tracer.moment(MomentKind.FORWARD, 0, (0,))
    chunks.fetch(200)
    fake.allocate(7000)
    fake.free(7000)
    tracer.moment(MomentKind.STEP, 0, (0,))
    tracer.stop_recording()
    assert fake.peak() == 7200


def test_a_cuda_out_of_memory_names_the_moment_the_budget_and_what_to_change() -> None:
    tracer, fake, chunks = _tracer()
    tracer.start_recording()
    tracer.moment(MomentKind.BACKWARD, 3, (1,))
    chunks.fetch(4096)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore lines")
    with pytest.raises(MemoryBudgetError) as info, tracer.out_of_memory_as_error(device_budget=10_000):
        raise oom
    message = str(info.value)
    assert "during backward of module #3 (warm-up)" in message
    assert "device_memory_limit 10,000 bytes" in message and "chunks held 4,096 bytes" in message
    assert "Tried to allocate 2.00 GiB." in message and "more lines" not in message and "HINT" in message
    assert info.value.__cause__ is oom


def test_step_temporaries_are_one_fp32_family() -> None:
    assert step_temporary_bytes(1000, mixed=True) == 4000
    assert step_temporary_bytes(1000, mixed=False) == 0  # 32-true steps on views of its fp32 grad chunk


class _Exploding(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 4)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")
        return self.net(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_strategy_turns_an_out_of_memory_in_a_step_into_a_budget_error() -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=PatrickStarStrategy(device_memory_limit="1MiB"),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
    with pytest.raises(MemoryBudgetError, match=r"ran out of memory during .*device_memory_limit 1,048,576 bytes"):
        trainer.fit(_Exploding(), data)


def test_restore_peak_reaches_the_users_peak_from_below_it() -> None:
    """A user's peak of 5 MiB, a reset that leaves the counter at 3 MiB with 1 MiB allocated: restoring raises it
    to 5 MiB exactly (4 MiB on top of what is allocated, from a free block), and a higher counter stays."""
    fake = _FakeAllocator()
    fake.allocate(5 * MIB)
    fake.free(4 * MIB)  # allocated 1 MiB, peak 5 MiB: the user's reading
    fake.reset_peak()
    fake.allocate(2 * MIB)
    fake.free(2 * MIB)  # the warm-up's moments: peak 3 MiB since the reset
    assert (fake.peak(), fake.allocated()) == (3 * MIB, 1 * MIB)
    fake.restore_peak(5 * MIB)
    assert (fake.peak(), fake.allocated()) == (5 * MIB, 1 * MIB)
    assert fake.held == [[4 * MIB]]
    fake.restore_peak(4 * MIB)
    assert fake.peak() == 5 * MIB and len(fake.held) == 1


def test_restore_peak_takes_only_blocks_held_free() -> None:
    """Issue 29: the restore never asks for more than the allocator holds free (no new segment for a counter):
    requests sized one per free block, the largest first; where the blocks hold less, the counter stays lower."""
    fake = _FakeAllocator()
    fake.allocate(20 * MIB)
    fake.free(20 * MIB)
    fake.reset_peak()
    fake.free_list = [3 * MIB, 6 * MIB, 2 * MIB]
    fake.restore_peak(20 * MIB)
    assert fake.held == [[6 * MIB, 3 * MIB, 2 * MIB]] and fake.peak() == 11 * MIB


def test_take_free_blocks_cuts_the_last_request_to_what_is_missing() -> None:
    assert take_free_blocks([4 * MIB, 8 * MIB], 10 * MIB) == [8 * MIB, 2 * MIB]
    assert take_free_blocks([8 * MIB], 3000) == [3000]
    assert take_free_blocks([], 5) == [] and take_free_blocks([8 * MIB], 0) == []
