"""The manager's verbs for the host-side optimizer steps in flight ([Note: the step pipeline] in runtime/pipeline.py).

Plain functions of a :class:`~lightning_pstar.runtime.manager.ChunkManager`: finish every step in flight (before
anything reads or writes weights, gradients or optimizer states outside the step), finish those whose param chunks
the device budget needs, wait for the families a module is about to read, and refuse a module that would compute
with weights already copied back inside the backward. ``ChunkManager.finish_steps`` and
``ChunkManager.end_backward_steps`` call them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from lightning_pstar.runtime.family import ParamRecord
from lightning_pstar.runtime.grads import GradStore
from lightning_pstar.runtime.pipeline import StepPipeline
from lightning_pstar.runtime.residency import Residency

__all__ = ["end_backward_steps", "finish_steps", "finish_steps_for_room", "refuse_early_read", "wait_for_families"]


class ChunkManager(Protocol):
    """What these verbs use of :class:`~lightning_pstar.runtime.manager.ChunkManager` (a protocol: the manager
    imports this module, so this module does not import the manager)."""

    grads: GradStore
    pipeline: StepPipeline
    residency: Residency
    tailing: bool


def end_backward_steps(manager: ChunkManager) -> None:
    """The backward is over: no family starts its step from it any more, and the parameter copies the steps
    started in it held back may run ([Note: the step pipeline] in runtime/pipeline.py)."""
    manager.grads.on_final = None
    manager.pipeline.open_copies_back()


def finish_steps(manager: ChunkManager, *, keep_tail: bool = False) -> None:
    """Finish every host-side optimizer step in flight and stop stepping inside the backward: before anything
    reads or writes weights, gradients or optimizer states outside the step ([Note: the step pipeline]).
    ``keep_tail``: steps an ``optimizer.step()`` left in flight (``optimizer_overlap="next_forward"``) go on;
    the modules that need their families wait for them (``ChunkManager.access``)."""
    manager.grads.on_final = None
    if manager.residency.disk is not None:  # the family a load left loaded is written back
        manager.residency.disk.flush_setup()
    if keep_tail and manager.tailing:
        return
    try:
        manager.pipeline.drain()
    finally:
        manager.grads.stepped.clear()
        manager.tailing = False


def finish_steps_for_room(manager: ChunkManager) -> None:
    """The device budget needs room that param chunks of families still stepping hold: finish their steps.
    Inside a backward their copies back must wait for its end, so the steps finish without them and the param
    chunks stay on the host with the new weights (what a serial step on the host leaves): the device bytes
    autograd may still read are never written ([Note: the step pipeline] in runtime/pipeline.py)."""
    if not manager.pipeline.copies_back_open:
        manager.pipeline.settle_off_device(sorted(manager.residency.stepping))
        return
    finish_steps(manager)


def wait_for_families(manager: ChunkManager, records: Sequence[ParamRecord]) -> None:
    """Finish the steps in flight of the families of ``records`` (a module is about to read them)."""
    pipeline = manager.pipeline
    for record in records:
        if pipeline.in_flight(record.family.family_id):
            pipeline.wait(record.family.family_id)
    if not pipeline.busy:
        manager.tailing = False


def refuse_early_read(manager: ChunkManager, records: Sequence[ParamRecord]) -> None:
    """A module needs a trainable parameter whose family already copied its new weights back inside this
    backward ([Note: copies back inside the backward] in optim/overlap.py): raise rather than compute with them."""
    early = manager.pipeline.early
    for record in records:
        if record.trainable and record.family.family_id in early:
            raise RuntimeError(
                f"PatrickStar stepped parameter '{record.names[0]}' inside the backward once its gradient was"
                " final and nothing autograd saved still read it, but its module runs again in the same"
                " backward. HINT: set optimizer_overlap='off' (or 'next_forward'), and please report the model."
            )
