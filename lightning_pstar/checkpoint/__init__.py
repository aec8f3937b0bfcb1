"""Checkpoints: crash-safe files, sharded stores (torch.distributed.checkpoint), model and optimizer state."""

from lightning_pstar.checkpoint.io import (
    META_FILENAME,
    CheckpointError,
    SafeCheckpointIO,
    consolidate,
    is_sharded_checkpoint,
    main,
    read_sharded_meta,
    read_sharded_tensors,
    write_sharded,
)

__all__ = [
    "META_FILENAME",
    "CheckpointError",
    "SafeCheckpointIO",
    "consolidate",
    "is_sharded_checkpoint",
    "main",
    "read_sharded_meta",
    "read_sharded_tensors",
    "write_sharded",
]
