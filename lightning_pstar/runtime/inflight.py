"""Evictions whose copy to the host is still in flight: their device blocks count against the budget until it ends.

An eviction on the copy stream frees its device block at once under ``record_stream`` ([Note: streams] in
``chunk.py``), but the caching allocator hands the block out again only once the copy's work is done. Until then
the block is still reserved: a fetch or an activation allocated meanwhile takes new memory, and the device holds
more than the budget says ([Note: fetch and prefetch] in ``lookahead.py``, point 3). So the residency keeps the
event of each eviction in flight with its bytes, counts them as held while the event has not completed, and
waits on the oldest events (on the CPU: what the allocator itself waits for) when a fetch needs their room.

Only CUDA has asynchronous evictions; elsewhere nothing is ever recorded here.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

__all__ = ["CopyEvent", "EvictionsInFlight"]


class CopyEvent(Protocol):
    """What is read of a ``torch.cuda.Event`` recorded after a copy (the CPU tests pass a fake)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class EvictionsInFlight:
    """Device bytes freed by evictions whose copies have not ended, oldest first."""

    def __init__(self) -> None:
        self._queue: deque[tuple[CopyEvent, int]] = deque()
        self.waits = 0  # CPU waits for an eviction's copy (a fetch needed its room)

    def add(self, event: CopyEvent, nbytes: int) -> None:
        self._queue.append((event, nbytes))

    def held(self) -> int:
        """Bytes of evictions still in flight (those whose event completed are forgotten)."""
        queue = self._queue
        while queue and queue[0][0].query():  # copies on one stream end in order
            queue.popleft()
        return sum(nbytes for _, nbytes in queue)

    def settle(self, nbytes: int) -> int:
        """Wait for the oldest evictions in flight until ``nbytes`` of their blocks are reusable (or none is left);
        returns the bytes released."""
        released = 0
        queue = self._queue
        while queue and released < nbytes:
            event, size = queue.popleft()
            if not event.query():
                event.synchronize()
                self.waits += 1
            released += size
        return released
