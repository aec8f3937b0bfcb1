"""A chunk family's layout: what each of its chunks holds (:class:`ChunkKind`) and where one parameter lives
in every one of them (:class:`Slot`). The chunks themselves are :mod:`lightning_pstar.runtime.chunk`'s."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from lightning_pstar.runtime.state import SOURCES_OF, TensorState, check_transition

__all__ = ["ChunkKind", "Slot"]


class ChunkKind(str, Enum):
    """What a chunk of a family holds."""

    PARAM = "param"
    """Parameters in the compute dtype; in mixed precision also their gradients (chunk reuse)."""
    MASTER = "master"
    """fp32 master parameters (mixed precision only)."""
    GRAD = "grad"
    """fp32 gradients (``32-true`` only, where the param chunk is the master)."""
    EXP_AVG = "exp_avg"
    """First moment of Adam, or the momentum buffer of SGD."""
    EXP_AVG_SQ = "exp_avg_sq"
    """Second moment of Adam."""


@dataclass(kw_only=True)
class Slot:
    """Where one parameter lives inside every chunk of its family."""

    name: str
    """The parameter's first name in the model (tied parameters keep their other names elsewhere)."""
    offset: int
    """First element of the slot in the chunk."""
    numel: int
    shape: torch.Size
    state: TensorState = TensorState.FREE

    def set_state(self, new: TensorState, *, chunk_id: int) -> None:
        """Move to ``new`` through the transition guard."""
        if self.state not in SOURCES_OF[new]:  # the message is built only for an error
            check_transition(self.state, new, what=f"parameter '{self.name}' (chunk {chunk_id})")
        self.state = new

    def view_in(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer[offset : offset + numel].view(shape)`` for a contiguous 1-D ``buffer`` laid out like the chunk
        (a chunk's storage, or a gradient buffer of its capacity), as one ``as_strided`` call: the slice and the
        view cost about four times as much, and this runs for every parameter of every step."""
        if self.offset + self.numel > buffer.numel():  # as_strided does not check what the slice did
            raise RuntimeError(
                f"PatrickStar internal error: parameter '{self.name}' (elements {self.offset} to"
                f" {self.offset + self.numel}) does not fit a buffer of {buffer.numel()} elements."
                " HINT: please report this with the model."
            )
        strides = _CONTIGUOUS_STRIDES.get(self.shape)
        if strides is None:
            strides = _CONTIGUOUS_STRIDES[self.shape] = _contiguous_strides(self.shape)
        return buffer.as_strided(self.shape, strides, buffer.storage_offset() + self.offset)


_CONTIGUOUS_STRIDES: dict[torch.Size, tuple[int, ...]] = {}


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
