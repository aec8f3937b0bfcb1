"""The chunk manager: owns chunk families, the parameter -> slot table, access/release and moves.

Setup happens in two phases so that bad input fails before anything changes: ``ChunkManager(...)``
only plans (layout, budgets, checks); :meth:`ChunkManager.materialise` then allocates chunks, copies or
initialises every parameter into its slot and points the model's parameters at views of the chunks.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from lightning_pstar.runtime.chunk import Chunk, ChunkKind, Slot, TransferStats
from lightning_pstar.runtime.comm import ChunkComm
from lightning_pstar.config import PStarConfig
from lightning_pstar.runtime.sharding import GroupCoordinator
from lightning_pstar.planning.layout import Layout, ParamSpec, plan_layout, search_chunk_size
from lightning_pstar.runtime.tracer import MemoryTracer, MomentKind
from lightning_pstar.runtime.placement import PlacementPolicy, make_policy
from lightning_pstar.report import MemoryReport
from lightning_pstar.runtime.state import TensorState, Tier
from lightning_pstar.checkpoint.model_state import StateDictsMixin

__all__ = ["ChunkFamily", "ChunkManager", "MemoryBudgetError", "MemoryReport", "ParamRecord"]

log = logging.getLogger(__name__)


class MemoryBudgetError(ValueError):
    """The chunks needed at one moment do not fit the tier budgets (a budget option is too small)."""


@dataclass(kw_only=True)
class ParamRecord:
    """Side-table entry of one unique parameter (keyed by the parameter, never stored on it)."""

    index: int
    param: nn.Parameter
    names: list[str]  # every name of the parameter in the model (tied weights have several)
    trainable: bool
    orig_dtype: torch.dtype
    family: ChunkFamily
    slot: Slot
    slot_holds_grad: bool = False  # mixed precision: the param slot holds this step's gradient
    grad_chunk_has_data: bool = False  # the GRAD slot holds a gradient (32-true) or an fp32 sum (mixed)


@dataclass(kw_only=True)
class ChunkFamily:
    """A param chunk and its optimizer-side chunks, all with the same layout (``slots``)."""

    family_id: int
    trainable: bool
    capacity: int  # elements
    slots: list[Slot]
    chunks: dict[ChunkKind, Chunk] = field(default_factory=dict)
    records: list[ParamRecord] = field(default_factory=list)

    @property
    def param_chunk(self) -> Chunk:
        return self.chunks[ChunkKind.PARAM]

    def has_grads(self) -> bool:
        return any(r.slot_holds_grad or r.grad_chunk_has_data for r in self.records)


def host_ram_bytes() -> int:
    """Physical RAM of this machine."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _fmt_bytes(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:.1f} MiB)"


class ChunkManager(StateDictsMixin):
    """Owns every chunk of one model and the table from parameters to slots."""

    def __init__(
        self,
        module: nn.Module,
        *,
        config: PStarConfig,
        compute_dtype: torch.dtype,
        device: torch.device,
        precision: str = "",
        world_size: int = 1,
        local_world_size: int = 1,
        accumulates: bool = False,
        comm: ChunkComm | None = None,
        policy: PlacementPolicy | None = None,
    ) -> None:
        self.module = module
        self.config = config
        self.compute_dtype = compute_dtype
        self.mixed = compute_dtype != torch.float32
        self.device = device
        self.simulated = device.type == "cpu"
        self.precision = precision
        if comm is not None and comm.world_size != world_size and world_size != 1:
            raise ValueError(f"world_size={world_size} disagrees with the communicator's {comm.world_size}")
        self.comm = comm if comm is not None else ChunkComm(rank=0, world_size=world_size)
        self.world_size = self.comm.world_size
        self.rank = self.comm.rank
        # mixed precision keeps an fp32 gradient sum per trainable family while accumulating micro-batches
        self.accumulates = accumulates
        self.stats = TransferStats()
        self.tracer = MemoryTracer(device, lambda: self.stats.per_tier_bytes[Tier.DEVICE], self._chunk_storage_ptrs)
        self.policy = (
            policy
            if policy is not None
            else make_policy(
                config.placement,
                self.tracer,
                static_chunk_fraction=config.static_chunk_fraction,
                warmup_chunk_fraction=config.warmup_chunk_fraction,
            )
        )
        self.in_training = False  # True inside training micro-batches: moments are traced/followed
        self.in_backward = False  # True from the first pre-backward of a micro-batch until it settles
        self.moment_chunk_bytes: dict[int, int] = {}  # moment index -> chunk bytes on the device (last seen)
        self.accumulating = False  # True while Lightning accumulates gradients (non-final micro-batch)
        self._tick = 0
        self._materialised = False
        self._copy_stream: torch.cuda.Stream | None = None  # CUDA: prefetches copy on this stream
        # bumped whenever weights change (optimizer step, load): a weight autograd saved by reference
        # (hooks.py, saved tensors) must read the same version in backward
        self.weights_version = 0

        self.device_budget = self._default_device_budget(config)
        host_limit = config.host_limit_bytes
        if host_limit is None:
            host_limit = int(host_ram_bytes() * config.host_memory_fraction / max(1, local_world_size))
        self.host_budget: int = host_limit

        self.host_params = self._host_embeddings(module) if config.cpu_embedding else {}
        self._named = self._collect_parameters(module, exclude={id(p) for p in self.host_params.values()})
        specs = [ParamSpec(name=names[0], numel=p.numel(), trainable=p.requires_grad) for p, names in self._named]
        if not specs:
            raise ValueError("The model has no parameters; there is nothing for PatrickStar to manage.")
        if config.chunk_elements is None:
            self.layout: Layout = search_chunk_size(
                specs,
                device_budget_bytes=self.device_budget,
                compute_itemsize=compute_dtype.itemsize,
                world_size=self.world_size,
            )
        else:
            self.layout = plan_layout(specs, config.chunk_elements, world_size=self.world_size)
        self.optimizer_bytes_per_elem = 0  # set by the optimizer (8 for Adam, 4 for SGD with momentum)
        self._min_device_bytes = self.min_device_bytes()[0]
        self._check_budgets()

        # build the side tables (no memory for chunks yet)
        self.families: list[ChunkFamily] = []
        self.records: list[ParamRecord] = []
        for plan in self.layout.chunks:
            slots = [
                Slot(name=specs[i].name, offset=off, numel=specs[i].numel, shape=self._named[i][0].shape)
                for i, off in zip(plan.members, plan.offsets, strict=True)
            ]
            family = ChunkFamily(family_id=plan.chunk_id, trainable=plan.trainable, capacity=plan.capacity, slots=slots)
            self.families.append(family)
            for i, slot in zip(plan.members, slots, strict=True):
                param, names = self._named[i]
                record = ParamRecord(
                    index=i,
                    param=param,
                    names=names,
                    trainable=param.requires_grad,
                    orig_dtype=param.dtype,
                    family=family,
                    slot=slot,
                )
                family.records.append(record)
        self.records = sorted((r for f in self.families for r in f.records), key=lambda r: r.index)
        # side table keyed by the parameter's identity (never an attribute stuck on the parameter)
        self._by_id: dict[int, ParamRecord] = {id(r.param): r for r in self.records}
        self.module_records: dict[nn.Module, list[ParamRecord]] = {}
        for mod in module.modules():
            direct = [self._by_id[id(p)] for p in mod.parameters(recurse=False) if id(p) in self._by_id]
            if direct:
                self.module_records[mod] = direct
        self.optimizer_tier = self.policy.optimizer_tier(
            model_data_bytes=self._model_data_bytes(optimizer_bytes_per_elem=8), device_budget=self.device_budget
        )
        # ZeRO data parallelism: None on one rank
        self.groups = GroupCoordinator(self, self.comm) if self.world_size > 1 else None

    # ---- planning -------------------------------------------------------------------------------------
    def _default_device_budget(self, config: PStarConfig) -> int | None:
        limit = config.device_limit_bytes
        if limit is not None or self.simulated:
            return limit
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * config.device_memory_fraction)

    @staticmethod
    def _host_embeddings(module: nn.Module) -> dict[str, nn.Parameter]:
        """``cpu_embedding``: embedding weights that stay fp32 on HOST, outside the chunks, by name.

        A weight shared with another module (a tied output head) stays in the chunks: the head computes on
        the device with it. Skipping it is logged, never silent.
        """
        uses: dict[int, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            uses.setdefault(id(param), []).append(name)
        out: dict[str, nn.Parameter] = {}
        for name, mod in module.named_modules():
            if isinstance(mod, nn.Embedding):
                names = uses[id(mod.weight)]
                if len(names) > 1:
                    log.warning(
                        "cpu_embedding: '%s' is shared with %s and stays in the chunks (a tied weight is used on"
                        " the device too).",
                        names[0],
                        names[1:],
                    )
                    continue
                if mod.weight.is_meta:
                    raise ValueError(
                        f"cpu_embedding: embedding '{name}' was built on the meta device. HINT: build embeddings"
                        " in `__init__`, or set cpu_embedding=False."
                    )
                out[names[0]] = cast(nn.Parameter, mod.weight)
        return out

    @staticmethod
    def _collect_parameters(module: nn.Module, exclude: set[int]) -> list[tuple[nn.Parameter, list[str]]]:
        seen: dict[int, tuple[nn.Parameter, list[str]]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            if id(param) in exclude:
                continue
            if id(param) in seen:
                seen[id(param)][1].append(name)
                continue
            if not (param.is_floating_point()):
                raise ValueError(
                    f"Parameter '{name}' has dtype {param.dtype}; PatrickStar chunks hold floating-point"
                    " parameters only. HINT: register integer tensors as buffers (`register_buffer`)."
                )
            seen[id(param)] = (param, [name])
        return list(seen.values())

    def _model_data_bytes(self, *, optimizer_bytes_per_elem: int) -> int:
        """Bytes of every chunk family once the optimizer's states exist."""
        param_b = self.compute_dtype.itemsize
        # mixed: fp32 master (+ fp32 gradient sum when accumulating); 32-true: fp32 grad chunk
        trainable = param_b + 4 + optimizer_bytes_per_elem + (4 if self.mixed and self.accumulates else 0)
        frozen = param_b + (4 if self.mixed and self.config.frozen_master else 0)
        total = self.layout.family_bytes(trainable_bytes_per_elem=trainable, frozen_bytes_per_elem=frozen)
        return total // self.world_size  # each rank keeps the families it owns (whole groups are padded)

    def min_device_bytes(self) -> tuple[int, str]:
        """Bytes of param chunks that must be resident at once for one module's forward, and its name.

        A module's own parameters stay in use while its children run, so each module counts the chunks
        of its ancestors' direct parameters too.
        """
        by_id = {id(p): i for i, (p, _) in enumerate(self._named)}
        itemsize = self.compute_dtype.itemsize
        worst, worst_name = 0, ""

        def visit(mod: nn.Module, name: str, inherited: frozenset[int]) -> None:
            nonlocal worst, worst_name
            own = {self.layout.param_chunk[by_id[id(p)]] for p in mod.parameters(recurse=False) if id(p) in by_id}
            chunks = inherited | own
            if self.world_size > 1:  # a chunk arrives with its whole communication group
                w = self.world_size
                chunks = frozenset(g * w + k for g in {c // w for c in chunks} for k in range(w))
            need = sum(self.layout.chunks[c].capacity * itemsize for c in chunks)
            if need > worst:
                worst, worst_name = need, name or "<root>"
            for child_name, child in mod.named_children():
                visit(child, f"{name}.{child_name}" if name else child_name, chunks)

        visit(self.module, "", frozenset())
        return worst, worst_name

    def _check_budgets(self) -> None:
        need, where = self.min_device_bytes()
        if self.device_budget is not None and need > self.device_budget:
            raise MemoryBudgetError(
                f"device_memory_limit is too small: module '{where}' needs parameter chunks of"
                f" {_fmt_bytes(need)} resident at once for its forward, but the device budget is"
                f" {_fmt_bytes(self.device_budget)}. HINT: raise device_memory_limit to at least {need}"
                " bytes or use a smaller chunk_size."
            )
        fraction = self.config.static_chunk_fraction
        if self.policy.name == "static" and self.device_budget is not None and need > self.device_budget * fraction:
            raise MemoryBudgetError(
                f"placement='static' gives chunks {_fmt_bytes(int(self.device_budget * fraction))}"
                f" (static_chunk_fraction={fraction} of the {_fmt_bytes(self.device_budget)} device budget), but"
                f" module '{where}' needs {_fmt_bytes(need)} of chunks resident at once. HINT: raise"
                " device_memory_limit or static_chunk_fraction, use a smaller chunk_size, or use"
                " placement='auto', which gives chunks the room activations leave at each moment."
            )
        total = self._model_data_bytes(optimizer_bytes_per_elem=8)
        room = (self.device_budget if self.device_budget is not None else total) + self.host_budget
        if total > room:
            raise MemoryBudgetError(
                f"model data does not fit: it needs {_fmt_bytes(total)} (params, fp32 masters/grads and Adam"
                f" states), but the device budget is {_fmt_bytes(self.device_budget or 0)} and the host budget"
                f" is {_fmt_bytes(self.host_budget)}. HINT: raise host_memory_limit or device_memory_limit, or"
                " train on more ranks."
            )

    # ---- materialisation ------------------------------------------------------------------------------
    def materialise(self) -> None:
        """Allocate chunks, move or initialise every parameter into its slot and re-point the model."""
        assert not self._materialised, "materialise() runs once"
        meta_modules = [m for m, recs in self.module_records.items() if any(r.param.is_meta for r in recs)]
        buffer_modules = [
            m for m in self.module.modules() if any(b is not None and b.is_meta for b in m._buffers.values())
        ]
        for mod in [*meta_modules, *(m for m in buffer_modules if m not in meta_modules)]:
            if not hasattr(mod, "reset_parameters"):
                name = next(n for n, m in self.module.named_modules() if m is mod)
                raise ValueError(
                    f"Module '{name or '<root>'}' ({type(mod).__name__}) was built on the meta device but has no"
                    " `reset_parameters()` to initialise its parameters and buffers. HINT: define"
                    " reset_parameters() on it or build the model in `__init__` instead of `configure_model`."
                )
        for param in self.host_params.values():
            if param.device.type != "cpu" or param.dtype != torch.float32:
                param.data = param.data.to("cpu", torch.float32)
        if self.groups is not None:
            self._check_same_layout_on_every_rank()
            # as DDP does, every rank starts from rank 0's weights (meta-initialised ones: from their owner)
            with torch.no_grad():
                for record in self.records:
                    if not record.param.is_meta:
                        self.comm.broadcast_(record.param.data, src=0)
        for family in self.families:
            if self.owns(family):
                self._allocate_family(family)
            else:
                self._new_chunk(family, ChunkKind.PARAM, self.compute_dtype)  # gathered on access
        # real parameters: copy their values; meta ones: initialise module by module
        for record in self.records:
            if not record.param.is_meta and self.owns(record.family):
                self._fill_slot(record, record.param.detach())
        # meta parameters are initialised module by module, in module order; a tied parameter keeps the
        # initialisation of the last module that owns it
        from_meta = {r.index for r in self.records if r.param.is_meta}
        for mod in meta_modules:
            self._materialise_meta_module(mod, from_meta)
        for mod in buffer_modules:
            for name, buf in mod._buffers.items():
                if buf is not None and buf.is_meta:
                    mod._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype, device=self.device)
            if mod not in meta_modules:
                with torch.no_grad():
                    mod.reset_parameters()  # type: ignore[operator]
        for record in self.records:
            if self.owns(record.family):
                self.point_at_chunk(record)
            else:
                assert self.groups is not None
                self.groups.point_at_poison(record)
            record.slot.set_state(TensorState.HOLD, chunk_id=record.family.family_id)
        self._materialised = True
        log.info(
            "PatrickStar: %d parameters in %d chunk families of %d elements (utilisation %.1f%%)",
            self.layout.payload_elements,
            len(self.families),
            self.layout.chunk_size,
            100 * self.layout.utilisation,
        )

    def _chunk_storage_ptrs(self) -> set[int]:
        """Addresses of every chunk storage now, on both tiers (the tracer tells model data from the rest)."""
        ptrs: set[int] = set()
        for chunk in self.iter_chunks():
            for buf in (chunk.device_buffer, chunk.host_buffer):
                if buf is not None:
                    ptr = buf.untyped_storage().data_ptr()
                    if ptr:
                        ptrs.add(ptr)
        return ptrs

    def owns(self, family: ChunkFamily) -> bool:
        """Whether this rank keeps ``family``'s chunks (always, on one rank)."""
        return self.groups is None or self.groups.owns(family)

    def _check_same_layout_on_every_rank(self) -> None:
        mine = (
            len(self._named),
            self.layout.payload_elements,
            self.layout.chunk_size,
            len(self.families),
            # a digest, not hash(): string hashing differs between processes
            hashlib.sha1(
                repr([(names[0], tuple(p.shape), p.requires_grad) for p, names in self._named]).encode()
            ).hexdigest(),
        )
        every = self.comm.all_gather_object(mine)
        for rank, theirs in enumerate(every):
            if theirs != mine:
                raise ValueError(
                    f"The model differs between ranks: rank {self.rank} has {mine[0]} parameters with"
                    f" {mine[1]:,} elements in {mine[3]} chunks of {mine[2]:,}, rank {rank} has {theirs[0]}"
                    f" parameters with {theirs[1]:,} elements in {theirs[3]} chunks of {theirs[2]:,}"
                    " (or other names/shapes). HINT: build the same model on every rank (same config, same"
                    " frozen parameters) and set chunk_size explicitly if the device budgets differ."
                )

    def _allocate_family(self, family: ChunkFamily) -> None:
        param_chunk = self._new_chunk(family, ChunkKind.PARAM, self.compute_dtype)
        self.ensure_device_room(param_chunk.nbytes, protect={family.family_id})
        param_chunk.allocate(Tier.DEVICE)
        if family.trainable and self.mixed:
            master = self._new_chunk(family, ChunkKind.MASTER, torch.float32)
            master.allocate(self._optimizer_side_tier(master.nbytes))
        elif self.mixed and self.config.frozen_master:
            # the exact fp32 weights of frozen parameters, read only by state dicts: they live on the host
            master = self._new_chunk(family, ChunkKind.MASTER, torch.float32)
            self._check_host_room(master.nbytes)
            master.allocate(Tier.HOST)

    def _new_chunk(self, family: ChunkFamily, kind: ChunkKind, dtype: torch.dtype) -> Chunk:
        chunk = Chunk(
            chunk_id=family.family_id,
            kind=kind,
            dtype=dtype,
            capacity=family.capacity,
            slots=family.slots,
            device=self.device,
            stats=self.stats,
        )
        family.chunks[kind] = chunk
        return chunk

    def _optimizer_side_tier(self, nbytes: int) -> Tier:
        if self.optimizer_tier is Tier.DEVICE:
            self.ensure_device_room(nbytes, protect=set())
        return self.optimizer_tier

    def add_optimizer_chunks(self, kinds: Sequence[ChunkKind]) -> None:
        """Allocate zeroed optimizer-state chunks (e.g. EXP_AVG, EXP_AVG_SQ) for every trainable family
        this rank owns."""
        for family in self.families:
            if not family.trainable or not self.owns(family):
                continue
            for kind in kinds:
                if kind not in family.chunks:
                    chunk = self._new_chunk(family, kind, torch.float32)
                    chunk.allocate(self._optimizer_side_tier(chunk.nbytes))
            if (not self.mixed or self.accumulates) and ChunkKind.GRAD not in family.chunks:
                grad = self._new_chunk(family, ChunkKind.GRAD, torch.float32)
                grad.allocate(self._optimizer_side_tier(grad.nbytes))
        self.optimizer_bytes_per_elem = 4 * len(kinds)

    def _fill_slot(self, record: ParamRecord, value: torch.Tensor) -> None:
        family = record.family
        self.weights_version += 1
        with torch.no_grad():
            family.param_chunk.slot_view(record.slot).copy_(value)
            if ChunkKind.MASTER in family.chunks:
                family.chunks[ChunkKind.MASTER].slot_view(record.slot).copy_(value)

    def _materialise_meta_module(self, mod: nn.Module, from_meta: set[int]) -> None:
        for name, buf in mod._buffers.items():
            if buf is not None and buf.is_meta:
                mod._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype, device=self.device)
        for param in list(mod._parameters.values()):
            if param is None or not param.is_meta:
                continue
            record = self._by_id[id(param)]
            value = torch.empty(param.shape, dtype=record.orig_dtype, device=self.device)
            self._replace_parameter(record, nn.Parameter(value, requires_grad=param.requires_grad))
        with torch.no_grad():
            mod.reset_parameters()  # type: ignore[operator]
        for record in self.module_records.get(mod, []):
            if record.index in from_meta and self.owns(record.family):
                self._fill_slot(record, record.param.detach())

    def _replace_parameter(self, record: ParamRecord, new: nn.Parameter) -> None:
        """Swap the record's parameter for ``new`` in every module that holds it (tied weights included)."""
        old = record.param
        for mod in self.module.modules():
            for name, p in mod._parameters.items():
                if p is old:
                    mod._parameters[name] = new
        del self._by_id[id(old)]
        record.param = new
        self._by_id[id(new)] = record

    def is_host_param(self, param: torch.Tensor) -> bool:
        """Whether ``param`` lives on HOST outside the chunks (``cpu_embedding``)."""
        return any(param is p for p in self.host_params.values())

    def record_of(self, param: nn.Parameter) -> ParamRecord:
        """The side-table entry of ``param``."""
        record = self._by_id.get(id(param))
        if record is None or record.param is not param:
            raise KeyError("this parameter is not managed by PatrickStar (was it added after setup?)")
        return record

    def point_at_chunk(self, record: ParamRecord) -> None:
        """Point the parameter at its slot in the buffer of the tier that holds its chunk.

        See [Note: storage identity] in ``chunk.py``: parameters move between the two storages of their
        chunk only when the chunk moves, which never happens while a module computes with it. While the
        param slot holds the gradient (mixed precision, between backward and the step) the parameter
        points at its fp32 master instead, so that reading it gives the weight, never the gradient.
        """
        family = record.family
        chunk = family.param_chunk
        if record.slot_holds_grad and ChunkKind.MASTER in family.chunks:
            chunk = family.chunks[ChunkKind.MASTER]
        record.param.data = chunk.buffer[record.slot.offset : record.slot.offset + record.slot.numel].view(
            record.slot.shape
        )

    def set_slot_holds_grad(self, record: ParamRecord, holds: bool) -> None:
        """Chunk reuse (mixed precision): say whether ``record``'s param slot holds its gradient, and point
        the parameter at its weight: the fp32 master while it does, the param slot again afterwards."""
        if record.slot_holds_grad is holds:
            return
        record.slot_holds_grad = holds
        self.point_at_chunk(record)

    def move_param_chunk(self, family: ChunkFamily, tier: Tier, *, asynchronous: bool = False) -> None:
        """Move ``family``'s param chunk to ``tier`` and re-point its parameters there.

        ``asynchronous`` (a prefetch on CUDA) copies on a side stream; the chunk waits for it on access.
        """
        chunk = family.param_chunk
        if chunk.tier is tier:
            return
        if tier is Tier.HOST:
            self._check_host_room(chunk.nbytes)
        stream = None
        if asynchronous and self.device.type == "cuda":
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
            stream = self._copy_stream
        chunk.move_to(tier, stream=stream)
        if self._materialised:  # during materialisation parameters are pointed once at the end
            for record in family.records:
                self.point_at_chunk(record)

    # ---- access ---------------------------------------------------------------------------------------
    def _device_used(self) -> int:
        return self.stats.per_tier_bytes[Tier.DEVICE]

    def ensure_device_room(self, nbytes: int, *, protect: set[int]) -> None:
        room = self.policy.chunk_room(self.device_budget, self._min_device_bytes)
        if room is None:
            return
        missing = self._device_used() + nbytes - room
        if missing <= 0:
            return
        if self.groups is not None:
            protect = protect | self.groups.pinned  # send buffers of in-flight gathers stay in place
        candidates = [
            f.param_chunk
            for f in self.families
            if f.family_id not in protect
            and ChunkKind.PARAM in f.chunks
            and f.param_chunk.tier is Tier.DEVICE
            and self.owns(f)  # remote chunks are released, never evicted
        ]
        victims = self.policy.victims(candidates, missing)
        if sum(v.nbytes for v in victims) < missing:
            in_use = [f.family_id for f in self.families if f.family_id in protect]
            raise MemoryBudgetError(
                f"cannot make room for {_fmt_bytes(nbytes)} on the device: {_fmt_bytes(self._device_used())} of"
                f" the {_fmt_bytes(room)} chunks may use now are held by chunks in use (families {in_use}) or"
                " not evictable. HINT: raise device_memory_limit or lower chunk_size."
            )
        for victim in victims:
            self._check_host_room(victim.nbytes)
            self.move_param_chunk(self.families[victim.chunk_id], Tier.HOST)
            self.stats.evictions += 1

    def _check_host_room(self, nbytes: int) -> None:
        used = self.stats.per_tier_bytes[Tier.HOST]
        if used + nbytes > self.host_budget:
            raise MemoryBudgetError(
                f"host budget exceeded: {_fmt_bytes(used)} in use, {_fmt_bytes(nbytes)} more needed, budget"
                f" {_fmt_bytes(self.host_budget)}. HINT: raise host_memory_limit."
            )

    def fetch(self, family: ChunkFamily, *, protect: set[int]) -> None:
        """Make ``family``'s param chunk resident on DEVICE, evicting others if the budget requires."""
        chunk = family.param_chunk
        self._tick += 1
        self.policy.touch(chunk, self._tick)
        if chunk.tier is Tier.DEVICE:
            chunk.wait()  # a prefetch may still be in flight
            return
        self.ensure_device_room(chunk.nbytes, protect=protect | {family.family_id})
        self.move_param_chunk(family, Tier.DEVICE)

    def access(
        self,
        records: Sequence[ParamRecord],
        new_state: TensorState,
        moment: tuple[MomentKind, int] | None = None,
    ) -> None:
        """Make the chunks of ``records`` resident and move their slots to ``new_state``.

        ``moment`` names the point of the iteration (for the warm-up trace and the plan that follows it).
        """
        families = {r.family.family_id: r.family for r in records}
        if moment is not None and moment[0] is MomentKind.BACKWARD:
            self.in_backward = True
        if moment is not None and self.in_training:
            self.tracer.moment(moment[0], moment[1], tuple(families))
        protect = set(families)
        if moment is not None and self.in_training:
            self.ensure_device_room(0, protect=protect)  # the tide: the room may have shrunk at this moment
        if self.groups is not None:
            self.groups.ensure_gathered(list(families.values()), protect)
        for family in families.values():
            if self.owns(family):
                self.fetch(family, protect=protect)
        for record in records:
            record.slot.set_state(new_state, chunk_id=record.family.family_id)
        if self.in_training:
            if moment is not None and self.tracer.warmed_up and self.tracer.matches and self.tracer.cursor >= 0:
                self.moment_chunk_bytes[self.tracer.cursor] = self._device_used()
            self._prefetch(protect)

    def _prefetch(self, protect: set[int]) -> None:
        """Fetch the next moment's chunks ahead of time when they fit without evicting anything."""
        wanted = [
            fid
            for fid in self.policy.prefetch()
            if self.owns(self.families[fid]) and self.families[fid].param_chunk.tier is not Tier.DEVICE
        ]
        if not wanted:
            return
        # the chunks fetched now must fit this moment's room and the next one's
        room = self.policy.chunk_room(self.device_budget, self._min_device_bytes)
        room_next = self.policy.next_chunk_room(self.device_budget, self._min_device_bytes)
        if room is not None and room_next is not None:
            room = min(room, room_next)
        for fid in wanted:
            chunk = self.families[fid].param_chunk
            if room is not None and self._device_used() + chunk.nbytes > room:
                return
            if chunk.tier is Tier.HOST:
                with torch.profiler.record_function("pstar::prefetch"):
                    self.move_param_chunk(self.families[fid], Tier.DEVICE, asynchronous=True)
                self.stats.prefetches += 1

    # ---- warm-up ---------------------------------------------------------------------------------------
    def begin_training_batch(self) -> None:
        """A training micro-batch starts; the first one of the run starts the warm-up trace."""
        self.in_training = True
        self.settle()
        if self.groups is not None:
            self.groups.begin_pass()
        if not self.tracer.warmed_up and not self.tracer.recording:
            self.tracer.start_recording()
        else:
            self.tracer.start_iteration()

    def begin_backward(self) -> None:
        """Every rank starts the backward of a training pass (the strategy's ``pre_backward``)."""
        if self.groups is not None:
            with torch.no_grad():
                self.groups.begin_backward()

    def begin_eval_pass(self) -> None:
        """Every rank starts an evaluation step (validation, test, predict)."""
        if self.groups is not None:
            self.groups.begin_pass()

    def end_eval_pass(self) -> None:
        """Every rank ended an evaluation step: the remote chunks it gathered go."""
        if self.groups is not None:
            self.groups.flush()

    def step_moment(self) -> None:
        """The optimizer step is a moment of its own (it accesses every trainable family)."""
        if self.in_training:
            fids = tuple(f.family_id for f in self.families if f.trainable)
            self.tracer.moment(MomentKind.STEP, 0, fids)
            if self.tracer.warmed_up and self.tracer.matches and self.tracer.cursor >= 0:
                self.moment_chunk_bytes[self.tracer.cursor] = self._device_used()

    def end_warmup_if_recording(self) -> None:
        """After the first optimizer step: close the trace, check the budget, plan optimizer placement."""
        if not self.tracer.recording:
            return
        self.tracer.stop_recording()
        if self.groups is not None:
            self._plan_group_prefetch()
        if self.device_budget is None or self.policy.name != "auto":
            return
        for index, moment in enumerate(self.tracer.trace.moments):
            need = (
                sum(self.families[f].param_chunk.nbytes for f in moment.families)
                if moment.kind is not MomentKind.STEP
                else 0
            )
            if need + moment.non_model_bytes > self.device_budget:
                raise MemoryBudgetError(
                    f"device_memory_limit is too small for this model's iteration: at moment {index}"
                    f" ({moment.kind.value}) the warm-up measured {_fmt_bytes(moment.non_model_bytes)} of"
                    f" non-model memory (activations) and the chunks needed then take {_fmt_bytes(need)}, together"
                    f" {_fmt_bytes(need + moment.non_model_bytes)}, but the device budget is"
                    f" {_fmt_bytes(self.device_budget)}. HINT: raise device_memory_limit, lower the batch size or"
                    " chunk_size, or use activation checkpointing."
                )
        self._plan_hybrid_optimizer()

    def _plan_group_prefetch(self) -> None:
        """ZeRO: gather the next chunk group while the current one computes, if two more groups fit the
        device budget at the warm-up's peak on every rank (all ranks agree: one collective)."""
        assert self.groups is not None
        fits = True
        if self.device_budget is not None:
            peak = max(
                (
                    sum(self.families[f].param_chunk.nbytes for f in m.families) + m.non_model_bytes
                    for m in self.tracer.trace.moments
                    if m.kind is not MomentKind.STEP
                ),
                default=0,
            )
            fits = peak + 2 * self.groups.group_bytes() <= self.device_budget
        enabled = self.groups.plan_prefetch(fits)
        log.info("PatrickStar: chunk groups are %sgathered ahead of use", "" if enabled else "not ")

    def _plan_hybrid_optimizer(self) -> None:
        """Keep whole optimizer-state families on the device as far as the margin at the step allows."""
        assert self.device_budget is not None
        params = sum(f.param_chunk.nbytes for f in self.families)
        margin = self.device_budget - self.tracer.trace.peak_non_model - params
        moved = 0
        for family in self.families:
            if not family.trainable:
                continue  # a frozen family's fp32 copy is only read by state dicts
            side = [c for k, c in family.chunks.items() if k is not ChunkKind.PARAM and c.tier is Tier.HOST]
            nbytes = sum(c.nbytes for c in side)
            if not side or nbytes > margin:
                continue
            for chunk in side:
                chunk.move_to(Tier.DEVICE)
            for record in family.records:
                if record.slot_holds_grad:  # the parameter reads its master (see point_at_chunk)
                    self.point_at_chunk(record)
            margin -= nbytes
            moved += 1
        log.info("PatrickStar: %d of %d optimizer-state families run on the device", moved, len(self.families))

    def optimizer_tier_of(self, family: ChunkFamily) -> Tier:
        """Where ``family``'s optimizer step runs: the tier of its optimizer-side chunks."""
        for kind, chunk in family.chunks.items():
            if kind is not ChunkKind.PARAM and chunk.tier is not None:
                return chunk.tier
        return Tier.DEVICE

    def release(self, records: Sequence[ParamRecord], new_state: TensorState) -> None:
        """Move slots out of ``COMPUTE``; their chunks become evictable (remote ones: released) once no
        slot computes."""
        for record in records:
            if record.slot.state is TensorState.COMPUTE:
                record.slot.set_state(new_state, chunk_id=record.family.family_id)
        if self.groups is not None:
            self.groups.release_passed()

    def post_backward(self, records: Sequence[ParamRecord]) -> None:
        """A module's backward is done: frozen slots go to ``HOLD``, trainable ones still waiting for their
        final gradient (tied weights, parameters used again earlier in forward) to ``HOLD_AFTER_FWD``."""
        for record in records:
            if record.slot.state is TensorState.COMPUTE:
                new = TensorState.HOLD_AFTER_FWD if record.trainable else TensorState.HOLD
                record.slot.set_state(new, chunk_id=record.family.family_id)
        if self.groups is not None:
            self.groups.release_passed()

    # ---- gradients ------------------------------------------------------------------------------------
    def grad_ready(self, record: ParamRecord, grad: torch.Tensor) -> None:
        """Store the final gradient of ``record`` for this backward into the chunks."""
        if torch.is_grad_enabled():  # autograd runs gradient hooks without grad mode unless create_graph
            with torch.no_grad():
                self.grad_ready(record, grad)
            return
        family = record.family
        if self.groups is not None:
            self.groups.grad_ready(record, grad)
            return
        if self.mixed and not self.accumulating:
            self._copy_in(family.param_chunk, record.slot, grad, add=False)
            self.set_slot_holds_grad(record, True)
        else:
            self._copy_in(self._grad_chunk(family), record.slot, grad, add=record.grad_chunk_has_data)
            record.grad_chunk_has_data = True
        final = TensorState.HOLD if self.accumulating else TensorState.HOLD_AFTER_BWD
        record.slot.set_state(final, chunk_id=family.family_id)

    def store_reduced_grad(self, record: ParamRecord, grad: torch.Tensor) -> None:
        """Store the gradient averaged over ranks for a slot this rank owns (ZeRO data parallelism)."""
        family = record.family
        view = grad.view(record.slot.shape)
        if self.mixed and not self.accumulating and ChunkKind.GRAD not in family.chunks:
            self._copy_in(family.param_chunk, record.slot, view, add=False)  # chunk reuse: 14 bytes/param
            self.set_slot_holds_grad(record, True)
        else:
            self._copy_in(self._grad_chunk(family), record.slot, view, add=record.grad_chunk_has_data)
            record.grad_chunk_has_data = True
        if not self.accumulating:
            record.slot.set_state(TensorState.HOLD_AFTER_BWD, chunk_id=family.family_id)

    def _grad_chunk(self, family: ChunkFamily) -> Chunk:
        chunk = family.chunks.get(ChunkKind.GRAD)
        if chunk is None:
            # mixed precision sums micro-batch gradients in fp32. Declared runs (``accumulates=True``)
            # allocate it at setup within the plan; otherwise it goes to the device only if it fits there
            # without evicting anything in the middle of a backward.
            chunk = self._new_chunk(family, ChunkKind.GRAD, torch.float32)
            tier = self.optimizer_tier
            room = self.policy.chunk_room(self.device_budget, self._min_device_bytes)
            if tier is Tier.DEVICE and room is not None and self._device_used() + chunk.nbytes > room:
                tier = Tier.HOST
            if tier is Tier.HOST:
                self._check_host_room(chunk.nbytes)
            chunk.allocate(tier)
        return chunk

    def _copy_in(self, chunk: Chunk, slot: Slot, grad: torch.Tensor, *, add: bool) -> None:
        target = chunk.slot_view(slot)
        if chunk.tier is Tier.HOST and not self.simulated:
            self.stats.d2h_bytes += grad.numel() * grad.element_size()
        if add:
            target.add_(grad.to(target.device))
        else:
            target.copy_(grad)

    def settle(self) -> None:
        """Slots still in use or waiting for a backward go back to ``HOLD`` (after backward, before a batch).

        Slots in ``HOLD_AFTER_BWD`` keep their gradient for the coming optimizer step.
        """
        self.in_backward = False
        if self.groups is not None:
            with torch.no_grad():
                self.groups.flush()  # reduce groups whose parameters did not all receive a gradient
        for record in self.records:
            if record.slot.state in (TensorState.COMPUTE, TensorState.HOLD_AFTER_FWD):
                record.slot.set_state(TensorState.HOLD, chunk_id=record.family.family_id)

    def discard_grads(self) -> None:
        """Forget gradients (``zero_grad``); weights overwritten by gradients are restored from the masters."""
        if self.groups is not None:
            self.groups.discard()
        for family in self.families:
            restore = [r for r in family.records if r.slot_holds_grad]
            if restore:
                master = family.chunks[ChunkKind.MASTER]
                for record in restore:
                    with torch.no_grad():
                        family.param_chunk.slot_view(record.slot).copy_(master.slot_view(record.slot))
            for record in family.records:
                self.set_slot_holds_grad(record, False)
                record.grad_chunk_has_data = False
                if record.slot.state is TensorState.HOLD_AFTER_BWD:
                    record.slot.set_state(TensorState.HOLD, chunk_id=family.family_id)

    # ---- reporting ------------------------------------------------------------------------------------
    def iter_chunks(self) -> Iterator[Chunk]:
        for family in self.families:
            yield from family.chunks.values()

    def _optimizer_placement_summary(self) -> str:
        tiers = [self.optimizer_tier_of(f) for f in self.families if f.trainable and len(f.chunks) > 1]
        if not tiers:
            return self.optimizer_tier.value
        on_device = sum(t is Tier.DEVICE for t in tiers)
        if on_device in (0, len(tiers)):
            return tiers[0].value
        return f"device for {on_device} of {len(tiers)} families, host for the rest"

    def memory_report(self) -> MemoryReport:
        trace = self.tracer.trace
        allocated = sum(c.nbytes for c in self.iter_chunks() if c.tier is not None)
        payload_bytes = 0
        for family in self.families:
            per_elem = sum(c.dtype.itemsize for c in family.chunks.values() if c.tier is not None)
            payload_bytes += per_elem * sum(s.numel for s in family.slots)
        return MemoryReport(
            precision=self.precision,
            num_params=self.layout.payload_elements,
            num_chunks=len(self.families),
            chunk_size=self.layout.chunk_size,
            chunk_utilisation=self.layout.utilisation,
            model_data_bytes=allocated,
            model_data_bytes_per_param=payload_bytes / max(1, self.layout.payload_elements),
            device_chunk_bytes=self.stats.per_tier_bytes[Tier.DEVICE],
            host_chunk_bytes=self.stats.per_tier_bytes[Tier.HOST],
            peak_device_chunk_bytes=self.stats.peak_device_bytes,
            h2d_bytes=self.stats.h2d_bytes,
            d2h_bytes=self.stats.d2h_bytes,
            evictions=self.stats.evictions,
            device_memory_limit=self.device_budget,
            host_memory_limit=self.host_budget,
            optimizer_tier=self._optimizer_placement_summary(),
            placement=self.policy.name,
            rank=self.rank,
            world_size=self.world_size,
            gathered_bytes=self.comm.gathered_bytes,
            reduced_bytes=self.comm.reduced_bytes,
            group_gathers=self.groups.gathers if self.groups is not None else 0,
            group_prefetches=self.groups.prefetches if self.groups is not None else 0,
            prefetches=self.stats.prefetches,
            peak_non_model_bytes=trace.peak_non_model,
            moment_non_model_bytes=[m.non_model_bytes for m in trace.moments],
            moment_device_chunk_bytes=[self.moment_chunk_bytes.get(i, 0) for i in range(len(trace.moments))],
            moment_labels=[
                "step" if m.kind is MomentKind.STEP else f"{'fwd' if m.kind is MomentKind.FORWARD else 'bwd'}:{m.key}"
                for m in trace.moments
            ],
        )
