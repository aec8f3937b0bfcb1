"""Prefetch by bytes along the warm-up trace: which param chunks to fetch ahead now, and which to evict early for them.

Pure arithmetic over the trace and the residency's current state; nothing here touches a chunk.
:class:`~lightning_pstar.runtime.residency.Residency` builds a :class:`LookaheadState`, calls :func:`plan_prefetch`
and performs the moves it returns.

[Note: fetch and prefetch]
A module needs its param chunks on the device when its moment comes. A chunk still on the host then is a *demand
fetch*: the module waits for the copy (a stall). A *prefetch* starts that copy earlier, while other modules
compute, so that the chunk is on the device (or its copy is in flight) when its moment comes.

1. Every fetch is a copy on the copy stream (CUDA; [Note: streams] in ``chunk.py``) that records an event; the
   compute stream waits on that event where the bytes are first read (``Chunk.wait``, from ``Residency.fetch`` or
   any other reader), and the CPU never synchronises for a fetch. A demand fetch waits at once (its module reads
   next); a prefetch is waited on by the module that needs it. The pinned host source is freed only after the
   compute stream's wait, and the host allocator's event (recorded by the non-blocking copy) keeps the block from
   reuse until the copy is done. On the simulated device every copy is synchronous.
2. Parameters never point into a device buffer whose copy is in flight: a prefetched chunk's parameters keep
   pointing at the host bytes (where they were) and are re-pointed at the device buffer by the wait itself
   (``Chunk.on_landed``). A read the engine does not see (a parent module's forward reading a child's weight that
   the module tree does not name) therefore reads the host bytes, as it does for a chunk on the host, and never
   device bytes still being written.
3. A device block freed by an eviction is reusable by the allocator only once its copy to the host ends: until its
   event completes its bytes count against the device budget (:class:`~lightning_pstar.runtime.inflight.
   EvictionsInFlight`). A demand fetch that needs them waits on the CPU for that event; a prefetch does not wait,
   it takes the room at a later moment once the copy has ended.
4. Which chunks to prefetch (this module): the engine simulates what the coming moments would do without any
   further prefetch, with the same rules as the real run (at each moment the tide evicts down to that moment's
   room ``budget - non_model[t]``, then the moment's chunks are fetched, victims chosen as the placement policy
   does: the plan's drops first, then Belady's farthest next use, clean before dirty). That gives the demand
   fetches to come, in order of next use, and the device bytes held at every moment. A demand fetch of chunk
   ``c`` at moment ``s`` becomes a prefetch now when ``c``'s bytes fit the predicted room at every moment from now
   until ``s``. When they do not, a chunk ``v`` that the simulation evicts later anyway at moment ``e``, unused
   until then, is evicted now instead (Belady: it is not needed before ``c``): the same bytes move, only earlier,
   so an early eviction never costs more than the stall it removes. The first demand fetch that does not fit ends
   the plan (prefetch goes in order of next use). The simulation stops at the optimizer step (which moves and
   writes chunks) and after :data:`HORIZON` moments.
5. A prefetched chunk counts as kept by the plan until its moment: the tide evicts it only when nothing else
   frees enough room. Prefetch never changes the arithmetic (it changes when bytes move, never which bytes a
   module reads) and never exceeds the device budget (every move is checked against the room of the moment it
   happens in, in-flight evictions included).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["HORIZON", "LookaheadState", "PrefetchPlan", "plan_prefetch"]

HORIZON = 256
"""Moments simulated ahead at most (each access re-plans from the real state, so the plan only needs to reach the
demand fetches it can still move)."""


@dataclass(frozen=True, kw_only=True)
class LookaheadState:
    """What the planner reads: the trace ahead of the cursor and where the param chunks are now."""

    cursor: int  # the trace moment the iteration is at now
    families: Sequence[tuple[int, ...]]  # per trace moment, the (owned) families it needs
    rooms: Sequence[int]  # per trace moment, the bytes chunks may take on the device then
    stops: frozenset[int]  # trace moments the simulation does not pass (the optimizer step)
    sizes: Mapping[int, int]  # family -> bytes of its param chunk
    resident: frozenset[int]  # families whose param chunk is on the device now (owned, movable)
    busy: frozenset[int] = frozenset()  # ... of which in use now (a module computes with them): they stay now
    on_host: frozenset[int]  # families whose param chunk is on the host now (a fetch can bring them)
    used: int  # device bytes chunks hold now (param and optimizer chunks, evictions in flight included)
    room_now: int  # bytes chunks may hold now
    keep: Mapping[int, frozenset[int]] = field(default_factory=dict)  # the plan's kept families per moment
    clean: frozenset[int] = frozenset()  # resident families whose eviction would copy nothing
    ahead: Mapping[int, int] = field(default_factory=dict)  # prefetched family -> the moment it is due
    next_use: Callable[[int, int], int] = lambda fid, after: 1 << 30  # moments from ``after`` to its next use


@dataclass(kw_only=True)
class PrefetchPlan:
    """Moves to make now, in order: evictions first (they make the room), then the fetches with their due moment."""

    evict: list[int] = field(default_factory=list)
    fetch: list[tuple[int, int]] = field(default_factory=list)  # (family, moment it is needed at)


@dataclass(kw_only=True)
class _Future:
    """The simulated moments ahead (no further prefetch)."""

    moments: list[int]  # trace moments, in order (the current one first)
    occupied: list[int]  # device bytes held during each of them
    fetches: list[tuple[int, int]]  # (family, index into moments) of each demand fetch, in order
    evicted_at: dict[int, int]  # family -> index of its first simulated eviction


def plan_prefetch(state: LookaheadState) -> PrefetchPlan:
    """The prefetches (and early evictions) to start now: see [Note: fetch and prefetch], point 4."""
    plan = PrefetchPlan()
    future = _simulate(state)
    occupied = future.occupied
    rooms = [state.room_now] + [state.rooms[m] for m in future.moments[1:]]
    # a chunk may leave now instead of at its simulated eviction only if nothing uses it until then
    evictable = {
        fid: at
        for fid, at in future.evicted_at.items()
        if fid in state.resident and fid not in state.busy and state.next_use(fid, state.cursor) > at
    }
    for fid, at in future.fetches:
        if fid not in state.on_host:
            continue  # resident now, evicted and fetched back later: nothing to bring now
        size = state.sizes[fid]
        short = [occupied[u] + size - rooms[u] for u in range(at)]
        if any(d > 0 for d in short):
            victims = _early_evictions(short, evictable, state.sizes)
            if victims is None:
                break  # in order of next use: the first that cannot move ends the plan
            for victim in victims:
                start = evictable.pop(victim)
                for u in range(start):
                    occupied[u] -= state.sizes[victim]
                plan.evict.append(victim)
        for u in range(at):
            occupied[u] += size
        plan.fetch.append((fid, future.moments[at]))
    return plan


def _early_evictions(short: list[int], evictable: dict[int, int], sizes: Mapping[int, int]) -> list[int] | None:
    """Chunks to evict now (each leaves the device later anyway, at its simulated eviction) so that the deficit
    ``short[u]`` of every moment ``u`` before the fetch is covered; None when they cannot cover it. The chunks that
    leave last free the longest stretch: they are taken first."""
    chosen: list[int] = []
    freed = [0] * len(short)
    for fid in sorted(evictable, key=lambda f: (-evictable[f], f)):
        if all(freed[u] >= d for u, d in enumerate(short)):
            break
        at = evictable[fid]
        chosen.append(fid)
        for u in range(min(at, len(short))):
            freed[u] += sizes[fid]
    if all(freed[u] >= d for u, d in enumerate(short)):
        return chosen
    return None


def _simulate(state: LookaheadState) -> _Future:
    """The coming moments as the engine would run them without further prefetch (tide, then demand fetches with
    the policy's victims), from the state now until the optimizer step or :data:`HORIZON` moments."""
    n = len(state.families)
    resident = set(state.resident)
    used = state.used
    future = _Future(moments=[state.cursor], occupied=[used], fetches=[], evicted_at={})
    for k in range(1, min(HORIZON, n) + 1):
        moment = (state.cursor + k) % n
        if moment in state.stops:
            break
        need = state.families[moment]
        room = state.rooms[moment]
        index = len(future.moments)
        used = _evict_to(room, used, resident, need, moment, state, future, index)  # the tide
        for fid in need:
            if fid in resident or fid not in state.sizes:
                continue
            used = _evict_to(room - state.sizes[fid], used, resident, need, moment, state, future, index)
            resident.add(fid)
            used += state.sizes[fid]
            future.fetches.append((fid, index))
        future.moments.append(moment)
        future.occupied.append(used)
    return future


def _evict_to(
    limit: int,
    used: int,
    resident: set[int],
    need: tuple[int, ...],
    moment: int,
    state: LookaheadState,
    future: _Future,
    index: int,
) -> int:
    """Evict simulated chunks, in the policy's order, until ``used <= limit`` (or nothing is left to evict)."""
    if used <= limit:
        return used
    keep = state.keep.get(moment, frozenset())
    n = len(state.families)

    def order(fid: int) -> tuple[bool, int, bool, int]:
        due = state.ahead.get(fid)  # a prefetched chunk counts as kept until its moment (then it is used)
        kept = fid in keep or (due is not None and index <= (due - state.cursor) % n)
        return (kept, -state.next_use(fid, moment), fid not in state.clean, fid)

    for fid in sorted((f for f in resident if f not in need), key=order):
        if used <= limit:
            break
        resident.discard(fid)
        used -= state.sizes[fid]
        future.evicted_at.setdefault(fid, index)
    return used
