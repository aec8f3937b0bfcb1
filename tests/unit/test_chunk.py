"""Unit tests of lightning_pstar.runtime.chunk: storage per tier, moves, stats, storage identity."""

from __future__ import annotations

import pytest
import torch

from lightning_pstar.runtime.chunk import Chunk, ChunkKind, Slot, TransferStats
from lightning_pstar.runtime.state import ChunkState, TensorState, Tier

CPU = torch.device("cpu")


def _slots() -> list[Slot]:
    return [
        Slot(name="a", offset=0, numel=6, shape=torch.Size([2, 3])),
        Slot(name="b", offset=8, numel=4, shape=torch.Size([4])),
        Slot(name="c", offset=16, numel=8, shape=torch.Size([2, 2, 2])),
    ]


def _chunk(
    stats: TransferStats | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    capacity: int = 24,
    slots: list[Slot] | None = None,
    chunk_id: int = 0,
) -> Chunk:
    return Chunk(
        chunk_id=chunk_id,
        kind=ChunkKind.PARAM,
        dtype=dtype,
        capacity=capacity,
        slots=_slots() if slots is None else slots,
        device=CPU,
        stats=stats if stats is not None else TransferStats(),
    )


def test_new_chunk_is_released_and_holds_no_memory() -> None:
    stats = TransferStats()
    chunk = _chunk(stats)
    assert chunk.tier is None
    assert chunk.state is ChunkState.RELEASED
    assert chunk.device_buffer.untyped_storage().nbytes() == 0
    assert chunk.device_buffer.shape == (24,)
    assert stats.per_tier_bytes == {Tier.DEVICE: 0, Tier.HOST: 0}
    with pytest.raises(RuntimeError, match=r"chunk 0 \(param\) is released"):
        chunk.data  # noqa: B018


@pytest.mark.parametrize("capacity", [0, -3])
def test_capacity_must_be_positive(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity must be positive"):
        _chunk(capacity=capacity)


@pytest.mark.parametrize(("dtype", "itemsize"), [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
def test_nbytes(dtype: torch.dtype, itemsize: int) -> None:
    assert _chunk(dtype=dtype).nbytes == 24 * itemsize


@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.HOST])
def test_allocate_zeroes_and_counts(tier: Tier) -> None:
    stats = TransferStats()
    chunk = _chunk(stats)
    chunk.allocate(tier)
    assert chunk.tier is tier
    assert chunk.state is ChunkState.HOLD
    assert chunk.data.shape == (24,)
    assert chunk.data.untyped_storage().nbytes() == chunk.nbytes
    assert torch.count_nonzero(chunk.data) == 0
    assert stats.per_tier_bytes[tier] == chunk.nbytes
    other = Tier.HOST if tier is Tier.DEVICE else Tier.DEVICE
    assert stats.per_tier_bytes[other] == 0
    assert stats.peak_device_bytes == (chunk.nbytes if tier is Tier.DEVICE else 0)
    assert stats.h2d_bytes == stats.d2h_bytes == 0  # allocation is not a transfer


def test_allocate_twice_is_an_internal_error() -> None:
    chunk = _chunk()
    chunk.allocate(Tier.DEVICE)
    with pytest.raises(AssertionError, match="already allocated"):
        chunk.allocate(Tier.HOST)


def test_slot_view_shapes_and_offsets() -> None:
    chunk = _chunk()
    chunk.allocate(Tier.DEVICE)
    chunk.data.copy_(torch.arange(24, dtype=torch.float32))
    a, b, c = (chunk.slot_view(s) for s in chunk.slots)
    assert a.shape == (2, 3) and b.shape == (4,) and c.shape == (2, 2, 2)
    assert torch.equal(a.flatten(), torch.arange(0, 6, dtype=torch.float32))
    assert torch.equal(b, torch.arange(8, 12, dtype=torch.float32))
    assert torch.equal(c.flatten(), torch.arange(16, 24, dtype=torch.float32))
    # views, not copies
    b.fill_(-1)
    assert torch.equal(chunk.data[8:12], torch.full((4,), -1.0))
    assert a.untyped_storage().data_ptr() == chunk.data.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_move_round_trip_keeps_bytes_and_frees_source(dtype: torch.dtype) -> None:
    stats = TransferStats()
    chunk = _chunk(stats, dtype=dtype)
    chunk.allocate(Tier.DEVICE)
    values = torch.randn(24).to(dtype)
    values[3] = float("inf")
    values[5] = float("nan")
    chunk.data.copy_(values)
    expected = values.view(torch.int16 if dtype.itemsize == 2 else torch.int32).clone()

    chunk.move_to(Tier.HOST)
    assert chunk.tier is Tier.HOST
    assert chunk.device_buffer.untyped_storage().nbytes() == 0
    assert chunk.data.untyped_storage().nbytes() == chunk.nbytes
    assert torch.equal(chunk.data.view(expected.dtype), expected)
    assert stats.per_tier_bytes == {Tier.DEVICE: 0, Tier.HOST: chunk.nbytes}
    assert (stats.d2h_bytes, stats.h2d_bytes) == (chunk.nbytes, 0)

    host_storage = chunk.data.untyped_storage()
    chunk.move_to(Tier.DEVICE)
    assert chunk.tier is Tier.DEVICE
    assert host_storage.nbytes() == 0
    assert torch.equal(chunk.device_buffer.view(expected.dtype), expected)
    assert stats.per_tier_bytes == {Tier.DEVICE: chunk.nbytes, Tier.HOST: 0}
    assert (stats.d2h_bytes, stats.h2d_bytes) == (chunk.nbytes, chunk.nbytes)
    assert stats.peak_device_bytes == chunk.nbytes


def test_move_to_current_tier_is_a_noop() -> None:
    stats = TransferStats()
    chunk = _chunk(stats)
    chunk.allocate(Tier.DEVICE)
    chunk.move_to(Tier.DEVICE)
    assert stats.h2d_bytes == stats.d2h_bytes == 0
    assert stats.per_tier_bytes[Tier.DEVICE] == chunk.nbytes


def test_move_released_chunk_raises() -> None:
    chunk = _chunk()
    with pytest.raises(RuntimeError, match="released; allocate it before moving"):
        chunk.move_to(Tier.DEVICE)


def test_device_view_sees_new_bytes_after_refetch() -> None:
    """[Note: storage identity]: a view taken before eviction reads the fetched bytes afterwards."""
    chunk = _chunk()
    chunk.allocate(Tier.DEVICE)
    chunk.data.copy_(torch.arange(24, dtype=torch.float32))
    slot = chunk.slots[1]
    view = chunk.device_buffer[slot.offset : slot.offset + slot.numel].view(slot.shape)
    saved_t = chunk.device_buffer[:6].view(2, 3).t()  # what autograd would save for a linear layer
    storage = view.untyped_storage()

    chunk.move_to(Tier.HOST)
    assert storage.nbytes() == 0  # freed in place, the view survives
    chunk.data[slot.offset : slot.offset + slot.numel] = torch.tensor([10.0, 20.0, 30.0, 40.0])
    chunk.data[:6] = 7.0
    chunk.move_to(Tier.DEVICE)

    assert storage.nbytes() == chunk.nbytes
    assert torch.equal(view, torch.tensor([10.0, 20.0, 30.0, 40.0]))
    assert torch.equal(saved_t, torch.full((3, 2), 7.0))
    # the same Python storage object backs the device buffer for the chunk's life
    assert chunk.device_buffer.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()


def test_host_storage_is_reused_across_evictions() -> None:
    chunk = _chunk()
    chunk.allocate(Tier.DEVICE)
    chunk.move_to(Tier.HOST)
    host = chunk.data
    chunk.move_to(Tier.DEVICE)
    chunk.move_to(Tier.HOST)
    assert chunk.data is host


@pytest.mark.parametrize(
    "state", [TensorState.HOLD, TensorState.HOLD_AFTER_FWD, TensorState.HOLD_AFTER_BWD, TensorState.FREE]
)
def test_state_derived_from_slots_hold(state: TensorState) -> None:
    chunk = _chunk()
    chunk.allocate(Tier.DEVICE)
    for s in chunk.slots:
        s.state = state
    assert chunk.state is ChunkState.HOLD
    chunk.move_to(Tier.HOST)  # HOLD* chunks may move
    assert chunk.tier is Tier.HOST


@pytest.mark.parametrize("target", [Tier.HOST, Tier.DEVICE])
def test_moving_a_chunk_with_a_compute_slot_raises(target: Tier) -> None:
    stats = TransferStats()
    chunk = _chunk(stats)
    start = Tier.DEVICE if target is Tier.HOST else Tier.HOST
    chunk.allocate(start)
    chunk.data.fill_(3.0)
    chunk.slots[0].state = TensorState.HOLD
    chunk.slots[1].state = TensorState.COMPUTE
    assert chunk.state is ChunkState.COMPUTE
    with pytest.raises(RuntimeError, match=r"chunk 0 is in use by a module \(COMPUTE\) and cannot move"):
        chunk.move_to(target)
    assert chunk.tier is start
    assert torch.equal(chunk.data, torch.full((24,), 3.0))
    assert stats.h2d_bytes == stats.d2h_bytes == 0


@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.HOST])
def test_let_go_frees_the_storage_with_its_last_reference(tier: Tier) -> None:
    """``Chunk.let_go`` (the end of a run): a view user code kept reads the chunk's last bytes; without one the
    storage dies with the chunk's reference."""
    import weakref

    stats = TransferStats()
    chunk = _chunk(stats)
    chunk.allocate(tier)
    chunk.data.copy_(torch.arange(24, dtype=torch.float32))
    kept = chunk.data[8:12].view(4)  # as a `param.detach()` taken in a callback
    chunk.let_go()
    assert chunk.tier is None and stats.per_tier_bytes == {Tier.DEVICE: 0, Tier.HOST: 0}
    assert torch.equal(kept, torch.arange(8, 12, dtype=torch.float32))  # readable: nothing was freed under it
    other = _chunk()
    other.allocate(tier)
    gone = weakref.ref(other.data.untyped_storage())
    other.let_go()
    assert gone() is None  # freed with the chunk's own reference
    other.let_go()  # idempotent


@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.HOST])
def test_release_frees_storage(tier: Tier) -> None:
    stats = TransferStats()
    chunk = _chunk(stats)
    chunk.allocate(tier)
    storage = chunk.data.untyped_storage()
    chunk.release()
    assert chunk.tier is None
    assert chunk.state is ChunkState.RELEASED
    assert storage.nbytes() == 0
    assert stats.per_tier_bytes == {Tier.DEVICE: 0, Tier.HOST: 0}
    chunk.release()  # idempotent
    assert stats.per_tier_bytes == {Tier.DEVICE: 0, Tier.HOST: 0}
    chunk.allocate(Tier.DEVICE)  # a released chunk can be allocated again, zeroed
    assert torch.count_nonzero(chunk.data) == 0


def test_stats_shared_by_chunks_track_peak() -> None:
    stats = TransferStats()
    a, b = _chunk(stats, chunk_id=0), _chunk(stats, chunk_id=1, dtype=torch.bfloat16)
    a.allocate(Tier.DEVICE)
    b.allocate(Tier.DEVICE)
    peak = a.nbytes + b.nbytes
    assert stats.peak_device_bytes == peak
    a.move_to(Tier.HOST)
    b.release()
    assert stats.per_tier_bytes == {Tier.DEVICE: 0, Tier.HOST: a.nbytes}
    assert stats.peak_device_bytes == peak  # a peak never goes down
    a.move_to(Tier.DEVICE)
    assert stats.peak_device_bytes == peak
    assert stats.h2d_bytes == a.nbytes and stats.d2h_bytes == a.nbytes


def test_stats_guard_against_negative_counters() -> None:
    stats = TransferStats()
    with pytest.raises(AssertionError, match="negative"):
        stats.freed(Tier.HOST, 1)


def test_slot_set_state_uses_guard() -> None:
    from lightning_pstar.runtime.state import InvalidTransitionError

    slot = Slot(name="w", offset=0, numel=1, shape=torch.Size([1]))
    slot.set_state(TensorState.HOLD, chunk_id=4)
    slot.set_state(TensorState.COMPUTE, chunk_id=4)
    with pytest.raises(InvalidTransitionError, match=r"compute -> free for parameter 'w' \(chunk 4\)"):
        slot.set_state(TensorState.FREE, chunk_id=4)
    assert slot.state is TensorState.COMPUTE


def test_repr_names_tier() -> None:
    chunk = _chunk()
    assert "released" in repr(chunk)
    chunk.allocate(Tier.HOST)
    assert "host" in repr(chunk) and "kind=param" in repr(chunk)


@pytest.mark.parametrize(
    ("shape", "offset"),
    [((2, 3), 0), ((4,), 5), ((), 2), ((2, 0, 3), 7), ((2, 3, 4), 1), ((1, 1, 5), 9)],
)
def test_a_slot_view_in_a_buffer_is_the_slice_viewed_as_the_parameter(shape: tuple[int, ...], offset: int) -> None:
    """``Slot.view_in`` (one ``as_strided``) against the plain slice and view, in a buffer that is itself a view of a
    larger one (a rank's part of a gradient bucket): same elements, shape, strides and storage, writes shared."""
    whole = torch.arange(100, dtype=torch.float32)
    buffer = whole[10:70]
    size = torch.Size(shape)
    slot = Slot(name="w", offset=offset, numel=size.numel(), shape=size)
    got, want = slot.view_in(buffer), buffer[offset : offset + size.numel()].view(size)
    assert (got.shape, got.stride(), got.storage_offset()) == (want.shape, want.stride(), want.storage_offset())
    assert got.untyped_storage().data_ptr() == want.untyped_storage().data_ptr() and torch.equal(got, want)
    got.fill_(-1.0)
    assert torch.equal(want, torch.full(size, -1.0)) and int((whole == -1.0).sum()) == size.numel()


def test_a_slot_that_overruns_its_buffer_raises_instead_of_viewing_past_it() -> None:
    """The slice it replaces raised on a slot past the buffer's end (a view of the wrong elements otherwise)."""
    whole = torch.zeros(100)
    slot = Slot(name="w", offset=50, numel=20, shape=torch.Size([4, 5]))
    with pytest.raises(RuntimeError, match="internal error.*'w'.*50 to 70.*60 elements"):
        slot.view_in(whole[:60])
    assert slot.view_in(whole[:70]).shape == (4, 5)
