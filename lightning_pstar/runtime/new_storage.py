"""Parameters that user code gave new storage (``p.data = W``, ``p.set_(W)``, torch's parametrize assignment).

[Note: parameters given new storage]
A parameter is a view of its slot in a chunk; the optimizer steps the slot (or its fp32 master), checkpoints save it
and the next fetch points the parameter at it again. ``p.data = W`` (or ``p.set_(W)``, which
``torch.nn.utils.parametrize`` calls when a parametrized weight is assigned: ``module.weight = W`` through its
``right_inverse``) makes the parameter a view of ``W`` instead. Unseen, the forward would compute with ``W`` while
the step updates the slot's old weight, or a fetch would point the parameter back at its slot and ``W`` would be
lost. In plain PyTorch ``W`` is the weight from then on: the optimizer updates it, keeping its states.

How it is seen: ``ParamRecord.pointed`` is the address the engine last pointed the parameter at
(``Residency.point_at_chunk``, ``point_at_poison``). A parameter whose address differs is checked against its own
slot in each buffer of its param chunk and fp32 master (a pointing the engine did not note); anywhere else, user
code gave it new storage. The check runs where the engine would otherwise lose the assignment: before a module's
forward (``ChunkManager.pre_forward``), at the optimizer step (a family given new storage does not step inside the
backward, where nothing could adopt it first), and before any read of the weights (state dicts, checkpoints). A
parameter parked by a step in flight is checked once its step is done.

What the engine does: at one rank it adopts the value, as plain PyTorch would: ``W`` is written into the slot and
its fp32 master (exactly what a load writes: the master holds ``W`` converted to fp32, the slot its compute-dtype
copy) and the parameter points at its slot again; the optimizer states stay. Where it cannot, it raises
:class:`NewStorageError` naming the parameters, after pointing them back at their slots (the weights are those
before the assignment): several ranks (a family's master lives on its owner rank), a value of another shape or dtype
(plain PyTorch would change the parameter's dtype), a value that plain PyTorch would alias with another parameter
(``a.data = b.data``, one tensor given to two parameters: separate slots cannot be one tensor), and mixed precision
between the backward and the step (the slot holds the gradient then). The engine's own pointing is told apart by
address: the parameter's slot in a buffer of its param chunk or fp32 master, not just any storage of its chunks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.family import ParamRecord

if TYPE_CHECKING:
    from lightning_pstar.runtime.manager import ChunkManager
    from lightning_pstar.runtime.residency import Residency

__all__ = ["NewStorageError", "adopt_new_storage", "keep_new_storage", "moved"]


class NewStorageError(RuntimeError):
    """A parameter was given storage outside its chunk in a way the engine cannot adopt
    ([Note: parameters given new storage])."""


def moved(record: ParamRecord) -> bool:
    """Whether ``record``'s parameter may not be where the engine last pointed it (the quick test, per parameter:
    its address, and whether it is contiguous as the engine's view was: a transposed view of its own slot keeps the
    address)."""
    if record.pointed < 0:
        return False
    param = record.param
    with torch._C.DisableTorchFunctionSubclass():  # the engine's own look: never a wait ([Note: a read that waits])
        return param.data_ptr() != record.pointed or param.is_contiguous() == record.strided


def _users_value(residency: Residency, record: ParamRecord) -> torch.Tensor | None:
    """The tensor user code gave ``record``'s parameter as new storage, or None where the parameter is a view of
    the engine's: its noted address, or its own slot in a buffer of its param chunk or fp32 master (a pointing
    that was not noted), or a NaN view of a released chunk (several ranks)."""
    param = record.param
    if not moved(record):
        return None  # not pointed by the engine yet (setup), or where the engine pointed it
    with torch._C.DisableTorchFunctionSubclass():  # a parked parameter's storage is metadata too
        storage = param.untyped_storage().data_ptr()
        if not storage:
            return None  # a view of a chunk buffer the engine released (an eviction frees the device bytes)
        if storage in residency.shared_ptrs():  # a NaN view of a released chunk (several ranks)
            record.pointed, record.strided = param.data_ptr(), not param.is_contiguous()
            return None
        if param.data_ptr() in _own_slot_addresses(record):
            if param.is_contiguous():
                record.pointed, record.strided = param.data_ptr(), False
                return None
            return param.data.clone()  # a strided view of its own slot (``p.data = p.data.t()``): its values
        return param.data


def _own_slot_addresses(record: ParamRecord) -> set[int]:
    """Where the engine points ``record``'s parameter: its slot's first element in each buffer of its param chunk
    and fp32 master."""
    out = set()
    for kind in (ChunkKind.PARAM, ChunkKind.MASTER):
        chunk = record.family.chunks.get(kind)
        for buf in (chunk.device_buffer, chunk.host_buffer) if chunk is not None else ():
            if buf is not None and buf.untyped_storage().data_ptr():
                out.add(buf.data_ptr() + record.slot.offset * buf.element_size())
    return out


def keep_new_storage(residency: Residency, record: ParamRecord) -> None:
    """The engine is about to point ``record``'s parameter at a buffer: first keep a value user code gave it, for
    :func:`adopt_new_storage` (a fetch or an eviction before the module's forward would otherwise lose it)."""
    if moved(record):
        value = _users_value(residency, record)
        if value is not None:
            residency.kept_values[record.index] = (record, value)


def adopt_new_storage(manager: ChunkManager, records: Sequence[ParamRecord]) -> None:
    """Adopt the values that user code gave parameters of ``records`` as new storage, or raise
    :class:`NewStorageError` naming them (see the note). Records of a family whose step is in flight are skipped
    (checked again once it is done)."""
    kept = manager.residency.kept_values
    found: dict[int, tuple[ParamRecord, torch.Tensor]] = {}
    in_flight = manager.pipeline.in_flight
    for record in records:
        if moved(record) and not in_flight(record.family.family_id):
            value = _users_value(manager.residency, record)
            if value is not None:
                found[record.index] = (record, value)
        elif kept and record.index in kept:
            found[record.index] = kept[record.index]
    if not found:
        return
    for index in found:
        kept.pop(index, None)
    shared = _shared_storages(manager, found.values())
    refused = [(r, why) for r, v in found.values() if (why := _why_not(manager, r, v, shared))]
    if refused:
        for record, _ in refused:  # the weights before the assignment, everywhere
            record.pointed = -1  # the user's storage is let go, not kept again
            manager.residency.point_at_chunk(record)
        shown = "; ".join(f"'{r.names[0]}': {why}" for r, why in refused[:5])
        more = f" and {len(refused) - 5} more" if len(refused) > 5 else ""
        raise NewStorageError(
            f"PatrickStar: parameter(s) were given new storage by user code (`p.data = W`, `p.set_(W)`, or a"
            f" parametrized weight assigned through its right_inverse) in a way the engine cannot take: {shown}{more}."
            " The parameter points at its chunk slot again: the weights are those before the assignment. HINT: give"
            " a weight a new value before `fit` (or through `ckpt_path`), at one rank, with the parameter's shape,"
            " and not between the backward and the optimizer step in mixed precision."
        )
    with torch.no_grad():
        for record, value in found.values():
            manager.fill_slot(record, value.detach().reshape(record.slot.shape))
            record.pointed = -1  # the user's storage is let go, not kept again
            manager.residency.point_at_chunk(record)


def _shared_storages(manager: ChunkManager, found: Iterable[tuple[ParamRecord, torch.Tensor]]) -> dict[int, str]:
    """Storages (by address) a given value shares with something plain PyTorch would alias it with: a chunk of the
    engine (another parameter's slot: ``a.data = b.data``), or another parameter's value (one tensor given to two
    parameters, now or before). Both make two parameters one tensor, which separate slots cannot be."""
    out: dict[int, str] = {}
    found = list(found)
    with torch._C.DisableTorchFunctionSubclass():
        values = {r.index: v.untyped_storage().data_ptr() for r, v in found}
        held: dict[int, list[str]] = {}  # storage -> names of the parameters on it now (or kept for adoption)
        for record in manager.records:
            storage = values.get(record.index, record.param.untyped_storage().data_ptr())
            held.setdefault(storage, []).append(record.names[0])
        for record, value in manager.residency.kept_values.values():
            if record.index not in values:
                held.setdefault(value.untyped_storage().data_ptr(), []).append(record.names[0])
    engine = manager.residency.storage_ptrs([c for f in manager.families for c in f.chunks.values()])
    for record, _ in found:
        storage = values[record.index]
        others = [n for n in held.get(storage, []) if n != record.names[0]]
        if storage in engine:
            out[storage] = "the storage of another parameter's chunk (the two would be one tensor)"
        elif others:
            out[storage] = f"the same tensor as '{others[0]}' (the two would be one tensor)"
    return out


def _why_not(manager: ChunkManager, record: ParamRecord, value: torch.Tensor, shared: dict[int, str]) -> str:
    """Why the engine cannot adopt ``value`` as ``record``'s weight ("" where it can)."""
    if manager.sharding.distributed:
        return "several ranks (its fp32 master lives on one rank)"
    if tuple(value.shape) != tuple(record.slot.shape):
        return f"shape {tuple(value.shape)}, its slot holds {tuple(record.slot.shape)}"
    if value.dtype != record.orig_dtype:
        return f"dtype {value.dtype}, the parameter is {record.orig_dtype} (plain PyTorch would change its dtype)"
    with torch._C.DisableTorchFunctionSubclass():
        why = shared.get(value.untyped_storage().data_ptr(), "")
    if why:
        return why
    if record.grad_in_param_slot:
        return "assigned between the backward and the optimizer step in mixed precision (its slot holds the gradient)"
    return ""
