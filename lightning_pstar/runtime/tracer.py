"""Warm-up trace: non-model memory and chunk accesses at every moment of one iteration.

A *moment* is one point of the iteration: before a module's forward, before a module's backward, or the
optimizer step. During the warm-up iteration the tracer records, per moment, which chunk families are
accessed and the peak of non-model memory until the next moment. Later iterations plan from that trace
(:class:`~lightning_pstar.runtime.placement.AutoPlacement`): the room for chunks at moment ``t`` is
``budget - non_model[t]``.

Non-model memory is measured with the CUDA allocator on a GPU (peak between moments, minus chunk bytes)
and, on the simulated device, as the bytes of tensors autograd saves for backward, excluding views of
chunks, which are model data. The saved-tensor hooks themselves are installed by
:meth:`lightning_pstar.runtime.hooks.ModelHooks.saved_tensors` (one pair for the whole engine), which hands every
saved tensor that is not a chunk-backed weight to :meth:`MemoryTracer.count` while :attr:`counting`.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

__all__ = ["Moment", "MomentKind", "MemoryTracer", "Trace"]

log = logging.getLogger(__name__)


class MomentKind(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"


@dataclass(frozen=True)
class Moment:
    """One recorded moment: what ran, which chunk families it accessed, the non-model peak until the next."""

    kind: MomentKind
    key: int  # module index for FORWARD/BACKWARD, 0 for STEP
    families: tuple[int, ...]
    non_model_bytes: int = 0


@dataclass
class Trace:
    """The warm-up iteration, as a cyclic sequence of moments."""

    moments: list[Moment] = field(default_factory=list)
    _uses: dict[int, list[int]] = field(default_factory=dict)  # family -> sorted moment indices

    def finish(self) -> None:
        self._uses = {}
        for index, moment in enumerate(self.moments):
            for fid in moment.families:
                self._uses.setdefault(fid, []).append(index)

    def next_use(self, family_id: int, after: int) -> int:
        """Moments from ``after`` until ``family_id`` is used again (the trace repeats); huge if never."""
        uses = self._uses.get(family_id)
        n = len(self.moments)
        if not uses or n == 0:
            return 1 << 30
        i = bisect.bisect_right(uses, after)
        nxt = uses[i] if i < len(uses) else uses[0] + n
        return nxt - after

    @property
    def peak_non_model(self) -> int:
        return max((m.non_model_bytes for m in self.moments), default=0)

    def device_need(self, chunk_bytes: Callable[[Sequence[int]], int]) -> list[int]:
        """Per moment, the device bytes it needs: its chunks (``chunk_bytes(families)``; none at the step, which
        moves chunks family by family) plus the non-model memory measured then."""
        return [
            (chunk_bytes(m.families) if m.kind is not MomentKind.STEP else 0) + m.non_model_bytes for m in self.moments
        ]


class _SavedToken:
    """Held by autograd next to a saved tensor; its death means the saved bytes are free again."""

    __slots__ = ("_nbytes", "_release")

    def __init__(self, nbytes: int, release: Callable[[int], None]) -> None:
        self._nbytes = nbytes
        self._release = release

    def __del__(self) -> None:
        self._release(self._nbytes)


class MemoryTracer:
    """Records the warm-up trace; afterwards, follows the iteration along it."""

    def __init__(
        self,
        device: torch.device,
        chunk_bytes_on_device: Callable[[], int],
        chunk_storage_ptrs: Callable[[], set[int]] = set,
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._chunk_bytes = chunk_bytes_on_device
        self._chunk_storage_ptrs = chunk_storage_ptrs
        self.trace = Trace()
        self.recording = False
        self.warmed_up = False
        self.cursor = -1  # index of the current moment in the trace (after warm-up)
        self.matches = True  # False once the execution stopped following the trace
        self._live = 0  # simulated device: bytes of saved tensors alive now
        self._peak = 0  # simulated device: peak of ``_live`` since the last moment
        self._pending: tuple[MomentKind, int, tuple[int, ...]] | None = None

    # ---- saved-tensor accounting (simulated device) ------------------------------------------------------
    def _release(self, nbytes: int) -> None:
        self._live -= nbytes

    @property
    def counting(self) -> bool:
        """Whether saved tensors are counted now (a recorded training step on the simulated device)."""
        return self.recording and not self.cuda

    def count(self, tensor: torch.Tensor) -> _SavedToken | None:
        """Count a tensor autograd saves for backward until the returned token dies (keep it beside the tensor);
        None when it is not counted."""
        storage = tensor.untyped_storage()
        # a view of a chunk (on either tier; chunks move and re-allocate during the step): model data
        if storage.data_ptr() in self._chunk_storage_ptrs():
            return None
        if tensor.device.type != self.device.type:
            return None
        nbytes = storage.nbytes()
        self._live += nbytes
        self._peak = max(self._peak, self._live)
        return _SavedToken(nbytes, self._release)

    def _non_model_now_and_reset(self) -> int:
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device) - self._chunk_bytes()
            torch.cuda.reset_peak_memory_stats(self.device)
            return max(0, peak)
        peak = self._peak
        self._peak = self._live
        return peak

    # ---- moments ------------------------------------------------------------------------------------------
    def start_recording(self) -> None:
        self.trace = Trace()
        self.recording = True
        self._pending = None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._peak = self._live

    def moment(self, kind: MomentKind, key: int, families: Sequence[int]) -> None:
        """Called before every moment. Records during warm-up; afterwards advances along the trace."""
        if self.recording:
            self._close_pending()
            self._pending = (kind, key, tuple(families))
            return
        if not self.warmed_up or not self.matches:
            return
        if kind is MomentKind.STEP:
            # the trace's next step: with several optimizers an iteration has several steps (a GAN's generator
            # and discriminator cycles); accumulated micro-batches each restart at the trace's first moment,
            # so their step is the trace's last
            moments = self.trace.moments
            after = self.cursor + 1
            steps = (i for i in range(max(after, 0), len(moments)) if moments[i].kind is MomentKind.STEP)
            self.cursor = next(steps, len(moments) - 1)
            return
        nxt = self.cursor + 1
        moments = self.trace.moments
        if nxt < len(moments) and moments[nxt].kind is kind and moments[nxt].key == key:
            self.cursor = nxt
            return
        self.matches = False
        log.warning(
            "PatrickStar: the iteration no longer follows the warm-up trace (moment %d: %s of module %d);"
            " placement falls back to least-recently-used eviction for the rest of the run.",
            nxt,
            kind.value,
            key,
        )

    def _close_pending(self) -> None:
        if self._pending is None:
            return
        kind, key, families = self._pending
        self.trace.moments.append(Moment(kind, key, families, self._non_model_now_and_reset()))
        self._pending = None

    def stop_recording(self) -> None:
        """End of warm-up (after the first optimizer step)."""
        self._close_pending()
        self.recording = False
        self.warmed_up = True
        self.trace.finish()
        self.cursor = len(self.trace.moments) - 1  # the step: the next moment starts the next iteration

    def start_iteration(self) -> None:
        """A new micro-batch begins: the next forward moment is the trace's first."""
        if self.warmed_up and self.matches:
            self.cursor = -1
