"""States of parameter slots and chunks, and the one table of allowed transitions.

A slot's state says what its bytes mean and who may touch them. A chunk's state is derived from its
slots. Any transition not in :data:`ALLOWED_TRANSITIONS` is a bug in the engine or an unsupported use
of the model; :func:`check_transition` raises on it instead of letting training continue on wrong data.
"""

from __future__ import annotations

from enum import Enum, Flag, auto

__all__ = [
    "ALLOWED_TRANSITIONS",
    "ChunkState",
    "GradLocation",
    "InvalidTransitionError",
    "MicroBatch",
    "Phase",
    "SOURCES_OF",
    "TensorState",
    "Tier",
    "check_transition",
]


class Tier(str, Enum):
    """Where a chunk's bytes live."""

    DEVICE = "device"
    """The accelerator, or a simulated device in host RAM with its own byte budget."""
    HOST = "host"
    """CPU RAM (pinned when the device is CUDA)."""
    DISK = "disk"
    """A file of the run's directory under ``disk_path`` (optimizer-side chunks only: [Note: disk families] in
    ``runtime/disk_tier.py``); lent a host buffer while a reader holds it."""


class TensorState(str, Enum):
    """State of one parameter slot inside a chunk."""

    FREE = "free"
    """No parameter lives in the slot yet (before materialisation)."""
    COMPUTE = "compute"
    """A module is computing with the parameter: the chunk must stay resident and must not move."""
    HOLD = "hold"
    """The slot holds the parameter value; nobody is using it right now."""
    HOLD_AFTER_FWD = "hold_after_fwd"
    """Forward of the owning module finished; backward will need the value again."""
    HOLD_AFTER_BWD = "hold_after_bwd"
    """The gradient is final for the coming optimizer step. In mixed precision the slot holds the
    gradient, not the weight, until the optimizer step writes the weight back (the parameter reads its
    fp32 master meanwhile)."""


class ChunkState(str, Enum):
    """State of a chunk, derived from its slots (``COMPUTE`` wins over ``HOLD*``)."""

    RELEASED = "released"
    """No storage on any tier."""
    COMPUTE = "compute"
    """At least one slot is in ``COMPUTE``: the chunk is pinned where it is."""
    HOLD = "hold"
    """All slots are ``FREE`` or ``HOLD*``: the chunk may move or be evicted."""


class Phase(str, Enum):
    """Which part of the iteration the engine is in (set by the chunk manager's verbs)."""

    IDLE = "idle"
    """Outside any pass: setup, between steps, after training. Module calls are not traced."""
    TRAINING = "training"
    """Inside a training micro-batch, outside its backward (its forward, then its optimizer step): moments
    are traced (warm-up) or followed (the plan)."""
    BACKWARD = "backward"
    """From the first pre-backward of a training micro-batch until its gradients have settled."""
    EVAL = "eval"
    """A forward without gradients (validation, test, predict): chunks are fetched, nothing is traced."""

    @property
    def training(self) -> bool:
        return self is Phase.TRAINING or self is Phase.BACKWARD


class GradLocation(Flag):
    """Where a parameter's gradient for the coming optimizer step lives (both flags: their sum)."""

    NONE = 0
    PARAM_SLOT = auto()
    """Mixed precision, chunk reuse: the param slot holds the gradient in the compute dtype (the weight is
    read from the fp32 master meanwhile)."""
    GRAD_CHUNK = auto()
    """The fp32 GRAD chunk holds the gradient (32-true) or the sum of earlier micro-batches (mixed)."""


class MicroBatch(str, Enum):
    """How a training micro-batch's gradients are kept."""

    FINAL = "final"
    """The last (or only) micro-batch before a step: mixed precision writes into the param slot."""
    ACCUMULATING = "accumulating"
    """A micro-batch whose gradients are summed with the next ones (fp32 GRAD chunk); no step follows."""


_T = TensorState
ALLOWED_TRANSITIONS: frozenset[tuple[TensorState, TensorState]] = frozenset(
    {
        (_T.FREE, _T.HOLD),  # materialised
        # forward: a module starts using its parameters (again, for modules called twice or tied weights)
        (_T.HOLD, _T.COMPUTE),
        (_T.HOLD_AFTER_FWD, _T.COMPUTE),
        (_T.COMPUTE, _T.COMPUTE),
        (_T.COMPUTE, _T.HOLD_AFTER_FWD),  # post-forward
        (_T.COMPUTE, _T.HOLD),  # post-forward without autograd (eval) or post-backward of a frozen param
        # gradient final: from COMPUTE (its module's backward ran) or from a HOLD state (used functionally)
        (_T.COMPUTE, _T.HOLD_AFTER_BWD),
        (_T.HOLD_AFTER_FWD, _T.HOLD_AFTER_BWD),
        (_T.HOLD, _T.HOLD_AFTER_BWD),
        (_T.HOLD_AFTER_FWD, _T.HOLD),  # end of backward for a parameter that received no gradient
        # the optimizer step (or a skipped step) wrote the weight back into the slot
        (_T.HOLD_AFTER_BWD, _T.HOLD),
        (_T.HOLD, _T.HOLD),
    }
)
"""Every allowed ``(from, to)`` pair. Note what is missing: ``HOLD_AFTER_BWD -> COMPUTE`` (a module would
read a gradient as its weight) and anything leaving ``COMPUTE`` for ``FREE``."""


SOURCES_OF: dict[TensorState, tuple[TensorState, ...]] = {
    new: tuple(current for current in TensorState if (current, new) in ALLOWED_TRANSITIONS) for new in TensorState
}
"""For each target state, the states :data:`ALLOWED_TRANSITIONS` lets a slot leave for it (the same table, by
target: the hot path tests a slot's state against a short tuple, by identity, and calls the guard only on a
pair the table does not hold)."""


class InvalidTransitionError(RuntimeError):
    """A slot was asked to move between states that the table does not allow."""


def check_transition(current: TensorState, new: TensorState, *, what: str) -> None:
    """Raise :class:`InvalidTransitionError` unless ``current -> new`` is in the table.

    ``what`` names the parameter (and chunk) for the message.
    """
    if (current, new) not in ALLOWED_TRANSITIONS:
        hint = ""
        if current is TensorState.HOLD_AFTER_BWD and new is TensorState.COMPUTE:
            hint = (
                " Its gradient of a backward waits for the optimizer step and the module computes again before that"
                " step (a second forward or backward before the step, a GAN's critic after the generator's loss"
                " reached it, an evaluation inside an accumulation, a module shared by reentrant checkpointed"
                " segments). One rank carries such a gradient over; at several ranks it was reduced to its owner"
                " rank already and cannot be. HINT: step (or `zero_grad`) before running the model again, use"
                " `toggle_optimizer` / `untoggle_optimizer` in a GAN, `no_backward_sync` for accumulation, or"
                " `use_reentrant=False` for activation checkpointing."
            )
        raise InvalidTransitionError(f"Invalid state transition {current.value} -> {new.value} for {what}.{hint}")
