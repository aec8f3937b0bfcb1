"""Stand-ins for the weights of a sharded checkpoint in the Trainer's ``checkpoint["state_dict"]``.

[Note: weights in a sharded checkpoint dict]
A sharded save writes the weights to its store, so the checkpoint dict Lightning builds holds none of them, and a
LightningModule's (or a callback's) ``on_save_checkpoint`` / ``on_load_checkpoint`` that edits
``checkpoint["state_dict"]`` (drops the frozen weights of a fine-tune, renames keys, writes a value on load) would
edit a dict without weights: plain Lightning honours those edits, and the engine would silently not. So the dict
holds a stand-in per weight name: an empty tensor on the meta device with the weight's shape and dtype, marked with
the key of its value in the store. After the hooks ran:

- on save, the names whose stand-ins are still there (under their own or a new key) are the checkpoint's weight
  names, mapped to their store keys; a name whose stand-in is gone was dropped; a real tensor a hook put under a key
  is kept in the metadata as any other entry (``sharded_info_after_hooks``);
- on load, each weight is read from the store where the dict holds its stand-in, taken from the dict where a hook
  put a real tensor there, and is missing where neither is (``strict`` decides, as for a consolidated file).

The stand-ins never reach a file: the metadata keeps only the real entries (buffers, a hook's own tensors).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["is_placeholder", "placeholder", "store_key_of", "with_placeholders"]

_KEY = "_pstar_store_key"


def placeholder(shape: Iterable[int], dtype: torch.dtype, store_key: str) -> torch.Tensor:
    """A stand-in for a weight whose value is ``store_key`` in a sharded store."""
    value = torch.empty(tuple(shape), dtype=dtype, device="meta")
    setattr(value, _KEY, store_key)
    return value


def is_placeholder(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta and hasattr(value, _KEY)


def store_key_of(value: torch.Tensor) -> str:
    key: str = getattr(value, _KEY)
    return key


def with_placeholders(
    entries: Mapping[str, Any], keys: Iterable[str], canonical: Mapping[str, str], shapes: Mapping[str, Any],
    dtypes: Mapping[str, str],
) -> dict[str, Any]:  # fmt: skip
    """``entries`` (the real ones: buffers, a hook's tensors) with a stand-in for every other key of ``keys`` (the
    weight names, in the state dict's order), read as ``model/<canonical name>`` from the store."""
    out: dict[str, Any] = {}
    for key in keys:
        if key in entries:
            out[key] = entries[key]
            continue
        store_key = f"model/{canonical.get(key, key)}"
        if store_key in shapes:
            out[key] = placeholder(shapes[store_key], getattr(torch, dtypes.get(key, "float32")), store_key)
    for key, value in entries.items():
        out.setdefault(key, value)
    return out
