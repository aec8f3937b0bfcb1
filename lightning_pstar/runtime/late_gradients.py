"""Gradients a module meets when it computes again before the step that consumes them.

[Note: a forward after the gradient]
A module may compute again after its parameters' gradients of a backward have landed and before the step
that consumes them: a second forward and backward inside one manual-optimization ``training_step`` before
``opt.step()``, a GAN's critic after the generator's loss reached it (no ``toggle_optimizer``), an
evaluation forward between two backwards of an accumulation (Fabric without ``no_backward_sync``, or a
validation inside a manual accumulation window), or reentrant activation checkpointing of a module used in
several segments (weights shared across layers, as ALBERT does), whose second use's recomputation runs
after its gradient of the first has landed; the same holds for a module's backward (``pre_backward``) that
meets gradients another backward landed (a module used both plainly and under reentrant checkpointing, a
second backward through a retained graph). One rank: those gradients are kept as gradients summed with the
ones to come, as between accumulating micro-batches (a gradient in the param slot moves into the fp32 GRAD
chunk and the slot gets its weight back, ``GradStore.carry_over``), and the module computes with its
weights; a later gradient lands beside them and the step reads their sum, as plain PyTorch's ``p.grad``
sums. Inside a backward the family is marked too: it never steps, nor has its gradient norms taken, inside
a backward again (a second gradient could follow). A family whose step already started inside this
backward raises instead, naming the parameter, before anything changes (its job reads those bytes); one in
flight from the last step (``"next_forward"``) is left to its job, which forgets its gradients. Several
ranks keep refusing (the state transition's error): the gradient was reduced to its owner already.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from lightning_pstar.runtime.family import ParamRecord
from lightning_pstar.runtime.state import TensorState

if TYPE_CHECKING:
    from lightning_pstar.runtime.grads import GradStore
    from lightning_pstar.runtime.residency import Residency
    from lightning_pstar.runtime.sharding_factory import Sharding

__all__ = ["forward_after_gradient", "refuse_late_gradient"]

_HOLD_AFTER_BWD = TensorState.HOLD_AFTER_BWD


class _Manager(Protocol):
    """What :func:`forward_after_gradient` reads of the ``ChunkManager`` (a protocol: the manager imports this)."""

    grads: GradStore
    residency: Residency
    sharding: Sharding


def forward_after_gradient(manager: _Manager, records: Sequence[ParamRecord], *, in_backward: bool) -> None:
    """A module is about to compute (a forward, or its backward: ``in_backward``) with ``records``, some of which
    hold a gradient of a backward whose step has not run: keep those as gradients summed with the ones to come
    ([Note: a forward after the gradient]), or refuse where a step already read them."""
    held = [r for r in records if r.slot.state is _HOLD_AFTER_BWD]
    if not held or manager.sharding.distributed:
        return
    for record in held:  # started inside this backward
        if record.family.family_id in manager.grads.stepped:
            refuse_late_gradient(record)
    stepping = manager.residency.stepping  # in flight from the last step: its job forgets the gradients
    held = [r for r in held if r.family.family_id not in stepping]
    if in_backward:
        for record in held:
            record.family.recomputed_after_grad = True
    if held:
        manager.grads.carry_over(held)


def refuse_late_gradient(record: ParamRecord) -> None:
    raise RuntimeError(
        f"PatrickStar started the optimizer step of parameter '{record.slot.name}' (chunk {record.family.family_id})"
        " during the backward, when all its gradients had arrived (optimizer_overlap='pipeline', or 'auto' timing"
        " it), but it received another gradient in the same backward (a parameter used in two reentrant"
        " activation-checkpointed segments, or a second backward before the step). HINT: set"
        " optimizer_overlap='off', or use torch.utils.checkpoint with use_reentrant=False."
    )
