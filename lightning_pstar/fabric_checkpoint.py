"""``fabric.save`` / ``fabric.load`` with the PatrickStar Fabric strategy: the user's layout, the same formats.

A consolidated checkpoint is what plain Fabric writes: the user's dict with the model's ``state_dict`` (fp32,
the model's own names) and torch's optimizer layout under the user's keys, so ``torch.load(path)["model"]``
loads into a plain module with ``load_state_dict(strict=True)``. It is written by rank 0 through
:class:`~lightning_pstar.checkpointing.SafeCheckpointIO` (atomic, checksummed).

A sharded checkpoint (``checkpoint="sharded"``) is the Trainer strategy's directory
(:mod:`lightning_pstar.checkpoint.sharded`): every rank writes what it owns, ``meta.pt`` holds Lightning's
layout (``state_dict`` with the buffers, ``optimizer_states`` with the groups) plus the user's other entries
and :data:`FABRIC_KEYS`, which names the user's keys of the model and the optimizers. So the Trainer strategy
loads it as its own, ``python -m lightning_pstar.consolidate`` turns it into one file, and this module loads
both back into the user's objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from lightning_pstar.checkpoint import INFO_KEY, SHARDED_KEY, CheckpointError, stored_keys
from lightning_pstar.checkpointing import (
    chunked_of,
    load_model_state,
    load_sharded_optimizer_states,
    open_checkpoint,
    write_sharded_checkpoint,
)
from lightning_pstar.optim import ChunkedOptimizer
from lightning_pstar.optim.state_dict import check_optimizer_class

if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO

    from lightning_pstar.runtime.manager import ChunkManager


class _FabricHost(Protocol):
    """What the checkpoint steps use of the Fabric strategy (``lightning_pstar.fabric``, which imports this
    module: the dependency runs one way)."""

    @property
    def chunk_manager(self) -> ChunkManager: ...
    @property
    def checkpoint_io(self) -> CheckpointIO: ...
    @property
    def is_global_zero(self) -> bool: ...
    @property
    def global_rank(self) -> int: ...
    def barrier(self, *args: Any, **kwargs: Any) -> None: ...
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None: ...
    def _managed(self, obj: Any) -> bool: ...
    def _convert_stateful_objects_in_state(self, state: dict[str, Any], filter: Any) -> dict[str, Any]: ...


__all__ = ["FABRIC_KEYS", "load_fabric_checkpoint", "save_fabric_checkpoint"]

FABRIC_KEYS = "pstar_fabric_keys"  # {"module": user's key or None, "optimizers": [user's keys]} in a sharded meta
_RESERVED = ("state_dict", "optimizer_states", FABRIC_KEYS, SHARDED_KEY, INFO_KEY)


def _param_groups(optimizer: ChunkedOptimizer) -> list[dict[str, Any]]:
    """torch's packed ``param_groups`` (parameters by index), without gathering any state."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        groups.append(packed)
    return groups


def save_fabric_checkpoint(strategy: _FabricHost, path: Path, state: Mapping[str, Any], *, filter: Any | None) -> None:
    """Write a sharded checkpoint of ``state`` (called on every rank)."""
    if filter:
        raise ValueError(
            "`fabric.save(..., filter=...)` is not supported with checkpoint='sharded' (every rank writes whole"
            " parameters it owns). HINT: save consolidated (PatrickStarFabricStrategy(checkpoint='consolidated')) or"
            " without a filter."
        )
    module_keys = [k for k, v in state.items() if strategy._managed(v)]
    opt_keys = [k for k, v in state.items() if chunked_of(v) is not None]
    if len(module_keys) > 1:
        raise ValueError(f"`fabric.save` got the model under several keys {module_keys}. HINT: save it once.")
    clash = sorted(k for k in state if k in _RESERVED and k not in module_keys)
    if clash:
        raise ValueError(
            f"`fabric.save` keys {clash} are reserved by PatrickStar's sharded checkpoints. HINT: rename them."
        )
    optimizers = [chunked_of(state[k]) for k in opt_keys]
    rest = {k: v for k, v in state.items() if k not in module_keys and k not in opt_keys}
    checkpoint = strategy._convert_stateful_objects_in_state(rest, filter={})
    manager = strategy.chunk_manager
    buffers = {k: v.detach().cpu() for k, v in manager.module.named_buffers()}
    checkpoint["state_dict"] = buffers if module_keys else {}
    checkpoint["optimizer_states"] = [{"state": {}, "param_groups": _param_groups(opt)} for opt in optimizers if opt]
    checkpoint[FABRIC_KEYS] = {"module": module_keys[0] if module_keys else None, "optimizers": opt_keys}
    write_sharded_checkpoint(manager, optimizers, checkpoint, path, rank=strategy.global_rank, barrier=strategy.barrier)


def _to_fabric_layout(checkpoint: dict[str, Any], keys: Mapping[str, Any]) -> dict[str, Any]:
    """A consolidated sharded checkpoint (Lightning's layout) back under the user's keys."""
    out = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    if keys.get("module") is not None:
        out[keys["module"]] = checkpoint["state_dict"]
    for key, osd in zip(keys.get("optimizers", []), checkpoint.get("optimizer_states", []), strict=False):
        out[key] = osd
    return out


def _check_optimizers(state: Mapping[str, Any], checkpoint: Mapping[str, Any], keys: Any, sharded: bool) -> None:
    """Refuse optimizer states of another optimizer class before the model or any optimizer changes."""
    if sharded:
        stored = stored_keys(Path(checkpoint[SHARDED_KEY]))
        groups = checkpoint[INFO_KEY]["param_groups"]
        for k, key in enumerate(keys["optimizers"]):
            chunked = chunked_of(state.get(key))
            if chunked is not None:
                fields = {s.rsplit("/", 1)[1] for s in stored if s.startswith(f"optim/{k}/")}
                check_optimizer_class(chunked.user_optimizer, fields, groups[k], f"optimizer '{key}' in the checkpoint")
        return
    for key, obj in state.items():
        chunked = chunked_of(obj)
        saved = checkpoint.get(key)
        if chunked is not None and isinstance(saved, Mapping) and isinstance(saved.get("state"), Mapping):
            fields = {f for entry in saved["state"].values() for f in entry}
            check_optimizer_class(
                chunked.user_optimizer, fields, saved.get("param_groups", []), f"optimizer '{key}' in the checkpoint"
            )


def _check_groups(state: Mapping[str, Any], checkpoint: Mapping[str, Any], keys: Any, sharded: bool) -> None:
    """Refuse optimizer states of other param groups; run once the model's names and shapes match, before its
    weights change (``checked`` of ``load_model_state``)."""
    if sharded:
        saved = checkpoint[INFO_KEY]["param_groups"]
        pairs = [(key, saved[k]) for k, key in enumerate(keys["optimizers"])]
    else:
        pairs = [
            (key, checkpoint[key].get("param_groups", [])) for key in state if isinstance(checkpoint.get(key), Mapping)
        ]
    for key, groups in pairs:
        chunked = chunked_of(state.get(key))
        if chunked is not None:
            try:
                if not sharded:  # the whole state is here: every entry is checked (fields, shapes) too
                    chunked.state_io.validated(checkpoint[key])
                else:
                    chunked.state_io.check_groups(groups)
            except ValueError as err:
                raise ValueError(f"optimizer '{key}' in the checkpoint: {err}") from err


def load_fabric_checkpoint(
    strategy: _FabricHost,
    path: Path,
    state: nn.Module | Optimizer | dict[str, Any] | None,
    *,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Load a consolidated or sharded checkpoint into ``state`` (called on every rank); returns what is left."""
    manager = strategy.chunk_manager
    checkpoint = open_checkpoint(
        path,
        strategy.checkpoint_io,
        is_global_zero=strategy.is_global_zero,
        barrier=strategy.barrier,
        weights_only=weights_only,
    )
    sharded = bool(checkpoint.get(SHARDED_KEY))
    keys = checkpoint.pop(FABRIC_KEYS, None)
    if not sharded and keys is not None:
        checkpoint = _to_fabric_layout(checkpoint, keys)
    if sharded and (not isinstance(state, dict) or not state):
        raise CheckpointError(
            f"'{path}' is a sharded checkpoint: its tensors load into the objects they belong to. HINT: pass them,"
            " `fabric.load(path, {'model': model, 'optimizer': optimizer})`, or consolidate it into one file"
            " with `python -m lightning_pstar.consolidate DIR OUT`."
        )
    if not state:
        return checkpoint
    if isinstance(state, (nn.Module, Optimizer)):
        if isinstance(state, nn.Module):
            strategy.load_module_state_dict(state, checkpoint, strict=strict)
        else:
            state.load_state_dict(checkpoint)
        return {}
    available = _available_keys(checkpoint, keys, sharded)
    _validate_keys_for_strict_loading(state.keys(), available, strict=strict)
    module_key = next((k for k, v in state.items() if strategy._managed(v) and k in available), None)
    opt_keys = [k for k, v in state.items() if chunked_of(v) is not None and k in available]
    try:
        _check_optimizers(state, checkpoint, keys, sharded)
    except (KeyError, ValueError) as err:
        raise CheckpointError(f"cannot load '{path}': {err.args[0] if err.args else err}") from err
    if module_key is not None:
        model_state = checkpoint if sharded else {"state_dict": checkpoint.pop(module_key)}
        load_model_state(
            manager,
            model_state,
            strict=strict,
            source=path,
            checked=lambda: _check_groups(state, checkpoint, keys, sharded),
        )
    if sharded:
        load_sharded_optimizer_states([state.get(k) for k in keys["optimizers"]], checkpoint)
    else:
        for key in opt_keys:
            chunked = chunked_of(state[key])
            assert chunked is not None
            try:
                chunked.load_state_dict(checkpoint.pop(key))
            except (KeyError, ValueError) as err:
                raise CheckpointError(f"cannot load '{path}' into optimizer '{key}': {err}") from err
    _load_the_rest(strategy, state, checkpoint, skip={module_key, *opt_keys}, strict=strict)
    return {k: v for k, v in checkpoint.items() if k not in _RESERVED}


def _available_keys(checkpoint: Mapping[str, Any], keys: Any, sharded: bool) -> set[str]:
    """The user's keys a checkpoint holds (a sharded one keeps its model and optimizers under their own)."""
    if not sharded:
        return set(checkpoint)
    available = {k for k in checkpoint if k not in _RESERVED} | set((keys or {}).get("optimizers", []))
    module_key = (keys or {}).get("module")
    if module_key is not None:
        available.add(str(module_key))
    return available


def _load_the_rest(
    strategy: _FabricHost,
    state: dict[str, Any],
    checkpoint: dict[str, Any],
    *,
    skip: set[str | None],
    strict: bool,
) -> None:
    """Everything but the set-up model and optimizers: other modules and stateful objects load their state,
    plain values are replaced (as plain Fabric does); what is loaded leaves ``checkpoint``."""
    for name, obj in list(state.items()):
        if name in skip or name not in checkpoint or name in _RESERVED:
            continue
        if isinstance(obj, _Stateful):
            if isinstance(obj, nn.Module):
                strategy.load_module_state_dict(obj, checkpoint.pop(name), strict=strict)
            else:
                obj.load_state_dict(checkpoint.pop(name))
        else:
            state[name] = checkpoint.pop(name)
