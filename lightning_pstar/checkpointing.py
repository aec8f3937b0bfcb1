"""The checkpoint steps both glues call: crash-safe IO, sharded saves and loads, checks before any change.

:class:`SafeCheckpointIO` is the ``CheckpointIO`` of both strategies (the Trainer's and Fabric's). The functions
below are the strategies' checkpoint methods with the Lightning plumbing taken out: what to gather, what to
write, what to check before the model or an optimizer changes. The formats are those of
:mod:`lightning_pstar.checkpoint` (consolidated files are ordinary torch checkpoints; a sharded checkpoint is a
directory with a ``torch.distributed.checkpoint`` store in which every rank writes what it owns).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from lightning_pstar.checkpoint import (
    INFO_KEY,
    SHARDED_KEY,
    CheckpointError,
    is_sharded_checkpoint,
    load_checkpoint_file,
    load_full_state_dict,
    load_owned_tensors,
    owned_tensors,
    read_sharded_meta,
    read_sharded_tensors,
    remove_checkpoint_path,
    remove_leftovers,
    restore_set_aside,
    save_checkpoint_file,
    sharded_info,
    sharded_meta,
    stored_keys,
    write_sharded,
)
from lightning_pstar.checkpoint.placeholders import is_placeholder, store_key_of, with_placeholders
from lightning_pstar.optim import ChunkedOptimizer
from lightning_pstar.optim.state_dict import check_optimizer_class
from lightning_pstar.runtime.manager import ChunkManager

__all__ = [
    "sharded_entries_with_placeholders",
    "SafeCheckpointIO",
    "refuse_io_sharded_bypasses",
    "check_optimizer_groups",
    "check_optimizer_states",
    "load_model_state",
    "load_sharded_optimizer_states",
    "open_checkpoint",
    "refuse_bare_state_dict",
    "write_sharded_checkpoint",
]


# [Note: the checkpoint IO]
# Both strategies save and load through SafeCheckpointIO (atomic, checksummed) unless the user gives another
# CheckpointIO, to the strategy or, as with Lightning's own strategies, in ``plugins`` (Lightning refuses one given
# both ways, so the strategies hold none until asked: ``EngineAccess.checkpoint_io`` in glue.py makes the
# default then). A wrapping IO given without its base (``AsyncCheckpointIO()``) writes through SafeCheckpointIO,
# where Lightning's own strategies would give it a plain TorchCheckpointIO. ``checkpoint="sharded"`` writes every
# rank's part with ``torch.distributed.checkpoint`` and reads it back the same way, through no CheckpointIO: a
# user's IO would be silently bypassed, so that pair is refused at setup (:func:`refuse_io_sharded_bypasses`).


def refuse_io_sharded_bypasses(io: CheckpointIO, *, sharded: bool) -> None:
    """Refuse, before anything changes, a user's CheckpointIO that ``checkpoint="sharded"`` would never call."""
    if not sharded or type(io) is SafeCheckpointIO:
        return
    base = getattr(io, "checkpoint_io", None)  # a wrapping IO (AsyncCheckpointIO): name what it wraps
    what = type(io).__name__ + (f"({type(base).__name__})" if base is not None and base is not io else "")
    raise ValueError(
        f"PatrickStar: checkpoint='sharded' writes each rank's part with torch.distributed.checkpoint, not through"
        f" a CheckpointIO, so the checkpoint IO {what} given to the run would never be called. HINT: use"
        " checkpoint='consolidated' to save through it (one ordinary file, written by rank 0), or drop the"
        " checkpoint_io (strategy argument or Trainer/Fabric `plugins`) to keep sharded checkpoints."
    )


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint IO with atomic writes and clear errors on unreadable files.

    A process killed in the middle of a save leaves the previous checkpoint intact, and a sharded checkpoint
    directory loads as its checkpoint dict (the tensors stay in the store); see :mod:`lightning_pstar.checkpoint`.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        save_checkpoint_file(checkpoint, path)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        target = Path(path)
        restore_set_aside(target)  # a sharded save killed mid-publish: [Note: publishing] in checkpoint/io.py
        if is_sharded_checkpoint(target):
            return read_sharded_meta(target)
        return load_checkpoint_file(target, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        remove_checkpoint_path(path)


def chunked_of(optimizer: Any) -> ChunkedOptimizer | None:
    """The chunked optimizer behind a Lightning or Fabric wrapper (None for any other optimizer)."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    return inner if isinstance(inner, ChunkedOptimizer) else None


def write_sharded_checkpoint(
    manager: ChunkManager,
    optimizers: Sequence[Any],
    checkpoint: dict[str, Any],
    path: Path,
    *,
    rank: int,
    barrier: Callable[[], None],
) -> None:
    """Write ``checkpoint`` (Lightning's layout: ``optimizer_states`` in the order of ``optimizers``) as a sharded
    directory; every rank writes the weights and optimizer states it owns. Called on every rank."""
    tensors = owned_tensors(manager)
    for k, opt in enumerate(optimizers):
        chunked = chunked_of(opt)
        if chunked is not None:
            tensors.update(chunked.owned_state_tensors(f"optim/{k}/"))
    info = sharded_info(manager)
    entries = checkpoint.get("state_dict", {})
    if any(is_placeholder(v) for v in entries.values()):  # the weight names as the hooks left them ([Note: weights
        # in a sharded checkpoint dict] in checkpoint/placeholders.py); the stand-ins reach no file
        info["state_dict_keys"] = list(entries)
        info["canonical"] = {k: store_key_of(v)[len("model/") :] for k, v in entries.items() if is_placeholder(v)}
        info["dtypes"] = {k: str(v.dtype).replace("torch.", "") for k, v in entries.items() if is_placeholder(v)}
        checkpoint = {**checkpoint, "state_dict": {k: v for k, v in entries.items() if not is_placeholder(v)}}
    meta = sharded_meta(checkpoint, info)
    write_sharded(path, meta=meta, tensors=tensors, rank=rank, barrier=barrier)


def open_checkpoint(
    path: Path,
    io: Any,
    *,
    is_global_zero: bool,
    barrier: Callable[[], None],
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Read a checkpoint (a sharded directory reads as its metadata), after rank 0 removed what killed saves
    left beside it (only this package's entries). Called on every rank."""
    if is_global_zero:
        remove_leftovers(path.parent)
    barrier()
    return io.load_checkpoint(path, weights_only=weights_only)


def refuse_bare_state_dict(checkpoint: Mapping[str, Any], path: Path) -> None:
    """A Trainer ``ckpt_path`` must be a Lightning checkpoint, not a bare ``state_dict`` of tensors."""
    if "state_dict" not in checkpoint and checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        raise CheckpointError(
            f"'{path}' holds a bare state_dict ({len(checkpoint)} tensors), not a Lightning checkpoint."
            " HINT: load the weights before fit (`model.load_state_dict(torch.load(path))`) and call fit"
            " without ckpt_path; ckpt_path takes a file written by trainer.save_checkpoint or ModelCheckpoint."
        )


def _saved_optimizers(checkpoint: Mapping[str, Any]) -> list[tuple[set[str], list[Any]]]:
    """(state fields, param groups) of each optimizer in a checkpoint in Lightning's layout."""
    if checkpoint.get(SHARDED_KEY):
        stored = stored_keys(Path(checkpoint[SHARDED_KEY]))
        groups = checkpoint[INFO_KEY]["param_groups"]
        return [
            ({key.rsplit("/", 1)[1] for key in stored if key.startswith(f"optim/{k}/")}, groups[k])
            for k in range(len(groups))
        ]
    return [
        ({f for entry in opt["state"].values() for f in entry}, opt["param_groups"])
        for opt in checkpoint.get("optimizer_states", [])
        if isinstance(opt, Mapping) and isinstance(opt.get("state"), Mapping)
    ]


def check_optimizer_states(optimizers: Sequence[Any], checkpoint: Mapping[str, Any]) -> None:
    """Refuse optimizer states of another optimizer class (Lightning's layout) before anything changes."""
    for k, (opt, (fields, groups)) in enumerate(zip(optimizers, _saved_optimizers(checkpoint), strict=False)):
        chunked = chunked_of(opt)
        user = chunked.user_optimizer if chunked is not None else opt
        check_optimizer_class(user, fields, groups, f"optimizer {k} state in the checkpoint")


def check_optimizer_groups(optimizers: Sequence[Any], checkpoint: Mapping[str, Any]) -> None:
    """Refuse optimizer states of other param groups (their number or sizes) before the model's weights change:
    run as ``checked`` of :func:`load_model_state`, once the model's names and shapes are known to match (a
    checkpoint of another model is named as that, not as other groups)."""
    states = None if checkpoint.get(SHARDED_KEY) else checkpoint.get("optimizer_states")
    for k, (opt, (_, groups)) in enumerate(zip(optimizers, _saved_optimizers(checkpoint), strict=False)):
        chunked = chunked_of(opt)
        if chunked is not None:
            try:
                if states is not None:  # the whole state is here: every entry is checked (fields, shapes) too
                    chunked.state_io.validated(states[k])
                else:
                    chunked.state_io.check_groups(groups)
            except ValueError as err:
                raise ValueError(f"optimizer {k} state in the checkpoint: {err}") from err  # named by the caller


def load_model_state(
    manager: ChunkManager,
    checkpoint: Mapping[str, Any],
    *,
    strict: bool,
    source: Any,
    before: Callable[[], None] = lambda: None,
    checked: Callable[[], None] = lambda: None,
) -> None:
    """Load the weights of a checkpoint in Lightning's layout (``state_dict``, or a sharded store) into the
    chunks. ``before`` runs the caller's own checks first, ``checked`` once the model's names and shapes match
    (before any write); a mismatch raises a :class:`CheckpointError` naming ``source``."""
    try:
        before()
        if checkpoint.get(SHARDED_KEY):
            path = Path(checkpoint[SHARDED_KEY])
            load_owned_tensors(
                manager,
                stored_keys(path),
                lambda wanted: read_sharded_tensors(path, wanted),
                checkpoint.get("state_dict", {}),
                strict=strict,
                checked=checked,
            )
            return
        load_full_state_dict(manager, checkpoint["state_dict"], strict=strict, checked=checked)
    except (KeyError, ValueError) as err:
        message = err.args[0] if err.args else str(err)
        raise CheckpointError(f"cannot load '{source}': {message}") from err


def load_sharded_optimizer_states(optimizers: Sequence[Any], checkpoint: Mapping[str, Any]) -> None:
    """Load every chunked optimizer's states from a sharded checkpoint (this rank's share)."""
    path = Path(checkpoint[SHARDED_KEY])
    stored = stored_keys(path)
    groups = checkpoint[INFO_KEY]["param_groups"]
    for k, opt in enumerate(optimizers):
        chunked = chunked_of(opt)
        if chunked is not None:
            chunked.load_owned_state(
                stored, f"optim/{k}/", lambda wanted: read_sharded_tensors(path, wanted), groups[k]
            )


def sharded_entries_with_placeholders(checkpoint: dict[str, Any], manager: ChunkManager | None = None) -> None:
    """Give a sharded checkpoint dict a stand-in per weight in ``state_dict`` (its metadata's names, or, on save with
    ``manager``, the model's), for the Trainer's hooks to edit ([Note: weights in a sharded checkpoint dict])."""
    entries = checkpoint.get("state_dict", {})
    if manager is not None:
        info = sharded_info(manager)
        shapes: dict[str, Any] = {f"model/{r.names[0]}": r.slot.shape for r in manager.records}
        shapes.update({f"model/{n}": p.shape for n, p in manager.host_params.items()})
    else:
        info = checkpoint[INFO_KEY]
        shapes = stored_keys(Path(checkpoint[SHARDED_KEY]))
    checkpoint["state_dict"] = with_placeholders(
        entries, info["state_dict_keys"], info["canonical"], shapes, info["dtypes"]
    )
