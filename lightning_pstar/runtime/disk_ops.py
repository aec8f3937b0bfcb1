"""The futures of one disk-tier operation (:class:`~lightning_pstar.runtime.disk.DiskStore`, [Note: disk tier] in
``runtime/disk.py``): the block transfers of one read or write completing its one future, and an operation's
outcome handed on to the future its caller holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

__all__ = ["DiskOp", "copy_outcome"]


class DiskOp:
    """One read or write: ``parts`` block transfers completing one outer future."""

    def __init__(self, outer: Future[None], parts: int, finish: Callable[[], None]) -> None:
        self.outer, self.remaining, self.finish = outer, parts, finish
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def part_done(self, part: Future[None]) -> None:
        error = part.exception()
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
            self.remaining -= 1
            last = self.remaining == 0
        if not last:
            return
        try:
            self.finish()
        except BaseException as err:  # noqa: B036 - handed to the caller through the future
            self.error = self.error or err
        if self.error is not None:
            self.outer.set_exception(self.error)
        else:
            self.outer.set_result(None)


def copy_outcome(source: Future[None], target: Future[None]) -> None:
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(None)
