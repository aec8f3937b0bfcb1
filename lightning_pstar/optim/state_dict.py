"""The optimizer's state outside the chunks, and its state dicts in torch's layout.

Adam's ``exp_avg``/``exp_avg_sq`` and SGD's momentum buffer live in the EXP_AVG / EXP_AVG_SQ chunks of each
family; what does not fit a chunk (Adam's step counts, which SGD buffers have started, the state of
host-resident parameters) is in an :class:`OptimizerBook`. :class:`ChunkedStateDict` turns both into
torch's standard layout (``state`` by parameter index, ``param_groups``), consolidated from every rank, or
into the flat tensors of the states one rank owns (a sharded checkpoint), and loads them back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.disk_tier import disk_loaded, disk_one_at_a_time
from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
from lightning_pstar.runtime.manager import ChunkManager

__all__ = ["ChunkedStateDict", "OptimizerBook", "ReadTensors", "check_optimizer_class", "saved_optimizer_kind"]

ReadTensors = Callable[[dict[str, torch.Size]], Mapping[str, torch.Tensor]]
"""Reads the named tensors (key -> shape) from a sharded store."""


_ADAM_FIELDS = frozenset({"exp_avg", "exp_avg_sq"})
_SGD_FIELDS = frozenset({"momentum_buffer"})


def saved_optimizer_kind(fields: set[str], groups: list[Any]) -> str | None:
    """Which optimizer family wrote a state ("Adam/AdamW" or "SGD"), from its state fields and its groups'
    hyper-parameters (torch's layout does not name the class); None where nothing tells."""
    keys = {k for group in groups if isinstance(group, Mapping) for k in group}
    if fields & _ADAM_FIELDS or "betas" in keys:
        return "Adam/AdamW"
    if fields & _SGD_FIELDS or {"momentum", "dampening", "nesterov"} <= keys:
        return "SGD"
    return None


def check_optimizer_class(optimizer: torch.optim.Optimizer, fields: set[str], groups: list[Any], where: str) -> None:
    """Refuse an optimizer state written by another optimizer family than ``optimizer`` (SGD's momentum would
    silently become Adam's ``exp_avg``), naming both; ``where`` says which state (for the message)."""
    saved = saved_optimizer_kind(fields, groups)
    mine = "Adam/AdamW" if isinstance(optimizer, torch.optim.Adam) else "SGD"
    if saved is not None and saved != mine:
        raise ValueError(
            f"{where} was written by {saved} (fields {sorted(fields) or 'none'}), but this run's optimizer is"
            f" {type(optimizer).__name__}. HINT: build the same optimizer class (`configure_optimizers`; under"
            " Fabric, the optimizer given to `fabric.setup`) as the run that saved the checkpoint, or load only the"
            " weights (module.load_state_dict before fit, without ckpt_path; `fabric.load` of the model alone)."
        )


@dataclass(kw_only=True)
class OptimizerBook:
    """What the optimizer keeps per parameter beside the chunks."""

    is_adam: bool  # Adam or AdamW (AdamW subclasses Adam); else SGD
    group_of: dict[int, int] = field(default_factory=dict)
    """Record index -> index of its param group (trainable records only)."""
    host_group: dict[int, int] = field(default_factory=dict)
    """id of a host-resident parameter (cpu_embedding) -> index of its param group."""
    steps: dict[int, torch.Tensor] = field(default_factory=dict)
    """Adam: record index -> its step count (float32 scalar, on the tier of its state)."""
    momentum_started: set[int] = field(default_factory=set)
    """SGD: records whose momentum buffer holds a value."""
    host_state: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """id of a host-resident parameter -> its optimizer state, by torch's names."""

    def is_host(self, param: torch.Tensor) -> bool:
        return id(param) in self.host_group

    def record_step(self, record: ParamRecord) -> float:
        """The record's step count (Adam), 0 for a started momentum buffer (SGD), -1 without state."""
        if self.is_adam:
            step = self.steps.get(record.index)
            return -1.0 if step is None else float(step)
        return 0.0 if record.index in self.momentum_started else -1.0

    def step_tensor(self, record: ParamRecord, device: torch.device) -> torch.Tensor:
        """The record's step count on ``device`` for the fused kernel to advance (0 before its first step)."""
        step = self.steps.get(record.index)
        if step is None:
            step = torch.zeros((), dtype=torch.float32, device=device)
        elif step.device != device:
            step = step.to(device)
        self.steps[record.index] = step
        return step


class ChunkedStateDict:
    """torch-format optimizer state dicts from and into the chunks of ``manager``."""

    def __init__(self, manager: ChunkManager, book: OptimizerBook, param_groups: list[dict[str, Any]]) -> None:
        self._manager = manager
        self._book = book
        self._param_groups = param_groups  # the user's optimizer's list (shared, never replaced)
        self._kinds = [ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ] if book.is_adam else [ChunkKind.EXP_AVG]
        self._record_indices: set[int] | None = None  # records of this optimizer's parameters (see covers)
        self._has_momentum = False  # SGD: momentum buffers were laid out (set by the optimizer)
        self._normalise_groups: Callable[[], None] | None = None  # the optimizer class's rules on loaded groups

    def _ordered_params(self) -> list[tuple[int, Any]]:
        """(index in torch's layout, parameter) over every group, in order."""
        params = [p for group in self._param_groups for p in group["params"]]
        return list(enumerate(params))

    # ---- reading ------------------------------------------------------------------------------------------
    def record_states(
        self, *, rank0_only: bool = False, owned_only: bool = False
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Record index -> its optimizer state (CPU tensors, torch's names), for every record on every rank.

        With several ranks each family's state comes from its owner (a broadcast per family, in order);
        ``rank0_only`` streams it to rank 0 alone, ``owned_only`` reads only this rank's families (no
        communication).
        """
        out: dict[int, dict[str, torch.Tensor]] = {}
        for family in self._manager.families:
            out.update(self.family_states(family, rank0_only=rank0_only, owned_only=owned_only))
        return out

    def covers(self, family: ChunkFamily) -> bool:
        """Whether a parameter of this optimizer lives in ``family`` (the same answer on every rank)."""
        if self._record_indices is None:
            manager, book = self._manager, self._book
            self._record_indices = {
                manager.record_of(p).index for _, p in self._ordered_params() if not book.is_host(p)
            }
        return any(record.index in self._record_indices for record in family.records)

    def family_states(
        self, family: ChunkFamily, *, rank0_only: bool = False, owned_only: bool = False
    ) -> dict[int, dict[str, torch.Tensor]]:
        """:meth:`record_states` of one family (one collective at several ranks unless ``owned_only``; a family on
        the disk tier is read into host buffers for it, one family at a time)."""
        with disk_loaded(self._manager.disk, family, write=False, kinds=self._kinds):
            return self._family_states(family, rank0_only=rank0_only, owned_only=owned_only)

    def _family_states(
        self, family: ChunkFamily, *, rank0_only: bool, owned_only: bool
    ) -> dict[int, dict[str, torch.Tensor]]:
        manager = self._manager
        out: dict[int, dict[str, torch.Tensor]] = {}
        if not family.trainable or not family.records:
            return out
        owned = manager.owns(family)
        if owned_only and not owned:
            return out
        if manager.comm.distributed and not owned_only:
            source = self._from_owner(family, owned=owned, rank0_only=rank0_only)
            if source is None:
                return out  # rank0_only, and this is not rank 0
            chunks, steps = source
        else:
            chunks = {k: family.chunks[k].data for k in self._kinds if owned and k in family.chunks}
            steps = [self._book.record_step(r) for r in family.records]
        for record, step in zip(family.records, steps, strict=True):
            if step >= 0:
                out[record.index] = self._entry(record, chunks, step)
        return out

    def _from_owner(
        self, family: ChunkFamily, *, owned: bool, rank0_only: bool
    ) -> tuple[dict[ChunkKind, torch.Tensor], list[float]] | None:
        """The family's state chunks and step counts, sent by its owner (None on ranks that get nothing)."""
        manager = self._manager
        kinds = self._kinds
        # the owner packs [states..., steps] so one collective carries the family
        width = len(kinds) * family.capacity + len(family.records)
        packed = torch.zeros(width, dtype=torch.float32, device=manager.device)
        if owned:
            present = [k for k in kinds if k in family.chunks]
            for i, kind in enumerate(present):
                packed[i * family.capacity : (i + 1) * family.capacity].copy_(family.chunks[kind].data)
            steps = [self._book.record_step(r) for r in family.records]
            packed[len(kinds) * family.capacity :].copy_(torch.tensor(steps, dtype=torch.float32))
        owner = family.family_id % manager.world_size
        if rank0_only:
            manager.comm.to_rank0_(packed, src=owner)
            if manager.rank != 0:
                return None
        else:
            manager.comm.broadcast_(packed, src=owner)
        packed = packed.cpu()
        chunks = {k: packed[i * family.capacity : (i + 1) * family.capacity] for i, k in enumerate(kinds)}
        return chunks, packed[len(kinds) * family.capacity :].tolist()

    def _entry(self, record: ParamRecord, chunks: dict[ChunkKind, torch.Tensor], step: float) -> dict[str, Any]:
        """One record's state in torch's names, copied to CPU from ``chunks`` (1-D family buffers)."""
        sl = slice(record.slot.offset, record.slot.offset + record.slot.numel)
        shape = record.slot.shape
        if self._book.is_adam:
            return {
                "step": torch.tensor(step, dtype=torch.float32),
                "exp_avg": chunks[ChunkKind.EXP_AVG][sl].view(shape).to("cpu", copy=True),
                "exp_avg_sq": chunks[ChunkKind.EXP_AVG_SQ][sl].view(shape).to("cpu", copy=True),
            }
        return {"momentum_buffer": chunks[ChunkKind.EXP_AVG][sl].view(shape).to("cpu", copy=True)}

    def state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """torch's layout (``state`` by parameter index, ``param_groups``), consolidated from every rank.

        ``rank0_only`` (what checkpoints use) streams the states to rank 0; other ranks get empty states.
        """
        return self.assemble(self.record_states(rank0_only=rank0_only))

    def assemble(self, record_states: Mapping[int, dict[str, torch.Tensor]]) -> dict[str, Any]:
        """torch's layout from the chunk states read by :meth:`record_states` / :meth:`family_states` (record
        index -> state) and the states of host-resident parameters."""
        manager = self._manager
        book = self._book
        state: dict[int, dict[str, Any]] = {}
        for index, p in self._ordered_params():
            if book.is_host(p):
                if book.host_state.get(id(p)):
                    state[index] = {k: v.detach().to("cpu", copy=True) for k, v in book.host_state[id(p)].items()}
                continue
            entry = record_states.get(manager.record_of(p).index)
            if entry is not None:
                state[index] = entry
        groups = []
        start = 0
        for group in self._param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def owned_state_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """``<prefix><index>/<field>`` -> tensor for the states this rank owns (a sharded save)."""
        manager = self._manager
        book = self._book
        states = self.record_states(owned_only=True)
        out: dict[str, torch.Tensor] = {}
        for index, p in self._ordered_params():
            if book.is_host(p):
                if manager.rank == 0:
                    for name, value in book.host_state.get(id(p), {}).items():
                        value = value.detach().to("cpu", copy=True)
                        out[f"{prefix}{index}/{name}"] = value.reshape(-1) if name == "step" else value
                continue
            entry = states.get(manager.record_of(p).index)
            for name, value in (entry or {}).items():
                out[f"{prefix}{index}/{name}"] = value.reshape(-1) if name == "step" else value
        return out

    def read_owned_state(
        self, stored: dict[str, torch.Size], prefix: str, read: ReadTensors
    ) -> dict[int, dict[str, torch.Tensor]]:
        """The ``state`` part of torch's layout for the parameters this rank owns, read from a sharded store
        whose keys (and shapes) are ``stored`` (the inverse of :meth:`owned_state_tensors`)."""
        manager = self._manager
        wanted: dict[str, torch.Size] = {}
        for index, p in self._ordered_params():
            if not (self._book.is_host(p) or manager.owns(manager.record_of(p).family)):
                continue
            for key, shape in stored.items():
                if key.startswith(f"{prefix}{index}/"):
                    wanted[key] = shape
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in read(wanted).items():
            position, name = key[len(prefix) :].split("/")
            state.setdefault(int(position), {})[name] = value.reshape(()) if name == "step" else value
        return state

    # ---- loading ------------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict in torch's layout: everything is validated before anything changes."""
        groups, updates, host_updates = self.validated(state_dict)
        # validated: now change state
        for saved, mine in zip(groups, self._param_groups, strict=True):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
        if self._normalise_groups is not None:
            self._normalise_groups()  # the optimizer class's own rules (torch's AdamW keeps decoupled weight decay)
        for p, entry in host_updates:
            self._book.host_state[id(p)] = {
                k: torch.as_tensor(v, dtype=torch.float32).to(p.device).clone() for k, v in entry.items()
            }
        updates.sort(key=lambda update: update[0].family.family_id)  # a disk family is read and written once
        with torch.no_grad(), disk_one_at_a_time(self._manager.disk, write=True, kinds=self._kinds) as need:
            for record, entry in updates:
                if self._manager.owns(record.family):  # else its owner loads it
                    need(record.family)
                    self._load_record(record, entry)

    def validated(
        self, state_dict: Mapping[str, Any]
    ) -> tuple[list[Any], list[tuple[ParamRecord, dict[str, Any]]], list[tuple[torch.Tensor, dict[str, Any]]]]:
        """Check a state dict in torch's layout against this optimizer, changing nothing (a checkpoint's loader runs
        it before the model's weights change); returns its groups and the entries to load (records, host params)."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or "state" not in state_dict:
            raise ValueError("optimizer state_dict must have 'state' and 'param_groups' (torch's layout)")
        self.check_groups(groups)
        fields = {name for entry in state_dict["state"].values() if isinstance(entry, Mapping) for name in entry}
        writer = saved_optimizer_kind(fields, groups)
        if writer is not None and (writer == "SGD") == self._book.is_adam:
            kind = "Adam/AdamW" if self._book.is_adam else "SGD"
            raise ValueError(
                f"the optimizer state was written by {writer} (fields {sorted(fields)}), this optimizer is {kind}."
                " HINT: build the same optimizer class (`configure_optimizers`; under Fabric, the optimizer given to"
                " `fabric.setup`) as the run that saved it."
            )
        saved_index = [i for g in groups for i in g["params"]]
        updates: list[tuple[ParamRecord, dict[str, Any]]] = []
        host_updates: list[tuple[torch.Tensor, dict[str, Any]]] = []
        for (_pos, p), key in zip(self._ordered_params(), saved_index, strict=True):
            entry = state_dict["state"].get(key)
            if entry is None:
                continue
            if self._book.is_host(p):
                host_updates.append((p, entry))
                continue
            record = self._manager.record_of(p)
            needed = ("step", "exp_avg", "exp_avg_sq") if self._book.is_adam else ()
            lacking = [name for name in needed if name not in entry]
            if lacking:
                raise ValueError(
                    f"optimizer state of parameter '{record.slot.name}' lacks {lacking} (it has {sorted(entry)})."
                    " HINT: the checkpoint is damaged or was edited; use another checkpoint."
                )
            for name, value in entry.items():
                if not isinstance(value, torch.Tensor) and name != "step":
                    if name == "momentum_buffer" and value is None:
                        continue
                    raise ValueError(f"optimizer state '{name}' of parameter '{record.slot.name}' is not a tensor.")
                if name != "step" and tuple(value.shape) != tuple(record.slot.shape):
                    raise ValueError(
                        f"optimizer state '{name}' of parameter '{record.slot.name}' has shape"
                        f" {tuple(value.shape)}, expected {tuple(record.slot.shape)}."
                    )
            updates.append((record, entry))
        return groups, updates, host_updates

    def check_groups(self, groups: list[Any]) -> None:
        """Refuse saved param groups that are not this optimizer's (their number, and each one's size)."""
        if len(groups) != len(self._param_groups):
            raise ValueError(
                f"optimizer state has {len(groups)} param groups, this optimizer has {len(self._param_groups)}."
                " HINT: build the same param groups (in `configure_optimizers`; under Fabric, in the optimizer given to"
                " `fabric.setup`) as the run that saved it."
            )
        for gi, (saved, mine) in enumerate(zip(groups, self._param_groups, strict=True)):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(
                    f"param group {gi}: the saved state has {len(saved['params'])} parameters, this optimizer"
                    f" has {len(mine['params'])}."
                )
            flags = [k for k in ("amsgrad", "capturable", "differentiable") if saved.get(k)]
            if flags:  # refused at setup too: the fused chunk kernels cannot honour them
                raise ValueError(
                    f"param group {gi} of the saved state has {', '.join(f'{k}=True' for k in flags)}, which"
                    " PatrickStar's fused chunk kernels do not support (torch would switch to it). HINT: resume with"
                    " a plain optimizer (another checkpoint, or resume under another strategy)."
                )
            if not self._book.is_adam and saved.get("momentum", 0) != 0 and not self._has_momentum:
                raise ValueError(
                    f"param group {gi} of the saved state has momentum={saved['momentum']}, but this SGD was built"
                    " with momentum=0 in every group, so no momentum buffers were laid out. HINT: build the SGD with"
                    " the momentum the checkpoint was trained with."
                )

    def _load_record(self, record: ParamRecord, entry: dict[str, Any]) -> None:
        family = record.family
        if "exp_avg" in entry:
            family.chunks[ChunkKind.EXP_AVG].slot_view(record.slot).copy_(entry["exp_avg"])
            family.chunks[ChunkKind.EXP_AVG_SQ].slot_view(record.slot).copy_(entry["exp_avg_sq"])
            device = family.chunks[ChunkKind.EXP_AVG].data.device
            self._book.steps[record.index] = torch.as_tensor(entry["step"], dtype=torch.float32).to(device).clone()
        if "momentum_buffer" in entry and entry["momentum_buffer"] is not None:
            family.chunks[ChunkKind.EXP_AVG].slot_view(record.slot).copy_(entry["momentum_buffer"])
            self._book.momentum_started.add(record.index)
