"""Writes to a parameter outside a forward, in mixed precision: caught before they are lost.

[Note: writes outside a forward]
In mixed precision a parameter is a compute-dtype view of its param slot, and the weight the optimizer steps,
that checkpoints save and that teardown hands back is the fp32 master; the engine keeps the slot equal to the
master rounded to the compute dtype. A write through the parameter inside a module's forward reaches the master
(``copy_forward_writes_to_masters`` in ``family.py``). A write outside a forward (an EMA of a frozen teacher in
``on_train_batch_end``, a ``torch.no_grad()`` copy into a weight in a callback, ``module.load_state_dict`` after
setup) reaches only the slot: the next step, backward or fetch replaces it from the master, and checkpoints never
see it. Copying it into the master at the next chance would keep a bf16-rounded value where plain Lightning keeps
fp32 (an EMA with decay 0.999 stalls in bf16), so it is refused instead, naming the parameters, at the first point
where the engine could lose it: the next forward of a module using it (``ChunkManager.pre_forward``) and any read
of the fp32 weights (state dicts, checkpoints, the hand-back at teardown).

How it is seen: a write through the parameter (or ``detach()`` of it) bumps its version counter; ``.data`` writes
do not and stay unseen. ``ParamRecord.known_version`` is the version when the engine last knew the slot to equal
its master; the engine's own bump (a gradient replacing the weight in the slot: ``grads.py``) and a forward's
writes (copied to the master) move it. A version that moved otherwise is not proof of a lost write: while the slot
holds a gradient the parameter points at the fp32 master, so a write there reaches it. So the slot is compared with
the master rounded to the compute dtype, and only a difference raises (after the slot gets the master's value
back, so the weights are those before the write). One rank only: at several ranks a family's master lives on its
owner, and the check is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.disk_tier import DiskTier, disk_loaded
from lightning_pstar.runtime.family import ParamRecord

__all__ = ["OutsideWriteError", "check_outside_writes", "note_versions"]


class OutsideWriteError(RuntimeError):
    """A parameter was written in place outside a forward in mixed precision ([Note: writes outside a forward])."""


def note_versions(records: Sequence[ParamRecord]) -> None:
    """The engine knows the slots of ``records`` to equal their masters now."""
    for record in records:
        record.known_version = record.param._version


def check_outside_writes(
    records: Sequence[ParamRecord], *, disk: DiskTier | None, in_flight: Callable[[int], bool]
) -> None:
    """Raise :class:`OutsideWriteError` if a parameter of ``records`` was written in place outside a forward and the
    write reached only its compute-dtype slot ([Note: writes outside a forward]; mixed precision, one rank: the
    caller's conditions). ``in_flight``: whether a family id's host step is in flight (its parameters are parked
    and its slot is being written: it is checked once its step is done)."""
    moved = [r for r in records if r.param._version != r.known_version and not in_flight(r.family.family_id)]
    if not moved:
        return
    lost = [r for r in moved if _slot_differs(disk, r)]
    if not lost:
        note_versions(moved)
        return
    for record in lost:  # the weights before the write, everywhere
        _slot_from_master(disk, record)
    note_versions(moved)
    names = ", ".join(_named(r) for r in lost[:5]) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
    raise OutsideWriteError(
        f"PatrickStar: parameter(s) {names} were written in place outside a module's forward (for example an EMA"
        " update in `on_train_batch_end`, a `torch.no_grad()` copy into a weight, `load_state_dict` on the module"
        " after setup, or a parent module's forward writing a child's weight). In mixed precision a parameter is a"
        " rounded compute-dtype copy of its fp32 master, which the optimizer steps and checkpoints save; such a"
        " write reaches only the copy and would be lost or rounded. It was undone: the weights are those before"
        " it. HINT: train in precision='32-true' (the"
        " parameter is its fp32 weight there), keep such weights out of the LightningModule's parameters (e.g. an"
        " EMA model held outside it), load weights before `fit` or through `ckpt_path`, and write a weight only"
        " in the forward of the module that owns it."
    )


def _named(record: ParamRecord) -> str:
    first, *tied = record.names
    return f"'{first}'" + (" (tied: " + ", ".join(f"'{n}'" for n in tied) + ")" if tied else "")


def _slot_differs(disk: DiskTier | None, record: ParamRecord) -> bool:
    """Whether the record's param slot differs from its fp32 master rounded to the compute dtype."""
    family = record.family
    master = family.chunks.get(ChunkKind.MASTER)
    if master is None or record.grad_in_param_slot:
        return False  # no master (the slot is the weight), or the parameter points at the master now
    family.param_chunk.wait()  # a copy of its bytes in flight ends first
    with disk_loaded(disk, family, write=False, kinds=(ChunkKind.MASTER,)):
        slot = family.param_chunk.slot_view(record.slot)
        rounded = master.slot_view(record.slot).to(slot.device, slot.dtype)
        differs = (slot != rounded) & ~(slot.isnan() & rounded.isnan())
        return bool(differs.any())


def _slot_from_master(disk: DiskTier | None, record: ParamRecord) -> None:
    family = record.family
    master = family.chunks[ChunkKind.MASTER]
    family.param_chunk.wait()
    with torch.no_grad(), disk_loaded(disk, family, write=False, kinds=(ChunkKind.MASTER,)):
        family.param_chunk.slot_view(record.slot).copy_(master.slot_view(record.slot))
