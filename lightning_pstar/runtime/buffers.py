"""Tier buffers that keep one storage object for their whole life ([Note: storage identity] in ``chunk.py``):
created without bytes (:func:`unbacked`), given their bytes in place (:func:`backed`)."""

from __future__ import annotations

import torch

__all__ = ["backed", "unbacked"]


def unbacked(capacity: int, dtype: torch.dtype, device: torch.device, *, pin: bool = False) -> torch.Tensor:
    """A 1-D buffer of ``dtype`` on ``device`` whose storage holds no bytes yet (:func:`backed` gives it some).

    On a caching allocator (CUDA, pinned host memory) nothing is allocated at all: the tensor starts with
    zero elements and takes its ``capacity`` shape the first time it is backed. A tensor cannot carry a
    shape larger than its storage without ``set_`` growing the storage, and a block allocated and
    resized to 0 stays reserved in the cache. Plain host memory has no cache: there the buffer is
    allocated at full shape and freed at once, so it shows its shape from the start.
    """
    if pin:
        return torch.empty(0, dtype=dtype, pin_memory=True)
    if device.type in ("cuda", "meta"):
        return torch.empty(0, dtype=dtype, device=device)
    buf = torch.empty(capacity, dtype=dtype, device=device)
    buf.untyped_storage().resize_(0)
    return buf


def backed(buf: torch.Tensor, capacity: int) -> torch.Tensor:
    """Give ``buf``'s own storage ``capacity`` elements in place (same storage object: [Note: storage
    identity] in ``chunk.py``) and, the first time, the shape that goes with them."""
    nbytes = capacity * buf.element_size()
    storage = buf.untyped_storage()
    if storage.nbytes() == 0:
        storage.resize_(nbytes)
    if buf.numel() != capacity:
        buf.set_(storage, 0, (capacity,), (1,))
    return buf
