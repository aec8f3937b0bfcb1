"""Materialisation: allocate the chunks, copy or initialise every parameter into its slot, re-point the model.

Runs once, after :class:`~lightning_pstar.runtime.manager.ChunkManager` has planned (so bad input failed
before anything changed). Parameters built on the meta device are initialised module by module with the
module's own ``reset_parameters()`` and copied into their slots; tied parameters keep the initialisation of
the last module that owns them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.family import ChunkFamily, ParamRecord, ParamTable
from lightning_pstar.runtime.residency import Residency
from lightning_pstar.runtime.sharding import Sharding
from lightning_pstar.runtime.state import TensorState, Tier

__all__ = ["Materialiser", "meta_modules"]


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
        for mod in with_params:
            self._materialise_meta_module(mod, from_meta)
        for mod in with_buffers:
            self._materialise_buffers(mod)
            if mod not in with_params:
                with torch.no_grad():
                    mod.reset_parameters()  # type: ignore[operator]
        for record in self.table.records:
            if self.sharding.owns(record.family):
                self.residency.point_at_chunk(record)
            else:
                self.sharding.point_at_poison(record)
            record.set_state(TensorState.HOLD)
        self.residency.repoint = True

    def fill_slot(self, record: ParamRecord, value: torch.Tensor) -> None:
        """Write ``value`` into the record's param slot (and its fp32 master)."""
        family = record.family
        self.on_write()
        with torch.no_grad():
            family.param_chunk.slot_view(record.slot).copy_(value)
            if ChunkKind.MASTER in family.chunks:
                family.chunks[ChunkKind.MASTER].slot_view(record.slot).copy_(value)

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

    def _materialise_meta_module(self, mod: nn.Module, from_meta: set[int]) -> None:
        self._materialise_buffers(mod)
        for param in list(mod._parameters.values()):
            if param is None or not param.is_meta:
                continue
            record = self.table.by_id[id(param)]
            value = torch.empty(param.shape, dtype=record.orig_dtype, device=self.device)
            self.table.replace_parameter(self.module, record, nn.Parameter(value, requires_grad=param.requires_grad))
        with torch.no_grad():
            mod.reset_parameters()  # type: ignore[operator]
        for record in self.table.direct_records(mod):
            if record.index in from_meta and self.sharding.owns(record.family):
                self.fill_slot(record, record.param.detach())
