"""What the Trainer strategy and the Fabric strategy both do at the iteration's boundaries: the same manager
verbs (each glue finds the boundaries its own way, see :mod:`lightning_pstar.fabric`), and the Trainer's proof
that the optimizer step may run inside the backward.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_pstar.runtime.state import MicroBatch

if TYPE_CHECKING:
    from lightning_pstar.runtime.manager import ChunkManager

__all__ = ["accumulating", "eval_pass", "nothing_reads_gradients", "optimizer_stepped"]

# LightningModule hooks that run between the backward and the optimizer step and may read or change gradients
_GRADIENT_READERS = (
    "on_after_backward",
    "on_before_optimizer_step",
    "configure_gradient_clipping",
    "optimizer_step",
    "backward",
)


@contextmanager
def eval_pass(manager: ChunkManager | None) -> Generator[None, None, None]:
    """An evaluation step (or forward) as a pass of its own: with several ranks, its gathers start and end on every
    rank. Nothing to do without a ``manager`` (not set up)."""
    if manager is not None:
        manager.begin_eval_pass()
    yield  # a step that raises ends the pass on this rank only: no collectives after it
    if manager is not None:
        manager.end_eval_pass()


@contextmanager
def accumulating(manager: ChunkManager) -> Generator[None, None, None]:
    """A micro-batch that only accumulates gradients (no reduction, gradients kept in fp32)."""
    manager.micro_batch = MicroBatch.ACCUMULATING
    try:
        yield
    finally:
        manager.micro_batch = MicroBatch.FINAL


def optimizer_stepped(manager: ChunkManager, *, one_per_iteration: bool) -> None:
    """An optimizer stepped: with one step per iteration the warm-up ends with it; where several optimizers may
    step per iteration (manual loops, several optimizers) the step is only noted."""
    if one_per_iteration:
        manager.end_warmup_if_recording()
    else:
        manager.optimizer_stepped()


def nothing_reads_gradients(
    module: pl.LightningModule | None, optimizers: Sequence[Any], *, but_clipping_by_norm: bool = False
) -> bool:
    """Whether no code but the engine's can read or change gradients between this backward and the step
    ([Note: stepping inside the backward] in optim/overlap.py): automatic optimization with one
    optimizer, no gradient clipping (``but_clipping_by_norm``: none but Lightning's by norm, which the
    engine applies), and no hook between the two overridden in the LightningModule or a callback (nor the
    module's own ``backward`` or ``optimizer_step``, which may do anything)."""
    if module is None or not module.automatic_optimization or len(optimizers) != 1:
        return False
    trainer = module._trainer
    if trainer is None:
        return False
    if trainer.gradient_clip_val and not (
        but_clipping_by_norm
        and (trainer.gradient_clip_algorithm or GradClipAlgorithmType.NORM) == GradClipAlgorithmType.NORM
    ):
        return False
    for name in _GRADIENT_READERS:
        if is_overridden(name, module, parent=pl.LightningModule):
            return False
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        for name in ("on_after_backward", "on_before_optimizer_step"):
            if is_overridden(name, callback, parent=pl.Callback):
                return False
    return True
