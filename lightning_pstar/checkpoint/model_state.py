"""State dicts of the chunk engine: consolidated, sharded and the hand-back of an ordinary module.

Kept apart from ``chunk_manager.py`` (which owns placement and the iteration) as a mixin of
:class:`~lightning_pstar.runtime.manager.ChunkManager`: with several ranks each family's values come from its
owner, streamed to rank 0 for checkpoints or broadcast when every rank needs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from lightning_pstar.runtime.chunk import ChunkKind

if TYPE_CHECKING:
    from torch import nn

    from lightning_pstar.runtime.manager import ChunkFamily, ParamRecord
    from lightning_pstar.runtime.comm import ChunkComm
    from lightning_pstar.runtime.sharding import GroupCoordinator

__all__ = ["StateDictsMixin"]


class StateDictsMixin:
    """Reading and writing the model's values in the chunks, family by family."""

    # provided by ChunkManager
    module: nn.Module
    families: list[ChunkFamily]
    records: list[ParamRecord]
    groups: GroupCoordinator | None
    comm: ChunkComm
    device: torch.device
    rank: int
    world_size: int
    host_params: dict[str, nn.Parameter]
    _by_id: dict[int, ParamRecord]

    def owns(self, family: ChunkFamily) -> bool:
        raise NotImplementedError

    def _fill_slot(self, record: ParamRecord, value: torch.Tensor) -> None:
        raise NotImplementedError

    def set_slot_holds_grad(self, record: ParamRecord, holds: bool) -> None:
        raise NotImplementedError

    # ---- state dicts ----------------------------------------------------------------------------------
    def master_view(self, record: ParamRecord) -> torch.Tensor:
        """The fp32 truth of a parameter on whatever tier it lives (the param slot in 32-true, frozen too)."""
        family = record.family
        chunk = family.chunks.get(ChunkKind.MASTER, family.param_chunk)
        if chunk is family.param_chunk and record.slot_holds_grad:
            raise RuntimeError(f"the slot of '{record.slot.name}' holds a gradient; no weight to read now")
        return chunk.slot_view(record.slot)

    def family_values(self, family: ChunkFamily, *, rank0_only: bool = False) -> torch.Tensor:
        """The fp32 truth of a whole family (1-D, capacity), from its owner on every rank, or only on rank 0
        with ``rank0_only`` (a collective when there are several ranks; on one rank a view of the chunk)."""
        chunk = family.chunks.get(ChunkKind.MASTER) if self.owns(family) else None
        if chunk is None and self.owns(family):
            chunk = family.param_chunk
        if self.groups is None:
            assert chunk is not None
            return chunk.data if chunk.dtype == torch.float32 else chunk.data.float()
        out = torch.empty(family.capacity, dtype=torch.float32, device=self.device)
        if chunk is not None:
            out.copy_(chunk.data)
        owner = family.family_id % self.world_size
        if rank0_only:
            return self.comm.to_rank0_(out, src=owner)
        return self.comm.broadcast_(out, src=owner)

    def _all_values(self, *, rank0_only: bool = False, to_cpu: bool = False) -> dict[int, torch.Tensor]:
        """Record index -> fp32 value of every parameter, family by family (see :meth:`family_values`).

        With ``rank0_only`` other ranks get an empty dict, and rank 0 holds one model copy plus one chunk.
        """
        values: dict[int, torch.Tensor] = {}
        for family in self.families:
            if not family.records:
                continue
            if self.groups is None:
                for record in family.records:
                    self.master_view(record)  # raises if a slot holds a gradient instead of a weight
            flat = self.family_values(family, rank0_only=rank0_only)
            if rank0_only and self.rank != 0:
                continue
            for record in family.records:
                value = flat[record.slot.offset : record.slot.offset + record.slot.numel].view(record.slot.shape)
                values[record.index] = value.to("cpu", copy=True) if to_cpu else value
        return values

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's ``state_dict`` with fp32 CPU copies of every parameter under each of its names.

        With ``rank0_only`` (what checkpoints use) the weights stream family by family to rank 0 and the
        other ranks return an empty dict.
        """
        with torch.no_grad():
            by_index = self._all_values(rank0_only=rank0_only, to_cpu=True)
            if rank0_only and self.rank != 0:
                return {}
            values = {id(r.param): by_index[r.index] for r in self.records}
            out: dict[str, torch.Tensor] = {}
            for key, tensor in self.module.state_dict(keep_vars=True).items():
                if id(tensor) in values:
                    record = self._by_id[id(tensor)]
                    value = values[id(tensor)]
                    out[key] = value if record.orig_dtype == value.dtype else value.to(record.orig_dtype)
                else:
                    out[key] = tensor.detach().to("cpu", copy=True)
        return out

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load an ordinary ``state_dict`` into the chunks (masters and compute copies) and the buffers."""
        expected = list(self.module.state_dict(keep_vars=True).keys())
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in set(expected)]
        param_names = {n for r in self.records for n in r.names}
        values: list[tuple[ParamRecord, torch.Tensor]] = []
        for record in self.records:
            key = next((n for n in record.names if n in state_dict), None)
            if key is None:
                continue
            value = state_dict[key]
            if tuple(value.shape) != tuple(record.slot.shape):
                raise ValueError(
                    f"state_dict['{key}'] has shape {tuple(value.shape)}, the model's parameter has"
                    f" {tuple(record.slot.shape)}. HINT: the checkpoint belongs to another model configuration."
                )
            values.append((record, value))
        # buffers and host-resident parameters (cpu_embedding) are loaded as they are
        buffers: dict[str, torch.Tensor] = {**dict(self.module.named_buffers()), **self.host_params}
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
        with torch.no_grad():
            for record, value in values:
                if self.owns(record.family):
                    self._fill_slot(record, value)
                self.set_slot_holds_grad(record, False)  # the slot holds the loaded weight
            for key, value in state_dict.items():
                if key in buffers and key not in param_names:
                    buffers[key].copy_(value)

    # ---- sharded checkpoints ---------------------------------------------------------------------------
    def _local_values(self, family: ChunkFamily) -> torch.Tensor:
        """fp32 CPU copy of a family this rank owns, read locally (no communication)."""
        chunk = family.chunks.get(ChunkKind.MASTER, family.param_chunk)
        return chunk.data.detach().to("cpu", torch.float32, copy=True)

    def owned_tensors(self) -> dict[str, torch.Tensor]:
        """``model/<name>`` -> fp32 CPU value of every parameter this rank owns (a sharded save)."""
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for family in self.families:
                if not family.records or not self.owns(family):
                    continue
                flat = self._local_values(family)
                for record in family.records:
                    sl = flat[record.slot.offset : record.slot.offset + record.slot.numel]
                    out[f"model/{record.names[0]}"] = sl.view(record.slot.shape).clone()
        return out

    def sharded_info(self) -> dict[str, Any]:
        """What a sharded checkpoint needs to rebuild an ordinary state_dict (names, aliases, dtypes)."""
        keys = list(self.module.state_dict(keep_vars=True).keys())
        canonical = {name: r.names[0] for r in self.records for name in r.names}
        dtypes = {name: str(r.orig_dtype).replace("torch.", "") for r in self.records for name in r.names}
        return {"state_dict_keys": keys, "canonical": canonical, "dtypes": dtypes}

    def load_owned_tensors(self, stored: Mapping[str, torch.Size], read: Any, buffers: Mapping[str, Any]) -> None:
        """Load a sharded checkpoint's weights: check names and shapes first, then read what this rank owns."""
        expected = {f"model/{r.names[0]}": r for r in self.records}
        stored_model = {k for k in stored if k.startswith("model/")}
        missing = sorted(k[len("model/") :] for k in set(expected) - stored_model)
        unexpected = sorted(k[len("model/") :] for k in stored_model - set(expected))
        if missing or unexpected:
            raise KeyError(
                f"the sharded checkpoint does not match the model: missing keys {missing}, unexpected keys"
                f" {unexpected}. HINT: use a checkpoint of this model."
            )
        for key, record in expected.items():
            if tuple(stored[key]) != tuple(record.slot.shape):
                raise ValueError(
                    f"the sharded checkpoint stores '{key[len('model/') :]}' with shape {tuple(stored[key])}, the"
                    f" model has {tuple(record.slot.shape)}. HINT: the checkpoint belongs to another model."
                )
        wanted = {k: stored[k] for k, r in expected.items() if self.owns(r.family)}
        values = read(wanted)
        with torch.no_grad():
            for key, value in values.items():
                record = expected[key]
                self._fill_slot(record, value)
                self.set_slot_holds_grad(record, False)  # the slot holds the loaded weight
            named = dict(self.module.named_buffers())
            for key, value in buffers.items():
                if key in named:
                    named[key].copy_(value)

    # ---- teardown -------------------------------------------------------------------------------------
    def restore_module(self, device: torch.device) -> None:
        """Give every parameter an ordinary tensor of its original dtype on ``device`` and free the chunks."""
        with torch.no_grad():
            values = self._all_values()
            for record in self.records:
                value = values[record.index].detach().to(device=device, dtype=record.orig_dtype, copy=True)
                record.param.data = value
        for family in self.families:
            for chunk in family.chunks.values():
                chunk.release()
