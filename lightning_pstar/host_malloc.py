"""Host memory freed on a CPU run stays with the process, as CUDA's caching allocator keeps device memory.

[Note: host malloc]
On a CPU the simulated DEVICE tier, the activations and every transient buffer are host memory from the C
library's ``malloc``. glibc hands a freed block back to the kernel when it is large (an ``mmap`` above a
threshold that adapts to what was freed before, up to 32 MiB) or when the free space at the top of the heap
passes a trim threshold, and the pages fault in again, zeroed, at the next allocation. How much goes back
depends on the order of allocations more than on their sizes: under plain Lightning little does (one likely
reason: the gradients autograd allocates in each backward stay alive past the step and keep the heap's top in
use), while under PatrickStar, which writes gradients into chunks, a step's activations and buffers go back to
the kernel and fault in again at every step (a Lightning sanity-validation pass before training changed the
heap's layout enough to hide most of it, in one test). Measured on the
demo GPT (4 x 192, bf16-mixed, ``python benchmarks/scaling.py --layers 4 --n-embd 192 --n-head 4 --block-size
128 --batch-size 16 --strategies auto,ddp,patrickstar --host-malloc system``, which prints the minor page faults
per step): PatrickStar with the system's malloc faulted 12,640 pages per step at one rank and 12,292 at two,
against 648 for ``auto`` and 187 for ``ddp``, and its forward took 61.6 and 67.9 ms against 44.0 and 44.9.

On a GPU the caching allocator keeps freed device blocks for the process. On a CPU run PatrickStar therefore
tells glibc the same (``memory.host_malloc="cached"``, the default): no ``mmap`` below 32 MiB and no trimming
while less than 1 GiB is free at the top, once per process, when the engine is built. The setting is the
process's (glibc has one), stays after the run, and is logged; ``memory.host_malloc="system"`` leaves the C
library as it is. A C library without ``mallopt`` (not glibc) is left as it is, with a warning.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

__all__ = ["KEEP_BELOW_BYTES", "TRIM_ABOVE_BYTES", "keep_freed_host_memory"]

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEEP_BELOW_BYTES = 32 * 2**20
"""Blocks below this size come from the heap, never from ``mmap`` (glibc's own ceiling for its adaptive
threshold)."""
TRIM_ABOVE_BYTES = 2**30
"""The heap's top goes back to the kernel only when more than this is free there."""

_applied: bool | None = None  # None: not tried in this process


def _mallopt() -> Any | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    return getattr(ctypes.CDLL(name), "mallopt", None)


def keep_freed_host_memory() -> bool:
    """Tell glibc to keep freed host memory for this process ([Note: host malloc]); once per process. Returns
    whether it is in effect: False where the C library has no ``mallopt`` or refused a parameter."""
    global _applied
    if _applied is not None:
        return _applied
    mallopt = _mallopt()
    if mallopt is None:
        log.warning(
            "PatrickStar: this C library has no mallopt (not glibc), so freed host memory may go back to the kernel"
            " after every step and fault in again (slower steps on a CPU). Set memory.host_malloc='system' to"
            " silence this."
        )
        _applied = False
        return False
    # mallopt returns 1 on success, 0 on error; the order matters: setting either turns glibc's adaptive
    # thresholds off, so both are set
    _applied = bool(mallopt(M_MMAP_THRESHOLD, KEEP_BELOW_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE_BYTES))
    if _applied:
        log.info(
            "PatrickStar: glibc keeps freed host memory for this process (no mmap below 32 MiB, no trim below 1 GiB"
            " free), as CUDA's caching allocator keeps device memory; memory.host_malloc='system' leaves it as is."
        )
    else:
        log.warning("PatrickStar: glibc's mallopt refused the host-memory settings; malloc is left as it is.")
    return _applied
