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
library as it is (a later run in the same process cannot undo an earlier one's: it says so). Where malloc is
the user's choice it is left alone: glibc's ``MALLOC_*_`` variables or ``glibc.malloc`` tunables in the
environment, or jemalloc, tcmalloc or mimalloc preloaded. A C library without ``mallopt`` (not glibc) is left
as it is, with a warning.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["KEEP_BELOW_BYTES", "TRIM_ABOVE_BYTES", "applied", "keep_freed_host_memory"]

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEEP_BELOW_BYTES = 32 * 2**20
"""Blocks below this size come from the heap, never from ``mmap`` (glibc's own ceiling for its adaptive
threshold)."""
TRIM_ABOVE_BYTES = 2**30
"""The heap's top goes back to the kernel only when more than this is free there."""

_applied: bool | None = None  # None: not tried in this process

_USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def _mallopt() -> Any | None:
    """glibc's ``mallopt`` from the C library this process has loaded (None where it has none)."""
    try:
        return getattr(ctypes.CDLL(None), "mallopt", None)
    except OSError:
        return None


def _left_to_the_user(environ: Mapping[str, str]) -> str | None:
    """Why the process's malloc is someone else's choice (None: it is not): malloc settings of glibc's own in the
    environment, or another allocator preloaded in place of glibc's."""
    given = [name for name in _USER_MALLOC_ENV if name in environ]
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        given.append("GLIBC_TUNABLES")
    if given:
        return f"{', '.join(given)} set in the environment"
    preload = environ.get("LD_PRELOAD", "")
    other = next((name for name in _OTHER_ALLOCATORS if name in preload), None)
    return f"{other} preloaded (LD_PRELOAD)" if other else None


def applied() -> bool:
    """Whether this process was told to keep freed host memory (by :func:`keep_freed_host_memory`)."""
    return bool(_applied)


def keep_freed_host_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Tell glibc to keep freed host memory for this process ([Note: host malloc]); once per process. Returns
    whether it is in effect: False where malloc is the user's choice (glibc's malloc variables or tunables in the
    environment, or another allocator preloaded), or the C library has no ``mallopt`` or refused a value."""
    global _applied
    if _applied is not None:
        return _applied
    reason = _left_to_the_user(os.environ if environ is None else environ)
    if reason is not None:
        log.debug("PatrickStar: host malloc left as it is (%s).", reason)
        _applied = False
        return False
    mallopt = _mallopt()
    if mallopt is None:
        log.warning(
            "PatrickStar: this C library has no mallopt (not glibc), so freed host memory may go back to the kernel"
            " after every step and fault in again (slower steps on a CPU). Set memory.host_malloc='system' to"
            " silence this."
        )
        _applied = False
        return False
    # mallopt returns 1 on success, 0 on error; setting either value turns glibc's adaptive thresholds off, so
    # both are set
    mmap_set = bool(mallopt(M_MMAP_THRESHOLD, KEEP_BELOW_BYTES))
    _applied = mmap_set and bool(mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE_BYTES))
    if _applied:
        log.debug(
            "PatrickStar: glibc keeps freed host memory for this process (no mmap below 32 MiB, no trim below 1 GiB"
            " free), as CUDA's caching allocator keeps device memory; memory.host_malloc='system' leaves it as is."
        )
    elif mmap_set:
        log.warning(
            "PatrickStar: glibc took the mmap threshold (no mmap below 32 MiB) but refused the trim threshold;"
            " freed host memory may still go back to the kernel."
        )
    else:
        log.warning("PatrickStar: glibc's mallopt refused the host-memory settings; malloc is left as it is.")
    return _applied
