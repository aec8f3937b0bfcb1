"""Weights autograd saves for backward, kept by reference: the saved-tensor hooks of a training forward.

[Note: saved weights]
A module's own parameters are saved by autograd as views of the device buffer while the module computes;
its pre-backward hook makes the chunk resident again in the same storage (the storage-identity note in
``chunk.py``). A weight used *outside* its module (``F.linear(x, self.emb.weight)`` in a parent's forward,
a hand-tied output projection) has no such hook: its chunk may be on HOST when the weight is saved (the
fetch back frees the host storage) or evicted before the backward that reads it. So during a training
forward one ``saved_tensors_hooks`` pair (which also does the warm-up's accounting of non-model memory)
packs a saved tensor that is a chunk-backed parameter, or a view of one (``W.t()``), whose slot is not in
``COMPUTE`` as a reference to its :class:`ParamRecord` and geometry (a dict lookup by id per saved tensor).
Unpacking makes the chunk resident on the device (the manager's ``fetch``) and returns the same view of the
device buffer; the backward node uses it at once and drops it. Other chunks the same node unpacked are
protected from eviction meanwhile. The weight cannot change in between: its gradient becomes final (the
slot then holds it in mixed precision) only after every node that saved it has run, a slot holding the
gradient is read from the fp32 master, and an optimizer step or load in between raises (as plain PyTorch
raises for a weight modified in place). With several ranks a chunk is gathered only while one of its
modules runs, so such a use is refused with an error naming the parameter.

The same pair of hooks counts every other saved tensor for the warm-up's accounting of non-model memory
(``manager.tracer``), and checks, for the tensors it keeps as autograd would, autograd's own in-place rule (which
hooks turn off).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.disk_tier import disk_loaded
from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.state import TensorState

__all__ = ["SavedWeights"]


@dataclass(frozen=True, slots=True)
class _SavedWeight:
    """What autograd keeps of a saved chunk-backed weight: its record and its view of the slot."""

    record: ParamRecord
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # storage offset in the chunk buffer (the same on both tiers)
    dtype: torch.dtype
    weights_version: int  # the manager's weights_version when saved (the engine's writes: steps, loads)
    version: int  # the parameter's own version counter when saved (the user's in-place writes)
    bumps: int  # the record's engine_bumps when saved (the engine's own version bumps)

    def __del__(self) -> None:  # autograd dropped it: one saved read less of the family's param chunk
        if self.record.trainable:
            self.record.family.dropped_params += 1


@dataclass(frozen=True, slots=True)
class _Saved:
    """Any other saved tensor, kept as autograd keeps it without hooks."""

    tensor: torch.Tensor  # detached when it has a grad_fn: an output saved as itself would make a reference
    # cycle through it, and a graph dropped without backward would never be freed. A leaf (a parameter) is
    # kept itself, as autograd keeps it: it reads the tier its chunk is on when unpacked.
    version: int  # its version counter when saved: autograd's in-place check, which hooks turn off
    token: Any  # the warm-up's accounting of non-model memory (None when not counted)


@dataclass(frozen=True, slots=True)
class _SavedParam(_Saved):
    """A trainable parameter (or a view of one) saved while its module computes, counted on its family while
    autograd keeps it ([Note: copies back inside the backward] in ``optim/overlap.py``)."""

    family: ChunkFamily
    record: ParamRecord | None  # the parameter it is (a view of), None for a tensor that only shares its bytes
    bumps: int  # the record's engine_bumps when saved

    def __del__(self) -> None:
        self.family.dropped_params += 1


def _restored(record: ParamRecord, version: int, bumps: int) -> bool:
    """Whether every change to ``record``'s version counter since a tensor was saved (at ``version``, ``bumps``) was
    the engine's (its gradient replacing the weight in the slot) and the slot holds the weight again (put back from the
    fp32 master by a carry-over): the saved tensor reads what it saved."""
    return record.param._version - version == record.engine_bumps - bumps and not record.grad_in_param_slot


def _slot_holds_gradient(record: ParamRecord | None, version: int, bumps: int) -> bool:
    """Whether every change to ``record``'s version counter since a tensor was saved was the engine's and the slot
    holds the gradient now (mixed precision's chunk reuse): a backward through a retained graph reads it again."""
    return (
        record is not None
        and record.grad_in_param_slot
        and record.param._version - version == record.engine_bumps - bumps
    )


def _read_after_reuse(record: ParamRecord) -> RuntimeError:
    return RuntimeError(
        f"PatrickStar: the weight '{record.names[0]}' saved for backward was read again after its backward ran (a"
        " second backward through a graph kept with `retain_graph=True`, or `torch.autograd.grad` after it). In mixed"
        " precision the engine writes each gradient into its weight's compute-dtype slot when the backward is done"
        " with it (chunk reuse), so that weight is gone until the step. HINT: run one backward per forward (add the"
        " losses first: `(loss_a + loss_b).backward()`), or train in 32-true, where the gradient has its own chunk."
    )


def _modified_in_place(tensor: torch.Tensor, saved: int, now: int) -> RuntimeError:
    # autograd's own message (it does not check tensors packed by hooks, so this check stands in for it)
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation:"
        f" [{tensor.dtype} {list(tensor.shape)}] is at version {now}; expected version {saved} instead. HINT: do not"
        " modify in place a tensor (or a weight) that the forward used before its backward has run."
    )


class SavedWeights:
    """The saved-tensor hooks of one model's training forwards ([Note: saved weights])."""

    def __init__(self, manager: ChunkManager, eager: Callable[[Any], Any]) -> None:
        self.manager = manager
        # autograd calls these from inside a compiled forward: dynamo must not trace them as frames ([Note: hooks
        # under torch.compile] in hooks.py)
        self._eager_pack = eager(self.pack)
        self._eager_unpack = eager(self.unpack)
        self._unpack_node: Any = None  # the autograd node unpacking saved weights now (held until the next)
        self._unpack_pins: set[int] = set()  # families it read from: not evicted while it runs
        self._aliases: dict[int, ChunkFamily] | None = None  # param chunks' device storages (built at the first pack)

    def hooks(self) -> AbstractContextManager[None]:
        """The hooks around one training forward (the last forward's unpacking node is forgotten)."""
        self.release()
        return torch.autograd.graph.saved_tensors_hooks(self._eager_pack, self._eager_unpack)

    def release(self) -> None:
        """Forget the node unpacking now and the families it protects from eviction."""
        self._unpack_node = None
        self._unpack_pins = set()

    def pack(self, tensor: torch.Tensor) -> Any:
        lookup = self.manager.table.by_id.get  # the record of a managed parameter by identity (hot path)
        record = lookup(id(tensor))
        owner: torch.Tensor | None = tensor
        if record is None:
            owner = tensor._base
            record = lookup(id(owner)) if owner is not None else None
        if record is not None and record.param is owner:
            packed = self.pack_weight(record, tensor)
            if packed is not None:
                if record.trainable:
                    record.family.saved_params += 1  # dropped again in _SavedWeight.__del__
                return packed
            family = record.family if record.trainable else None
        else:  # not a parameter or a view of one, but it may share a param chunk's bytes (``weight.detach()``)
            family = self.alias_of(tensor)
            record = None
        tracer = self.manager.tracer
        saved = tensor.detach() if tensor.requires_grad and not tensor.is_leaf else tensor
        token = tracer.count(saved) if tracer.counting else None
        if family is not None:
            family.saved_params += 1  # dropped again in _SavedParam.__del__
            return _SavedParam(saved, tensor._version, token, family, record, record.engine_bumps if record else 0)
        return _Saved(saved, tensor._version, token)

    def alias_of(self, tensor: torch.Tensor) -> ChunkFamily | None:
        """The trainable family whose param chunk's device storage ``tensor`` shares, if any (a chunk keeps one
        storage object per tier for its life: [Note: storage identity] in ``chunk.py``)."""
        aliases = self._aliases
        if aliases is None:
            aliases = self._aliases = {
                f.param_chunk.device_buffer.untyped_storage()._cdata: f for f in self.manager.families if f.trainable
            }
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # a tensor without a storage of its own (a subclass, sparse)
            return None
        return aliases.get(key)

    def pack_weight(self, record: ParamRecord, tensor: torch.Tensor) -> _SavedWeight | None:
        manager = self.manager
        if record.slot.state is TensorState.COMPUTE:
            return None  # its module computes: the module's own hooks bring it back (storage identity)
        if manager.sharding.distributed:
            names = ", ".join(f"'{n}'" for n in record.names)
            raise RuntimeError(
                f"Parameter {names} is used outside the module that owns it (e.g. `F.linear(x,"
                " self.emb.weight)` in a parent's forward) and autograd saves it for backward. With several"
                " ranks its chunk is gathered only while one of its modules runs, so this use is not"
                " supported. HINT: use the weight through a module (tie it with `head.weight = emb.weight`"
                " and call `head(x)`), or train on one rank."
            )
        chunk = record.family.param_chunk
        if record.grad_in_param_slot or tensor.dtype != chunk.dtype:
            return None  # not a view of the param chunk (the parameter reads its master now)
        return _SavedWeight(
            record=record,
            size=tuple(tensor.size()),
            stride=tuple(tensor.stride()),
            offset=int(tensor.storage_offset()),
            dtype=tensor.dtype,
            weights_version=manager.weights_version,
            version=tensor._version,
            bumps=record.engine_bumps,
        )

    def unpack(self, packed: _Saved | _SavedWeight) -> torch.Tensor:
        if isinstance(packed, _Saved):
            tensor = packed.tensor
            if tensor._version != packed.version and not (
                isinstance(packed, _SavedParam)
                and packed.record is not None
                and _restored(packed.record, packed.version, packed.bumps)
            ):
                if isinstance(packed, _SavedParam) and packed.record is not None:
                    if _slot_holds_gradient(packed.record, packed.version, packed.bumps):
                        raise _read_after_reuse(packed.record)
                raise _modified_in_place(tensor, packed.version, tensor._version)
            return tensor
        manager = self.manager
        record = packed.record
        now = record.param._version
        # the engine's bump (the gradient replaced the weight in its slot), no write; or that bump and the weight put
        # back ([Note: a forward after the gradient] in late_gradients.py)
        replaced = packed.version == record.replaced_at and (
            now == packed.version + 1 or _restored(record, packed.version, packed.bumps)
        )
        if now != packed.version and not replaced:  # (an optimizer step since: the weights_version check below)
            if _slot_holds_gradient(record, packed.version, packed.bumps):
                raise _read_after_reuse(record)
            raise _modified_in_place(record.param, packed.version, now)
        if packed.weights_version != manager.weights_version:
            raise RuntimeError(
                f"Parameter '{record.names[0]}' was saved for backward and has changed since (an optimizer step"
                " or a checkpoint load ran between this forward and its backward). HINT: call backward before"
                " the optimizer steps, as plain PyTorch requires for weights modified in place."
            )
        family = record.family
        slot = record.slot
        if record.grad_in_param_slot:
            # the gradient is final already (a graph run backward twice): the weight is the fp32 master's
            with disk_loaded(manager.disk, family, write=False, kinds=(ChunkKind.MASTER,)):  # [Note: disk families]
                master = family.chunks[ChunkKind.MASTER].slot_view(slot).reshape(-1)
                flat = master.to(device=manager.device, dtype=packed.dtype, copy=True)
            return flat.as_strided(packed.size, packed.stride, packed.offset - slot.offset)
        node = torch._C._current_autograd_node()
        if node is not self._unpack_node:  # a new node: the views the last one read are dropped
            self._unpack_node = node
            self._unpack_pins = set()
        manager.residency.fetch(family, protect=self._unpack_pins)
        self._unpack_pins.add(family.family_id)
        return family.param_chunk.data.as_strided(packed.size, packed.stride, packed.offset)
