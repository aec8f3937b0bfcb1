"""Unit tests of lightning_pstar.runtime.tracer: the warm-up trace of moments, non-model bytes from saved-tensor
accounting on the simulated device, Belady's ``next_use``, and following (or leaving) the trace afterwards.

No Trainer, no processes: a :class:`MemoryTracer` built with fake callables, fed moments by hand and tensors by
a ``saved_tensors_hooks`` pair like the engine's (``ModelHooks.saved_tensors``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator, Sequence
from typing import Any

import pytest
import torch

from lightning_pstar.runtime.tracer import MemoryTracer, Moment, MomentKind, Trace

CPU = torch.device("cpu")
F32 = 4  # bytes per float32 element
FWD, BWD, STEP = MomentKind.FORWARD, MomentKind.BACKWARD, MomentKind.STEP
NEVER = 1 << 30  # what next_use returns for a family the trace never uses
TRACER_LOGGER = "lightning_pstar.runtime.tracer"


def _tracer(chunks: Sequence[torch.Tensor] = (), device: torch.device = CPU) -> MemoryTracer:
    """A tracer whose chunk storages are those of ``chunks``; 0 chunk bytes on the device."""
    return MemoryTracer(device, lambda: 0, lambda: {c.untyped_storage().data_ptr() for c in chunks})


@contextlib.contextmanager
def _accounting(tracer: MemoryTracer) -> Generator[None, None, None]:
    """The engine's saved-tensor hooks, reduced to the accounting: each saved tensor travels with its token."""

    def pack(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, tracer.count(tensor) if tracer.counting else None

    def unpack(packed: tuple[torch.Tensor, Any]) -> torch.Tensor:
        return packed[0]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


# The iteration of a two-module model, as the manager announces it: forward of modules 0 and 1, their backwards
# in reverse order, the step. Module m's parameters are in family m; the step touches both families.
ITERATION: list[tuple[MomentKind, int, tuple[int, ...]]] = [
    (FWD, 0, (0,)),
    (FWD, 1, (1,)),
    (BWD, 1, (1,)),
    (BWD, 0, (0,)),
    (STEP, 0, (0, 1)),
]


def _record(tracer: MemoryTracer, between: Sequence[Callable[[], None]] = ()) -> None:
    """One warm-up iteration of ITERATION; ``between[i]`` runs right after moment i is announced."""
    tracer.start_recording()
    for i, (kind, key, families) in enumerate(ITERATION):
        tracer.moment(kind, key, families)
        if i < len(between):
            between[i]()
    tracer.stop_recording()


def _warmed_up() -> MemoryTracer:
    tracer = _tracer()
    _record(tracer)
    return tracer


def _follow(tracer: MemoryTracer, moments: Sequence[tuple[MomentKind, int]]) -> list[int]:
    """Announce ``moments`` after warm-up; the cursor after each."""
    cursors = []
    for kind, key in moments:
        tracer.moment(kind, key, ())
        cursors.append(tracer.cursor)
    return cursors


# ---- recording ------------------------------------------------------------------------------------------------


def test_counting_only_while_recording_on_the_simulated_device() -> None:
    tracer = _tracer()
    assert not tracer.counting and not tracer.recording and not tracer.warmed_up
    tracer.start_recording()
    assert tracer.counting and tracer.recording
    tracer.stop_recording()
    assert not tracer.counting and not tracer.recording and tracer.warmed_up
    cuda = MemoryTracer(torch.device("cuda"), lambda: 0)
    assert cuda.cuda and not tracer.cuda
    cuda.recording = True  # start_recording would reset CUDA statistics: the GPU test below does it for real
    assert not cuda.counting, "on a GPU the allocator measures non-model memory, not the saved-tensor hooks"


def test_warmup_records_one_moment_per_announcement_with_its_families() -> None:
    tracer = _warmed_up()
    moments = tracer.trace.moments
    assert [(m.kind, m.key, m.families) for m in moments] == ITERATION
    assert all(m.non_model_bytes == 0 for m in moments)  # nothing was saved
    assert tracer.trace.peak_non_model == 0
    assert tracer.cursor == len(ITERATION) - 1, "after warm-up the cursor sits on the step"


def test_families_are_stored_as_tuples() -> None:
    tracer = _tracer()
    tracer.start_recording()
    tracer.moment(FWD, 3, [2, 5])  # the manager may pass a list
    tracer.stop_recording()
    assert tracer.trace.moments == [Moment(FWD, 3, (2, 5), 0)]


def test_non_model_bytes_per_moment_are_the_peak_of_live_saved_bytes_until_the_next_moment() -> None:
    """A moment's figure is the peak of the live saved bytes from its announcement to the next one; each moment
    starts from what is still alive. Saved: a (100 floats) in forward 0, b (200 floats) in forward 1; b dies in
    backward 1, a in backward 0."""
    tracer = _tracer()
    a, b = torch.zeros(100), torch.zeros(200)
    tokens: dict[str, Any] = {}

    def save(name: str, tensor: torch.Tensor) -> Callable[[], None]:
        return lambda: tokens.__setitem__(name, tracer.count(tensor))

    def free(name: str) -> Callable[[], None]:
        return lambda: tokens.pop(name)  # the token dies with autograd's reference to it

    _record(tracer, [save("a", a), save("b", b), free("b"), free("a"), lambda: None])
    got = [m.non_model_bytes for m in tracer.trace.moments]
    assert got == [100 * F32, 300 * F32, 300 * F32, 100 * F32, 0]
    assert tracer.trace.peak_non_model == 300 * F32
    assert tokens == {}


def test_bytes_saved_before_the_first_moment_belong_to_it() -> None:
    tracer = _tracer()
    tracer.start_recording()
    token = tracer.count(torch.zeros(10))
    tracer.moment(FWD, 0, (0,))
    del token
    tracer.moment(STEP, 0, (0,))
    tracer.stop_recording()
    assert [m.non_model_bytes for m in tracer.trace.moments] == [10 * F32, 0]


def test_a_view_counts_its_whole_storage() -> None:
    """Autograd keeps the whole storage of a saved view alive: that is what it costs."""
    tracer = _tracer()
    tracer.start_recording()
    tracer.moment(FWD, 0, (0,))
    base = torch.zeros(1000)
    token = tracer.count(base[:10])
    tracer.stop_recording()
    assert token is not None
    assert tracer.trace.moments[0].non_model_bytes == 1000 * F32


def test_views_of_chunks_and_tensors_on_another_device_are_not_counted() -> None:
    chunk = torch.zeros(64)
    tracer = _tracer(chunks=[chunk], device=torch.device("cuda"))  # only its device type matters here
    assert tracer.count(torch.zeros(8)) is None, "a CPU tensor is not on the tracer's device"
    tracer = _tracer(chunks=[chunk])
    tracer.start_recording()
    tracer.moment(FWD, 0, (0,))
    assert tracer.count(chunk[8:24].view(4, 4)) is None, "a view of a chunk is model data"
    assert tracer.count(chunk) is None
    token = tracer.count(torch.zeros(8))
    tracer.stop_recording()
    assert token is not None
    assert tracer.trace.moments[0].non_model_bytes == 8 * F32


def test_saved_tensor_hooks_measure_autograd_activations() -> None:
    """Real autograd: ``sin`` saves its input, ``exp`` its output, ``mul`` by a chunk-backed weight saves the chunk
    view (model data, not counted) and the other operand. Backward frees everything before the step."""
    chunk = torch.zeros(128, requires_grad=True)
    tracer = _tracer(chunks=[chunk])
    x = torch.randn(64, requires_grad=True)
    tracer.start_recording()
    with _accounting(tracer):
        tracer.moment(FWD, 0, (0,))
        h = torch.sin(x)  # saves x: 64 floats
        tracer.moment(FWD, 1, (1,))
        z = torch.exp(h)  # saves z: 64 floats
        y = z * chunk[:64]  # saves z (again, same storage) and the chunk view
        loss = y.sum()
    tracer.moment(BWD, 1, (1,))
    loss.backward()
    del h, z, y, loss
    tracer.moment(STEP, 0, (0, 1))
    tracer.stop_recording()
    got = [(m.kind, m.non_model_bytes) for m in tracer.trace.moments]
    # forward 1 sees x, z and z's second save: each save holds its storage until its node is freed
    assert got == [(FWD, 64 * F32), (FWD, 3 * 64 * F32), (BWD, 3 * 64 * F32), (STEP, 0)]
    assert x.grad is not None and chunk.grad is not None  # the accounting did not disturb autograd


def test_start_recording_starts_a_fresh_trace() -> None:
    tracer = _tracer()
    tracer.start_recording()
    tracer.moment(FWD, 0, (0,))
    tracer.start_recording()  # e.g. the first attempt was abandoned: its pending moment is dropped
    tracer.moment(FWD, 7, (3,))
    tracer.stop_recording()
    assert tracer.trace.moments == [Moment(FWD, 7, (3,), 0)]


def test_moments_before_the_warmup_are_ignored() -> None:
    tracer = _tracer()
    tracer.moment(FWD, 0, (0,))
    tracer.start_iteration()
    assert tracer.trace.moments == [] and tracer.cursor == -1 and tracer.matches


# ---- the trace ------------------------------------------------------------------------------------------------


def _trace() -> Trace:
    trace = Trace(moments=[Moment(kind, key, families) for kind, key, families in ITERATION])
    trace.finish()
    return trace


@pytest.mark.parametrize(
    ("family", "after", "distance"),
    [
        (0, -1, 1),  # before the first moment (a new iteration): family 0 is used by moment 0
        (0, 0, 3),  # next used by backward 0 (moment 3)
        (0, 3, 1),  # then by the step
        (0, 4, 1),  # the trace repeats: forward 0 of the next iteration
        (1, 0, 1),
        (1, 2, 2),  # backward 1 -> the step
        (1, 4, 2),  # step -> forward 1 of the next iteration
        (7, 0, NEVER),  # never used
    ],
)
def test_next_use_is_the_distance_to_the_next_moment_that_uses_the_family(
    family: int, after: int, distance: int
) -> None:
    assert _trace().next_use(family, after) == distance


def test_next_use_orders_eviction_victims_by_belady() -> None:
    """After forward 0 (moment 0): family 1 is needed next (forward 1), family 0 only in backward: evict 0."""
    trace = _trace()
    ranked = sorted([0, 1], key=lambda f: trace.next_use(f, 0), reverse=True)
    assert ranked == [0, 1]


def test_next_use_of_an_empty_or_unfinished_trace_is_never() -> None:
    assert Trace().next_use(0, 0) == NEVER
    unfinished = Trace(moments=[Moment(FWD, 0, (0,))])
    assert unfinished.next_use(0, 0) == NEVER, "uses are indexed by finish()"


def test_finish_twice_does_not_duplicate_uses() -> None:
    trace = _trace()
    trace.finish()
    assert [trace.next_use(0, i) for i in range(-1, 5)] == [1, 3, 2, 1, 1, 1]


def test_peak_non_model() -> None:
    assert Trace().peak_non_model == 0
    trace = Trace(moments=[Moment(FWD, 0, (), 10), Moment(BWD, 0, (), 30), Moment(STEP, 0, (), 20)])
    assert trace.peak_non_model == 30


def test_device_need_is_chunks_plus_non_model_except_at_the_step() -> None:
    """Per moment: the bytes of its families' chunks plus its non-model bytes; the step moves chunks family by
    family, so only its non-model bytes count."""
    non_model = [10, 30, 20, 5, 7]
    trace = Trace(moments=[Moment(k, key, f, b) for (k, key, f), b in zip(ITERATION, non_model, strict=True)])
    asked: list[tuple[int, ...]] = []

    def chunk_bytes(families: Sequence[int]) -> int:
        asked.append(tuple(families))
        return 100 * len(families)

    assert trace.device_need(chunk_bytes) == [110, 130, 120, 105, 7]
    assert asked == [(0,), (1,), (1,), (0,)], "the step's families are not asked for"


def test_moment_is_a_frozen_value() -> None:
    moment = Moment(FWD, 1, (2,))
    assert moment == Moment(MomentKind("forward"), 1, (2,), 0)
    with pytest.raises(AttributeError):
        moment.key = 2  # type: ignore[misc]
    assert [k.value for k in MomentKind] == ["forward", "backward", "step"]


# ---- after warm-up --------------------------------------------------------------------------------------------


def test_a_later_iteration_follows_the_trace() -> None:
    tracer = _warmed_up()
    before = list(tracer.trace.moments)
    for _ in range(2):
        tracer.start_iteration()
        assert tracer.cursor == -1
        assert _follow(tracer, [(kind, key) for kind, key, _ in ITERATION]) == [0, 1, 2, 3, 4]
    assert tracer.matches
    assert tracer.trace.moments == before, "following the trace does not record"
    assert not tracer.counting


def test_accumulation_restarts_the_forward_at_every_micro_batch() -> None:
    """Two micro-batches before one step: each starts at the trace's first moment; the step jumps to the last."""
    tracer = _warmed_up()
    cursors = []
    for _ in range(2):
        tracer.start_iteration()
        cursors += _follow(tracer, [(FWD, 0), (FWD, 1), (BWD, 1), (BWD, 0)])
    cursors += _follow(tracer, [(STEP, 0)])
    assert cursors == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert tracer.matches


@pytest.mark.parametrize(
    ("moments", "at"),
    [
        ([(FWD, 1)], 0),  # another module first
        ([(FWD, 0), (BWD, 1)], 1),  # a backward where the trace has a forward
        ([(FWD, 0), (FWD, 1), (BWD, 1), (BWD, 0), (FWD, 0)], 4),  # a forward where the trace has the step
    ],
    ids=["other-module", "other-kind", "extra-forward"],
)
def test_a_diverging_iteration_stops_following_once(
    moments: list[tuple[MomentKind, int]], at: int, caplog: pytest.LogCaptureFixture
) -> None:
    tracer = _warmed_up()
    tracer.start_iteration()
    with caplog.at_level(logging.WARNING, logger=TRACER_LOGGER):
        cursors = _follow(tracer, moments)
        assert not tracer.matches
        kind, key = moments[-1]
        assert cursors[-1] == at - 1, "the cursor stays on the last moment that matched"
        # from now on nothing moves the cursor and nothing warns again
        tracer.start_iteration()
        assert _follow(tracer, [(kind, key) for kind, key, _ in ITERATION]) == [at - 1] * len(ITERATION)
    warnings = [r for r in caplog.records if r.name == TRACER_LOGGER]
    assert len(warnings) == 1, warnings
    message = warnings[0].getMessage()
    assert f"(moment {at}: {kind.value} of module {key})" in message
    assert "falls back to least-recently-used eviction" in message


def test_moment_past_the_end_of_the_trace_diverges() -> None:
    tracer = _warmed_up()  # cursor on the step: a forward without start_iteration runs off the end
    tracer.moment(FWD, 0, ())
    assert not tracer.matches and tracer.cursor == len(ITERATION) - 1


# ---- CUDA ------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_non_model_bytes_are_the_allocator_peak_minus_chunk_bytes() -> None:
    """On a GPU a moment's figure is the allocator's peak until the next moment minus the chunk bytes there."""
    device = torch.device("cuda")
    chunk = torch.empty(1 << 20, device=device)  # 4 MiB of "model data"
    tracer = MemoryTracer(device, lambda: chunk.untyped_storage().nbytes())
    assert not tracer.counting
    tracer.start_recording()
    assert not tracer.counting
    tracer.moment(FWD, 0, (0,))
    temp = torch.empty(2 << 20, device=device)  # 8 MiB of activations, freed before the next moment
    del temp
    tracer.moment(FWD, 1, (1,))
    tracer.stop_recording()
    first, second = (m.non_model_bytes for m in tracer.trace.moments)
    assert first - second == 8 << 20, (first, second)
    assert second >= 0
