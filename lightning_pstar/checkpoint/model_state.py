"""Model state of the chunk engine: consolidated and sharded state dicts, and the hand-back of a module.

Plain functions over a :class:`~lightning_pstar.runtime.manager.ChunkManager`'s parameter table (its
families and records): the manager owns placement and the iteration, this module only reads and writes
the values in the chunks. With several ranks each family's values come from its owner, streamed to rank 0
for checkpoints or broadcast when every rank needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from lightning_pstar.checkpoint.placeholders import is_placeholder, store_key_of
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.disk_tier import disk_loaded
from lightning_pstar.runtime.family import ParamRecord
from lightning_pstar.runtime.new_storage import adopt_new_storage
from lightning_pstar.runtime.outside_writes import check_outside_writes
from lightning_pstar.runtime.pinned import host_arena
from lightning_pstar.runtime.state import Tier

if TYPE_CHECKING:
    from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
    from lightning_pstar.runtime.manager import ChunkManager

__all__ = [
    "drop_weights",
    "family_values",
    "full_state_dict",
    "load_full_state_dict",
    "load_owned_tensors",
    "master_view",
    "owned_tensors",
    "restore_family",
    "restore_module",
    "sharded_info",
]

ReadTensors = Callable[[dict[str, torch.Size]], Mapping[str, torch.Tensor]]
"""Reads the named tensors (key -> shape) from a store, e.g. ``sharded.read_sharded_tensors`` of one path."""


# ---- values -------------------------------------------------------------------------------------------------
def master_view(record: ParamRecord) -> torch.Tensor:
    """The fp32 truth of a parameter on whatever tier it lives (the param slot in 32-true, frozen too)."""
    family = record.family
    chunk = family.chunks.get(ChunkKind.MASTER, family.param_chunk)
    if chunk is family.param_chunk and record.grad_in_param_slot:
        raise RuntimeError(f"the slot of '{record.slot.name}' holds a gradient; no weight to read now")
    return chunk.slot_view(record.slot)


def _check_weight(record: ParamRecord) -> None:
    """Raise if the record's fp32 truth is its param slot and that slot holds a gradient instead of a weight."""
    family = record.family
    if ChunkKind.MASTER not in family.chunks:
        master_view(record)


def family_values(manager: ChunkManager, family: ChunkFamily, *, rank0_only: bool = False) -> torch.Tensor:
    """The fp32 truth of a whole family (1-D, capacity), from its owner on every rank, or only on rank 0
    with ``rank0_only`` (a collective when there are several ranks; on one rank a view of the chunk)."""
    manager.finish_steps()  # a step in flight ends first ([Note: the step pipeline] in runtime/pipeline.py)
    adopt_new_storage(manager, family.records)  # [Note: parameters given new storage]
    if manager.mixed and not manager.sharding.distributed:  # a write the masters lack is refused, not dropped
        check_outside_writes(family.records, disk=manager.disk, in_flight=manager.pipeline.in_flight)
    owns = manager.owns(family)
    chunk = family.chunks.get(ChunkKind.MASTER) if owns else None
    if chunk is None and owns:
        chunk = family.param_chunk
    local: torch.Tensor | None = None
    if chunk is not None and chunk.tier is Tier.DISK:  # a copy, read while the family is loaded
        with disk_loaded(manager.disk, family, write=False, kinds=(ChunkKind.MASTER,)):
            local = chunk.data.clone()
    elif chunk is not None:
        local = chunk.data
    if not manager.sharding.distributed:
        assert local is not None
        return local if local.dtype == torch.float32 else local.float()
    out = torch.empty(family.capacity, dtype=torch.float32, device=manager.device)
    if local is not None:
        out.copy_(local)
    owner = family.family_id % manager.world_size
    if rank0_only:
        return manager.comm.to_rank0_(out, src=owner)
    return manager.comm.broadcast_(out, src=owner)


def _all_values(manager: ChunkManager, *, rank0_only: bool = False, to_cpu: bool = False) -> dict[int, torch.Tensor]:
    """Record index -> fp32 value of every parameter, family by family (see :func:`family_values`).

    With ``rank0_only`` other ranks get an empty dict, and rank 0 holds one model copy plus one chunk.
    """
    values: dict[int, torch.Tensor] = {}
    for family in manager.families:
        if not family.records:
            continue
        if not manager.sharding.distributed:
            for record in family.records:
                _check_weight(record)
        flat = family_values(manager, family, rank0_only=rank0_only)
        if rank0_only and manager.rank != 0:
            continue
        for record in family.records:
            value = flat[record.slot.offset : record.slot.offset + record.slot.numel].view(record.slot.shape)
            values[record.index] = value.to("cpu", copy=True) if to_cpu else value
    return values


# ---- consolidated state dicts -------------------------------------------------------------------------------
def _refuse_torn(manager: ChunkManager) -> None:
    """Raise if a backward raised after some families had stepped inside it ([Note: stepping inside the backward]
    in optim/overlap.py): the weights and optimizer states are a mix of two steps, and a saved copy would be too."""
    if manager.torn:
        names = [manager.families[f].records[0].names[0] for f in manager.torn[:3]]
        raise RuntimeError(
            f"PatrickStar cannot save the weights: a backward raised after {len(manager.torn)} families (parameters"
            f" such as {names}) had already stepped inside it (optimizer_overlap), so the weights and optimizer"
            " states are a mix of two steps. HINT: resume from a checkpoint saved before the failure; set"
            " optimizer_overlap='off' to keep a consistent state when a backward may raise."
        )


def full_state_dict(manager: ChunkManager, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` with fp32 CPU copies of every parameter under each of its names.

    With ``rank0_only`` (what checkpoints use) the weights stream family by family to rank 0 and the
    other ranks return an empty dict.
    """
    _refuse_torn(manager)
    manager.finish_steps()  # a step in flight ends first ([Note: the step pipeline] in runtime/pipeline.py)
    with torch.no_grad():
        by_index = _all_values(manager, rank0_only=rank0_only, to_cpu=True)
        if rank0_only and manager.rank != 0:
            return {}
        records = {id(r.param): r for r in manager.records}
        out: dict[str, torch.Tensor] = {}
        for key, tensor in manager.module.state_dict(keep_vars=True).items():
            record = records.get(id(tensor))
            if record is not None:
                value = by_index[record.index]
                out[key] = value if record.orig_dtype == value.dtype else value.to(record.orig_dtype)
            else:
                out[key] = tensor.detach().to("cpu", copy=True)
    return out


def load_full_state_dict(
    manager: ChunkManager,
    state_dict: Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    checked: Callable[[], None] = lambda: None,
) -> None:
    """Load an ordinary ``state_dict`` into the chunks (masters and compute copies) and the buffers.

    ``checked`` runs once the names and shapes are validated, before anything is written (the caller's checks
    that should come after the model's own, such as the optimizer's param groups)."""
    expected = list(manager.module.state_dict(keep_vars=True).keys())
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in set(expected)]
    param_names = {n for r in manager.records for n in r.names}
    values: list[tuple[ParamRecord, torch.Tensor]] = []
    for record in manager.records:
        keys = [n for n in record.names if n in state_dict]  # a tied weight's names, in the module's order
        if not keys:
            continue
        for key in keys:
            if tuple(state_dict[key].shape) != tuple(record.slot.shape):
                raise ValueError(
                    f"state_dict['{key}'] has shape {tuple(state_dict[key].shape)}, the model's parameter has"
                    f" {tuple(record.slot.shape)}. HINT: the checkpoint belongs to another model configuration."
                )
        # torch's load_state_dict copies each name into the one parameter in module order: the last one stays
        values.append((record, state_dict[keys[-1]]))
    # buffers and host-resident parameters (cpu_embedding) are loaded as they are
    buffers: dict[str, torch.Tensor] = {**dict(manager.module.named_buffers()), **manager.host_params}
    for key, value in state_dict.items():
        if key in buffers and key not in param_names and tuple(value.shape) != tuple(buffers[key].shape):
            raise ValueError(
                f"state_dict['{key}'] has shape {tuple(value.shape)}, the model's tensor has"
                f" {tuple(buffers[key].shape)}. HINT: the checkpoint belongs to another model configuration."
            )
    if strict:
        # a tied parameter may be stored under only one of its names
        tied_ok = {n for r, _ in values for n in r.names}
        missing = [k for k in missing if k not in tied_ok]
        if missing or unexpected:
            raise KeyError(
                f"state_dict does not match the model: missing keys {missing}, unexpected keys {unexpected}."
                " HINT: load with strict=False to ignore them, or use a checkpoint of this model."
            )
    checked()
    with torch.no_grad():
        for record, value in values:
            if manager.owns(record.family):
                manager.fill_slot(record, value)
            manager.slot_holds_weight(record)  # the slot holds the loaded weight
        if manager.disk is not None:  # the last family's master written back to the disk tier
            manager.disk.flush_setup()
        for key, value in state_dict.items():
            if key in buffers and key not in param_names:
                buffers[key].copy_(value)


# ---- sharded checkpoints ------------------------------------------------------------------------------------
def _local_values(manager: ChunkManager, family: ChunkFamily) -> torch.Tensor:
    """fp32 CPU copy of a family this rank owns, read locally (no communication)."""
    chunk = family.chunks.get(ChunkKind.MASTER, family.param_chunk)
    with disk_loaded(manager.disk, family, write=False, kinds=(ChunkKind.MASTER,)):
        return chunk.data.detach().to("cpu", torch.float32, copy=True)


def owned_tensors(manager: ChunkManager) -> dict[str, torch.Tensor]:
    """``model/<name>`` -> fp32 CPU value of every parameter this rank owns (a sharded save)."""
    _refuse_torn(manager)
    manager.finish_steps()  # a step in flight ends first ([Note: the step pipeline] in runtime/pipeline.py)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for family in manager.families:
            if not family.records or not manager.owns(family):
                continue
            flat = _local_values(manager, family)
            for record in family.records:
                sl = flat[record.slot.offset : record.slot.offset + record.slot.numel]
                out[f"model/{record.names[0]}"] = sl.view(record.slot.shape).clone()
        if manager.comm.rank == 0:  # host-resident embeddings (cpu_embedding): the same on every rank
            for name, param in manager.host_params.items():
                out[f"model/{name}"] = param.detach().float().clone()
    return out


def sharded_info(manager: ChunkManager) -> dict[str, Any]:
    """What a sharded checkpoint needs to rebuild an ordinary state_dict (names, aliases, dtypes)."""
    keys = list(manager.module.state_dict(keep_vars=True).keys())
    canonical = {name: r.names[0] for r in manager.records for name in r.names}
    dtypes = {name: str(r.orig_dtype).replace("torch.", "") for r in manager.records for name in r.names}
    for name, param in manager.host_params.items():  # cpu_embedding: outside the chunks, saved under their name
        canonical[name] = name
        dtypes[name] = str(param.dtype).replace("torch.", "")
    return {"state_dict_keys": keys, "canonical": canonical, "dtypes": dtypes}


def load_owned_tensors(
    manager: ChunkManager,
    stored: Mapping[str, torch.Size],
    read: ReadTensors,
    entries: Mapping[str, Any],
    *,
    strict: bool = True,
    checked: Callable[[], None] = lambda: None,
) -> None:
    """Load a sharded checkpoint's weights: check names and shapes first (then ``checked``, as in
    :func:`load_full_state_dict`), then read what this rank owns. ``entries``: the checkpoint dict's
    ``state_dict`` (its buffers; with stand-ins for the weights where the Trainer's hooks could edit it, [Note:
    weights in a sharded checkpoint dict] in placeholders.py: then it says where each weight comes from)."""
    targets: dict[str, ParamRecord | torch.Tensor] = {f"model/{r.names[0]}": r for r in manager.records}
    names = {f"model/{r.names[0]}": r.names for r in manager.records}
    for name, param in manager.host_params.items():  # cpu_embedding
        targets[f"model/{name}"], names[f"model/{name}"] = param, [name]
    sources = _sources(stored, entries, names, strict=strict)
    for key, source in sources.items():
        shape = tuple(stored[source]) if isinstance(source, str) else tuple(source.shape)
        target = targets[key]
        want = tuple(target.slot.shape) if isinstance(target, ParamRecord) else tuple(target.shape)
        if shape != want:
            raise ValueError(
                f"the sharded checkpoint stores '{key[len('model/') :]}' with shape {shape}, the model has {want}."
                " HINT: the checkpoint belongs to another model."
            )
    checked()
    owned = {
        k: s for k, s in sources.items()
        if not isinstance(targets[k], ParamRecord) or manager.owns(targets[k].family)  # type: ignore[union-attr]
    }  # fmt: skip
    from_store = read({s: stored[s] for s in owned.values() if isinstance(s, str)})
    with torch.no_grad():
        for key, source in owned.items():
            value = from_store[source] if isinstance(source, str) else source.detach().to("cpu", torch.float32)
            target = targets[key]
            if not isinstance(target, ParamRecord):
                target.copy_(value)  # every rank holds the host embeddings
                continue
            manager.fill_slot(target, value)
            manager.slot_holds_weight(target)  # the slot holds the loaded weight
        if manager.disk is not None:  # the last family's master written back to the disk tier
            manager.disk.flush_setup()
        named = dict(manager.module.named_buffers())
        for key, value in entries.items():
            if key in named and not is_placeholder(value):
                named[key].copy_(value)


def _sources(
    stored: Mapping[str, torch.Size], entries: Mapping[str, Any], names: Mapping[str, list[str]], *, strict: bool
) -> dict[str, str | torch.Tensor]:
    """Where each weight (``model/<canonical name>`` -> its names) comes from: a store key, or a tensor a hook put
    in ``entries``. Without stand-ins in ``entries`` (Fabric, or no hook could edit it) every weight comes from the
    store under its own key. Missing or unexpected weights raise where ``strict`` (missing ones are left as the
    module has them otherwise)."""
    sources: dict[str, str | torch.Tensor] = {}
    if not any(is_placeholder(v) for v in entries.values()):
        stored_model = {k for k in stored if k.startswith("model/")}
        missing = sorted(k[len("model/") :] for k in set(names) - stored_model)
        unexpected = sorted(k[len("model/") :] for k in stored_model - set(names))
        if missing or unexpected:
            raise KeyError(
                f"the sharded checkpoint does not match the model: missing keys {missing}, unexpected keys"
                f" {unexpected}. HINT: use a checkpoint of this model."
            )
        return {k: k for k in names}
    missing, known = [], {n for aliases in names.values() for n in aliases}
    for key, aliases in names.items():
        found = [entries[n] for n in aliases if n in entries]
        if not found:
            missing.append(aliases[0])
            continue
        value = next((v for v in reversed(found) if not is_placeholder(v)), found[-1])  # a hook's tensor first
        sources[key] = store_key_of(value) if is_placeholder(value) else value
    unexpected = sorted(k for k, v in entries.items() if is_placeholder(v) and k not in known)
    if strict and (missing or unexpected):
        raise KeyError(
            f"the checkpoint's state_dict does not match the model: missing keys {sorted(missing)}, unexpected keys"
            f" {unexpected}. HINT: use a checkpoint of this model, or strict=False (`strict_loading = False` on the"
            " LightningModule) to keep the module's own weights where the file has none."
        )
    return sources


# ---- teardown -----------------------------------------------------------------------------------------------
def restore_module(manager: ChunkManager, device: torch.device) -> None:
    """Give every parameter an ordinary tensor of its original dtype on ``device`` and free the chunks.

    Family by family (a collective per family when there are several ranks, in the same order on every rank):
    a family's weights are copied out and its chunks freed before the next family is read, so the host never
    holds the chunks and a full copy of the model at once (issue 12: at most one family's copy beside the
    chunks still held). The pinned blocks a family's chunks leave are given back with it (issue 29), so the
    host never holds the pinned chunks of the whole model beside the copies either.
    """
    manager.finish_steps()  # a step in flight ends first ([Note: the step pipeline] in runtime/pipeline.py)
    for family in manager.families:
        restore_family(manager, family, device)


def restore_family(manager: ChunkManager, family: ChunkFamily, device: torch.device) -> None:
    """:func:`restore_module` for one family: its parameters get ordinary tensors, its chunks are freed and the
    pinned blocks they leave idle go back to the driver (on every rank, in the families' order)."""
    with torch.no_grad():
        if family.records:
            flat = _family_for_restore(manager, family)
            for record in family.records:
                value = flat[record.slot.offset : record.slot.offset + record.slot.numel]
                value = value.view(record.slot.shape).to(device=device, dtype=record.orig_dtype, copy=True)
                record.param.data = value
            del flat
        _free_family(family)


def drop_weights(manager: ChunkManager) -> None:
    """The end of a run that does not hand the weights back (``hand_back_weights=False``: they left through a
    checkpoint): every parameter becomes an empty tensor of its original dtype on the host (no bytes, and any
    use fails loudly on its shape rather than reading freed chunk memory) and every family's chunks are freed,
    family by family with their pinned blocks. Nothing is communicated."""
    for family in manager.families:
        for record in family.records:
            record.param.data = torch.empty(0, dtype=record.orig_dtype)
        _free_family(family)


def _free_family(family: ChunkFamily) -> None:
    for chunk in family.chunks.values():
        chunk.let_go()  # a view of a weight that user code kept past the run keeps its bytes
    host_arena().release()  # the idle blocks this family left, now: not the whole pinned cache at the end


def _family_for_restore(manager: ChunkManager, family: ChunkFamily) -> torch.Tensor:
    """The fp32 truth of ``family`` for the hand-back, checking on one rank that no slot holds a gradient."""
    if not manager.sharding.distributed:
        for record in family.records:
            _check_weight(record)
    return family_values(manager, family)
