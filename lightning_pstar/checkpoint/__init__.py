"""Checkpoints: crash-safe files, sharded stores (torch.distributed.checkpoint), model and optimizer state.

- ``io``: atomic writes, checked loads whose errors name the file, removal of what killed saves left behind
  (the Lightning ``CheckpointIO`` built on them lives in ``lightning_pstar/checkpointing.py``);
- ``integrity``: the checksums every checkpoint file carries, checked before it is read;
- ``sharded``: the directory every rank writes in parallel, and ``consolidate`` (``cli``: its command);
- ``model_state``: consolidated and sharded model state over the manager's parameter table.

Consolidated checkpoints are ordinary Lightning checkpoints (the model's own parameter names, fp32 weights,
torch's optimizer layout), gathered family by family to rank 0.
"""

from lightning_pstar.checkpoint.cli import main
from lightning_pstar.checkpoint.io import (
    CheckpointError,
    load_checkpoint_file,
    remove_checkpoint_path,
    remove_leftovers,
    restore_set_aside,
    save_checkpoint_file,
)
from lightning_pstar.checkpoint.model_state import (
    drop_weights,
    family_values,
    full_state_dict,
    load_full_state_dict,
    load_owned_tensors,
    master_view,
    owned_tensors,
    restore_family,
    restore_module,
    sharded_info,
)
from lightning_pstar.checkpoint.sharded import (
    INFO_KEY,
    META_FILENAME,
    SHARDED_KEY,
    consolidate,
    is_sharded_checkpoint,
    read_sharded_meta,
    read_sharded_tensors,
    sharded_meta,
    stored_keys,
    write_sharded,
)

__all__ = [
    "INFO_KEY",
    "META_FILENAME",
    "SHARDED_KEY",
    "CheckpointError",
    "consolidate",
    "drop_weights",
    "family_values",
    "full_state_dict",
    "is_sharded_checkpoint",
    "load_checkpoint_file",
    "load_full_state_dict",
    "load_owned_tensors",
    "main",
    "master_view",
    "owned_tensors",
    "read_sharded_meta",
    "read_sharded_tensors",
    "remove_checkpoint_path",
    "remove_leftovers",
    "restore_set_aside",
    "restore_family",
    "restore_module",
    "save_checkpoint_file",
    "sharded_info",
    "sharded_meta",
    "stored_keys",
    "write_sharded",
]
