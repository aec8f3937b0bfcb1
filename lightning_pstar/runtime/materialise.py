"""Materialisation: allocate the chunks, copy or initialise every parameter into its slot, re-point the model.

Runs once, after :class:`~lightning_pstar.runtime.manager.ChunkManager` has planned (so bad input failed
before anything changed). Parameters built on the meta device are initialised module by module with the
module's own ``reset_parameters()`` and copied into their slots; tied parameters keep the initialisation of
the last module that owns them.

Setup never holds the full fp32 model on the device: a meta parameter's fp32 temporary lives only while
the modules that own it are initialised, and is dropped (the parameter re-pointed at its slot) right after
the last of them has been copied into the chunks. At any moment the device holds the chunks the budget
allows plus the temporaries of one module (and of tied parameters whose last owner is still to come); the
temporaries count against the device budget like chunks (chunks are evicted to make room for them), and
:attr:`Materialiser.peak_device_bytes` measures the sum. A parameter re-pointed early may later point at a
chunk storage that an eviction emptied; the final re-pointing puts every parameter on its chunk's tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from lightning_pstar.planning.requirements import MemoryBudgetError
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.family import ChunkFamily, ParamRecord, ParamTable
from lightning_pstar.runtime.residency import Residency
from lightning_pstar.runtime.sharding_factory import Sharding
from lightning_pstar.runtime.state import TensorState, Tier

__all__ = ["Materialiser", "meta_modules"]

log = logging.getLogger(__name__)


def meta_modules(module: nn.Module, table: ParamTable) -> tuple[list[nn.Module], list[nn.Module]]:
    """Modules with meta parameters, and modules with meta buffers; each must have ``reset_parameters``."""
    with_params = [m for m in module.modules() if any(r.param.is_meta for r in table.direct_records(m))]
    with_buffers = [m for m in module.modules() if any(b is not None and b.is_meta for b in m._buffers.values())]
    for mod in [*with_params, *(m for m in with_buffers if m not in with_params)]:
        if not hasattr(mod, "reset_parameters"):
            name = next(n for n, m in module.named_modules() if m is mod)
            raise ValueError(
                f"Module '{name or '<root>'}' ({type(mod).__name__}) was built on the meta device but has no"
                " `reset_parameters()` to initialise its parameters and buffers. HINT: define"
                " reset_parameters() on it or build the model in `__init__` instead of `configure_model`."
            )
    return with_params, with_buffers


class Materialiser:
    """Puts one model's parameters into its chunks."""

    def __init__(
        self,
        module: nn.Module,
        table: ParamTable,
        *,
        residency: Residency,
        sharding: Sharding,
        compute_dtype: torch.dtype,
        frozen_master: bool,
        on_write: Callable[[], None],
    ) -> None:
        self.module = module
        self.table = table
        self.residency = residency
        self.sharding = sharding
        self.compute_dtype = compute_dtype
        self.mixed = compute_dtype != torch.float32
        self.frozen_master = frozen_master
        self.on_write = on_write  # weights changed (the manager's version counter)
        self.device = residency.device
        self._temporaries: dict[int, int] = {}  # record index -> bytes of its fp32 temporary on the device
        self.peak_device_bytes = 0  # chunks on the device plus live temporaries, at their highest during setup

    def run(self, host_params: dict[str, nn.Parameter], layout: tuple[int, int, int, int], detail: str) -> None:
        with_params, with_buffers = meta_modules(self.module, self.table)
        for param in host_params.values():
            if param.device.type != "cpu" or param.dtype != torch.float32:
                param.data = param.data.to("cpu", torch.float32)
        self.sharding.start(self.table.records, layout, detail)
        for family in self.table.families:
            if self.sharding.owns(family):
                self._allocate_family(family)
            else:
                self.residency.new_chunk(family, ChunkKind.PARAM, self.compute_dtype)  # gathered on access
        # real parameters: copy their values; meta ones: initialise module by module, in module order
        for record in self.table.records:
            if not record.param.is_meta and self.sharding.owns(record.family):
                self.fill_slot(record, record.param.detach())
        from_meta = {r.index for r in self.table.records if r.param.is_meta}
        last_owner = {r.index: i for i, mod in enumerate(with_params) for r in self.table.direct_records(mod)}
        for i, mod in enumerate(with_params):
            self._materialise_meta_module(mod, from_meta)
            self._drop_temporaries([r for r in self.table.direct_records(mod) if last_owner.get(r.index) == i])
        for mod in with_buffers:
            self._materialise_buffers(mod)
            if mod not in with_params:
                with torch.no_grad():
                    mod.reset_parameters()  # type: ignore[operator]
        self._note_device_bytes()
        for record in self.table.records:
            self._point(record)
            record.set_state(TensorState.HOLD)
        self._temporaries.clear()
        self.residency.repoint = True
        self.residency.setup_peak_device_bytes = self.peak_device_bytes

    def _point(self, record: ParamRecord) -> None:
        if self.sharding.owns(record.family):
            self.residency.point_at_chunk(record)
        else:
            self.sharding.point_at_poison(record)

    def _drop_temporaries(self, records: list[ParamRecord]) -> None:
        """Re-point parameters whose every owner has been initialised: their fp32 temporaries are freed."""
        for record in records:
            if self._temporaries.pop(record.index, None) is not None:
                self._point(record)

    def _note_device_bytes(self) -> None:
        live = self.residency.device_used() + sum(self._temporaries.values())
        self.peak_device_bytes = max(self.peak_device_bytes, live)

    def fill_slot(self, record: ParamRecord, value: torch.Tensor) -> None:
        """Write ``value`` into the record's param slot (and its fp32 master)."""
        family = record.family
        self.on_write()
        with torch.no_grad():
            family.param_chunk.slot_view(record.slot).copy_(value)
            if ChunkKind.MASTER in family.chunks:
                master = family.chunks[ChunkKind.MASTER]
                if master.tier is Tier.DISK and self.residency.disk is not None:
                    self.residency.disk.hold_for_setup(family)  # read and written once per family
                master.slot_view(record.slot).copy_(value)

    def _allocate_family(self, family: ChunkFamily) -> None:
        residency = self.residency
        param_chunk = residency.new_chunk(family, ChunkKind.PARAM, self.compute_dtype)
        residency.ensure_device_room(param_chunk.nbytes, protect={family.family_id})
        param_chunk.allocate(Tier.DEVICE)
        if family.trainable and self.mixed:
            residency.allocate_optimizer_side(residency.new_chunk(family, ChunkKind.MASTER, torch.float32))
        elif self.mixed and self.frozen_master:
            # the exact fp32 weights of frozen parameters, read only by state dicts: they live on the host
            residency.allocate_on_host(residency.new_chunk(family, ChunkKind.MASTER, torch.float32))

    def _materialise_buffers(self, mod: nn.Module) -> None:
        for name, buf in mod._buffers.items():
            if buf is not None and buf.is_meta:
                mod._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype, device=self.device)

    def _make_room_for(self, params: list[nn.Parameter]) -> None:
        """Evict param chunks (as the budget's policy would) so that the temporaries about to be created, and
        those still held, fit beside the chunks. Best effort: a module whose fp32 weights alone exceed the
        room is still initialised (its peak is then measured, not refused)."""
        new = sum(p.numel() * self.table.by_id[id(p)].orig_dtype.itemsize for p in params)
        if not new:
            return
        try:
            self.residency.ensure_device_room(new + sum(self._temporaries.values()), protect=set())
        except MemoryBudgetError:
            log.debug("materialising %s: its fp32 temporaries do not fit beside the chunks", type(self.module))

    def _materialise_meta_module(self, mod: nn.Module, from_meta: set[int]) -> None:
        self._materialise_buffers(mod)
        self._make_room_for([p for p in mod._parameters.values() if p is not None and p.is_meta])
        for param in list(mod._parameters.values()):
            if param is None or not param.is_meta:
                continue
            record = self.table.by_id[id(param)]
            value = torch.empty(param.shape, dtype=record.orig_dtype, device=self.device)
            self._temporaries[record.index] = value.numel() * value.element_size()
            self.table.replace_parameter(self.module, record, nn.Parameter(value, requires_grad=param.requires_grad))
        self._note_device_bytes()
        with torch.no_grad():
            mod.reset_parameters()  # type: ignore[operator]
        for record in self.table.direct_records(mod):
            if record.index in from_meta and self.sharding.owns(record.family):
                self.fill_slot(record, record.param.detach())
