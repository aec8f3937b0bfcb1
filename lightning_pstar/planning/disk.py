"""The disk tier's plan: which chunk families keep their fp32 master and optimizer states on disk, and the bytes
that takes off the host and adds to it ([Note: disk families] in ``runtime/disk_tier.py``). Pure arithmetic: the
engine's setup and the capacity planner call the same functions."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_pstar.planning.layout import Layout, owner_of

__all__ = [
    "ALIGNMENT",
    "DISK_BLOCK_BYTES",
    "DISK_DEPTH",
    "DISK_THREADS",
    "DiskPlan",
    "buffer_set_bytes",
    "choose_disk_families",
    "disk_block_bytes",
    "disk_buffer_bytes",
    "disk_bytes_per_element",
    "plan_disk_tier",
]

ALIGNMENT = 4096
"""Bytes of the disk tier's alignment (``runtime/aligned.py`` ``ALIGNMENT``: the same value, checked by a test)."""
DISK_BLOCK_BYTES = 8 << 20
"""The store's largest I/O call (``runtime/disk.py`` ``DEFAULT_BLOCK_BYTES``: the same value, checked by a test)."""


def align_up(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


DISK_DEPTH = 3
"""Families loaded at once under the pipelined step (it reads family k+1 while Adam runs on k and k-1 is written
back); the serial step (``optimizer_overlap="off"``) loads one."""
DISK_THREADS = 4
"""I/O threads of the disk tier's store."""


def disk_block_bytes(capacity: int) -> int:
    """Bytes of one I/O call for fp32 chunks of ``capacity`` elements: the store's default, or one chunk rounded
    up to the alignment when smaller (the staging arena then stays small for small chunks)."""
    return min(DISK_BLOCK_BYTES, align_up(capacity * 4))


def buffer_set_bytes(*, capacity: int, kinds: int) -> int:
    """Host bytes of one buffer set: ``kinds`` aligned fp32 buffers of ``capacity`` elements (each takes one
    alignment more)."""
    return kinds * (capacity * 4 + ALIGNMENT)


def disk_buffer_bytes(capacity: int, *, mixed: bool, depth: int = DISK_DEPTH) -> int:
    """Host bytes the disk tier holds for the run: ``depth`` buffer sets of fp32 chunks of ``capacity`` elements
    (master and two states in mixed precision, two states in 32-true) and the store's staging arena."""
    kinds = 3 if mixed else 2
    staging = DISK_THREADS * disk_block_bytes(capacity) + ALIGNMENT
    return buffer_set_bytes(capacity=capacity, kinds=kinds) * depth + staging


def disk_bytes_per_element(*, master: int, optimizer: int) -> int:
    """Bytes per element a disk family moves off the host: its fp32 master (``master``: 4 in mixed precision, 0 in
    32-true) and its optimizer states (``optimizer``)."""
    return master + optimizer


def choose_disk_families(layout: Layout, *, rank: int, world_size: int, excess: int, per_element: int) -> list[int]:
    """The trainable families this rank owns, last first, whose optimizer side (``per_element`` bytes per element)
    covers ``excess`` bytes of host need; all of them when even that is not enough (the caller's check refuses
    then). Every family moves the same bytes per element per step, so the choice is by order only."""
    chosen, freed = [], 0
    for chunk in reversed(layout.chunks):
        if freed >= excess:
            break
        if chunk.trainable and owner_of(chunk.chunk_id, world_size) == rank:
            chosen.append(chunk.chunk_id)
            freed += chunk.capacity * per_element
    return sorted(chosen)


@dataclass(frozen=True, kw_only=True)
class DiskPlan:
    """Which families go to disk, and the bytes that takes off the host and adds to it."""

    family_ids: list[int]
    on_disk: int  # bytes of their fp32 masters and optimizer states
    buffers: int  # host bytes of the disk tier's buffer sets and staging arena
    capacity: int  # elements of the largest trainable chunk (the buffers' size)
    depth: int = DISK_DEPTH  # buffer sets: families loaded at once
    file_bytes: int = 0  # bytes of their files (each chunk's file padded to the alignment): what the disk must hold


def plan_disk_tier(
    layout: Layout, *, master: int, optimizer: int, rank: int, world_size: int, excess: int, depth: int = DISK_DEPTH
) -> DiskPlan:
    """The families whose optimizer side (``master`` + ``optimizer`` bytes per element) goes to disk so that the
    host need drops by ``excess`` bytes plus the disk tier's own host buffers (``depth`` sets:
    :func:`disk_buffer_bytes`), chosen by :func:`choose_disk_families`."""
    per_element = disk_bytes_per_element(master=master, optimizer=optimizer)
    capacity = max((c.capacity for c in layout.chunks if c.trainable), default=0)
    buffers = disk_buffer_bytes(capacity, mixed=master > 0, depth=depth)
    ids = choose_disk_families(
        layout, rank=rank, world_size=world_size, excess=excess + buffers, per_element=per_element
    )
    on_disk = sum(layout.chunks[i].capacity * per_element for i in ids)
    files = sum(per_element // 4 * align_up(layout.chunks[i].capacity * 4) for i in ids)
    return DiskPlan(family_ids=ids, on_disk=on_disk, buffers=buffers, capacity=capacity, depth=depth, file_bytes=files)
