"""Chunk families, parameter records and the table from parameters to slots.

A :class:`ChunkFamily` is one param chunk and its optimizer-side chunks (fp32 master, gradient, optimizer
states), all with the same slots. A :class:`ParamRecord` is one unique parameter: its family, its slot and
where its gradient lives. The :class:`ParamTable` is the side table keyed by parameter identity (never an
attribute stuck on the parameter) and by module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_pstar.planning.layout import Layout
from lightning_pstar.planning.requirements import module_parameters
from lightning_pstar.runtime.chunk import Chunk, ChunkKind, Slot
from lightning_pstar.runtime.state import SOURCES_OF, GradLocation, TensorState

__all__ = [
    "ChunkFamily",
    "ParamRecord",
    "ParamTable",
    "copy_forward_writes_to_masters",
    "families_of",
    "move_slots",
    "release_slots",
]

log = logging.getLogger(__name__)

# module-level: an Enum member read through its class costs a lookup, and these are read per module
_PARAM, _COMPUTE = ChunkKind.PARAM, TensorState.COMPUTE


@dataclass(kw_only=True, eq=False)
class ParamRecord:
    """Side-table entry of one unique parameter (keyed by the parameter, never stored on it)."""

    index: int  # position in the layout's parameter order
    param: nn.Parameter
    names: list[str]  # every name of the parameter in the model (tied weights have several)
    trainable: bool
    orig_dtype: torch.dtype
    family: ChunkFamily
    slot: Slot
    # where this step's gradient lives (:attr:`grad` as a GradLocation): plain bools, read per parameter on the
    # hot path (a Flag's ``in`` and ``|`` cost a Python call each)
    grad_in_param_slot: bool = False
    """Mixed precision chunk reuse: the param slot holds the gradient, not the weight."""
    grad_in_grad_chunk: bool = False
    """The fp32 GRAD chunk holds the gradient (32-true) or the sum of earlier micro-batches."""
    replaced_at: int = -1
    """The parameter's version counter just before its gradient replaced the weight in the param slot (the bump
    that follows is the engine's, not a write: [Note: gradients land per family] in ``grads.py``)."""
    engine_bumps: int = 0
    """How many times the engine bumped the parameter's version counter by replacing its weight with its gradient in
    the slot (chunk reuse): a tensor saved before reads the weight again once it is back, if every bump since was
    the engine's ([Note: a forward after the gradient] in ``late_gradients.py``)."""
    waiting: bool = False
    """Its final gradient waits for the rest of its family's ([Note: gradients land per family] in ``grads.py``)."""
    pointed: int = -1
    """The address the engine last pointed the parameter at ([Note: parameters given new storage] in
    ``new_storage.py``)."""
    strided: bool = False
    """Whether that view was not contiguous (the NaN view of a released chunk, several ranks)."""
    known_version: int = -1
    """Mixed precision: the parameter's version counter when the engine last knew its slot to equal its fp32
    master in the compute dtype ([Note: writes outside a forward] in ``outside_writes.py``)."""

    @property
    def grad(self) -> GradLocation:
        """Where this step's gradient lives (both flags: their sum)."""
        location = GradLocation.PARAM_SLOT if self.grad_in_param_slot else GradLocation.NONE
        return location | GradLocation.GRAD_CHUNK if self.grad_in_grad_chunk else location

    @grad.setter
    def grad(self, location: GradLocation) -> None:
        self.grad_in_param_slot = GradLocation.PARAM_SLOT in location
        self.grad_in_grad_chunk = GradLocation.GRAD_CHUNK in location

    @property
    def has_grad(self) -> bool:
        return self.grad_in_param_slot or self.grad_in_grad_chunk

    def set_state(self, new: TensorState) -> None:
        self.slot.set_state(new, chunk_id=self.family.family_id)


def move_slots(records: Sequence[ParamRecord], new: TensorState) -> None:
    """Move every record's slot to ``new``, in order, through the transition guard (one loop per module: the
    guard, and its message, run only for a pair the table does not allow, which raises)."""
    sources = SOURCES_OF[new]
    for record in records:
        slot = record.slot
        if slot.state not in sources:
            record.set_state(new)  # raises
        slot.state = new


def families_of(records: Sequence[ParamRecord]) -> tuple[list[ChunkFamily], tuple[int, ...]]:
    """The chunk families of ``records`` in first-use order, and their ids."""
    families = {r.family.family_id: r.family for r in records}
    return list(families.values()), tuple(families)


def release_slots(records: Sequence[ParamRecord], new: TensorState, frozen: TensorState | None = None) -> None:
    """Move the records' slots that are in ``COMPUTE`` to ``new`` (frozen parameters' to ``frozen``, when
    given), through the transition guard; the others stay as they are."""
    compute = _COMPUTE
    for record in records:
        slot = record.slot
        if slot.state is compute:
            target = new if frozen is None or record.trainable else frozen
            if compute not in SOURCES_OF[target]:
                record.set_state(target)  # raises
            slot.state = target


@dataclass(kw_only=True, eq=False)
class ChunkFamily:
    """A param chunk and its optimizer-side chunks, all with the same layout (``slots``)."""

    family_id: int
    trainable: bool
    capacity: int  # elements
    slots: list[Slot]
    chunks: dict[ChunkKind, Chunk] = field(default_factory=dict)
    records: list[ParamRecord] = field(default_factory=list)
    # trainable parameters (or views of them) autograd saved for a backward, and how many of those it has dropped:
    # while the two differ a backward may still read the param chunk ([Note: copies back inside the backward] in
    # optim/overlap.py). Two counters, each written by one thread (the forward's; autograd's), so none is lost.
    saved_params: int = 0
    dropped_params: int = 0
    # a module of the family computed again inside a backward after the family's gradient of that backward had
    # landed (reentrant activation checkpointing of a module used twice): it may get a second gradient, so it never
    # steps, nor has its norms taken, inside a backward ([Note: a forward after the gradient] in late_gradients.py)
    recomputed_after_grad: bool = False

    @property
    def param_chunk(self) -> Chunk:
        return self.chunks[_PARAM]

    def has_grads(self) -> bool:
        return any(r.grad_in_param_slot or r.grad_in_grad_chunk for r in self.records)

    @torch.no_grad()
    def copy_slot_writes_to_master(self, record: ParamRecord) -> None:
        """A module wrote ``record``'s weight in place in the param chunk (mixed precision): copy the elements
        that changed into the fp32 master (the others keep their full precision)."""
        master = self.chunks.get(ChunkKind.MASTER)
        if master is None:
            return
        slot = self.param_chunk.slot_view(record.slot)
        exact = master.slot_view(record.slot)
        changed = (slot != exact.to(slot.device, slot.dtype)).to(exact.device)
        exact[changed] = slot.to(exact.device, exact.dtype)[changed]


class ParamTable:
    """Every family and record of one model, by family id, by parameter identity and by module."""

    def __init__(self, module: nn.Module, layout: Layout, named: Sequence[tuple[nn.Parameter, list[str]]]) -> None:
        self.families: list[ChunkFamily] = []
        for plan in layout.chunks:
            slots = [
                Slot(name=named[i][1][0], offset=off, numel=named[i][0].numel(), shape=named[i][0].shape)
                for i, off in zip(plan.members, plan.offsets, strict=True)
            ]
            family = ChunkFamily(family_id=plan.chunk_id, trainable=plan.trainable, capacity=plan.capacity, slots=slots)
            self.families.append(family)
            for i, slot in zip(plan.members, slots, strict=True):
                param, names = named[i]
                family.records.append(
                    ParamRecord(
                        index=i,
                        param=param,
                        names=names,
                        trainable=param.requires_grad,
                        orig_dtype=param.dtype,
                        family=family,
                        slot=slot,
                        known_version=param._version,
                    )
                )
        self.records: list[ParamRecord] = sorted((r for f in self.families for r in f.records), key=lambda r: r.index)
        self.by_id: dict[int, ParamRecord] = {id(r.param): r for r in self.records}
        # the records each module's forward computes with (its own, and those of children it uses functionally)
        self.module_records: dict[nn.Module, list[ParamRecord]] = {}
        for mod, params in module_parameters(module).items():
            used = [self.by_id[id(p)] for p in params if id(p) in self.by_id]
            if used:
                self.module_records[mod] = used
        # per module record list (by identity; fixed from here on): its families in first-use order and their ids
        self.families_of_list: dict[int, tuple[list[ParamRecord], list[ChunkFamily], tuple[int, ...]]] = {
            id(used): (used, *families_of(used)) for used in self.module_records.values()
        }

    def direct_records(self, mod: nn.Module) -> list[ParamRecord]:
        """The records of ``mod``'s own parameters (not of children it uses)."""
        return [self.by_id[id(p)] for p in mod.parameters(recurse=False) if id(p) in self.by_id]

    def record_of(self, param: torch.Tensor) -> ParamRecord:
        """The side-table entry of ``param``."""
        record = self.by_id.get(id(param))
        if record is None or record.param is not param:
            raise KeyError("this parameter is not managed by PatrickStar (was it added after setup?)")
        return record

    def replace_parameter(self, module: nn.Module, record: ParamRecord, new: nn.Parameter) -> None:
        """Swap the record's parameter for ``new`` in every module that holds it (tied weights included)."""
        old = record.param
        for mod in module.modules():
            for name, p in mod._parameters.items():
                if p is old:
                    mod._parameters[name] = new
        del self.by_id[id(old)]
        record.param = new
        self.by_id[id(new)] = record

    def iter_chunks(self) -> Iterator[Chunk]:
        for family in self.families:
            yield from family.chunks.values()


def copy_forward_writes_to_masters(records: Sequence[ParamRecord], *, distributed: bool) -> None:
    """A module wrote its weights in place during forward (``nn.Embedding(max_norm=...)`` renormalises the rows it
    looks up): copy what changed into the fp32 master, which is the weight the optimizer steps and checkpoints save
    (the compute-dtype slot only holds a rounded copy). With several ranks (``distributed``) it is refused."""
    names = ", ".join(f"'{r.names[0]}'" for r in records)
    if distributed:
        raise RuntimeError(
            f"Parameter(s) {names} were written in place during forward (for example by"
            " `nn.Embedding(max_norm=...)`). With several ranks every rank would write different values into"
            " its copy (plain DDP's replicas diverge the same way), and a chunk another rank owns cannot keep"
            " them. HINT: renormalise explicitly outside forward (e.g. in `on_before_optimizer_step`), or"
            " train on one rank."
        )
    for record in records:
        record.family.copy_slot_writes_to_master(record)
    log.debug("PatrickStar: %s written in place during forward; fp32 masters updated", names)
