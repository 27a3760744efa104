"""A small discrete-event simulator: operations on serial resources with dependencies.

Each operation has a resource (a server that runs one operation at a time), a duration (s) and the
operations it waits for. An operation becomes *ready* when all its dependencies have ended; each
resource runs its ready operations first-come first-served (by ready time, then by creation order:
the order the engine submits them, as its FIFO thread pools do). Operations on resource ``None``
take no time and occupy nothing (synchronisation points: a thread waiting for a future).

The simulation is list scheduling in global start-time order with one heap per resource:
O(n log n) for n operations. ``run`` is the compiled fast path (``fuyou.planner.sim_kernel``);
``run_reference`` the plain loop it equals, bit for bit.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sim:
    """Build with ``op``; ``run`` returns each operation's end time (s)."""

    merge: dict[str, str] = field(default_factory=dict)
    """Resource aliases: ``{"adam": "cpu", "compute": "cpu"}`` makes them one server."""
    res: list[str | None] = field(default_factory=list)
    dur: list[float] = field(default_factory=list)
    deps: list[tuple[int, ...]] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)

    def op(self, resource: str | None, duration: float, deps: Iterable[int | None] = (), kind: str = "") -> int:
        """Add an operation; returns its id. ``deps`` may contain None (ignored).

        ``kind`` labels it for busy-time accounting (default: the resource name). Raises ValueError
        for a negative duration or a dependency on an operation not yet created.
        """
        if duration < 0:
            raise ValueError(f"negative duration {duration}")
        i = len(self.res)
        given = tuple(deps)
        d: tuple[int, ...] = tuple(x for x in given if x is not None) if None in given else given  # type: ignore[assignment]
        if d and max(d) >= i:
            raise ValueError(f"operation {i} depends on a later operation {max(d)}")
        self.res.append(None if resource is None else self.merge.get(resource, resource))
        self.dur.append(float(duration))
        self.deps.append(d)
        self.kind.append(kind or (resource or "sync"))
        return i

    def run(self) -> list[float]:
        """Simulate; returns the end time of every operation (seconds from 0). Raises RuntimeError on a
        dependency cycle. Compiled (``sim_kernel.simulate_ends``); equal to ``run_reference``."""
        from fuyou.planner.sim_kernel import simulate_ends

        codes: dict[str, int] = {}
        res = np.fromiter(
            (-1 if r is None else codes.setdefault(r, len(codes)) for r in self.res), np.int64, len(self.res)
        )
        dep_ptr = np.zeros(len(self.deps) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, self.deps), np.int64, len(self.deps)), out=dep_ptr[1:])
        dep_idx = np.fromiter(itertools.chain.from_iterable(self.deps), np.int64, int(dep_ptr[-1]))
        return simulate_ends(res, np.asarray(self.dur, np.float64), dep_ptr, dep_idx, len(codes)).tolist()

    def run_reference(self) -> list[float]:
        """``run``'s plain reference: simulate; returns the end time of every operation (seconds from 0)."""
        n = len(self.res)
        end = [0.0] * n
        ready = [0.0] * n
        users: list[list[int]] = [[] for _ in range(n)]
        waiting = [0] * n
        for i, d in enumerate(self.deps):
            for j in set(d):
                users[j].append(i)
                waiting[i] += 1
        free: dict[str, float] = {}
        heaps: dict[str, list[tuple[float, int]]] = {}
        instant: list[int] = []

        def release(i: int) -> None:
            for u in users[i]:
                ready[u] = max(ready[u], end[i])
                waiting[u] -= 1
                if waiting[u] == 0:
                    enqueue(u)

        def enqueue(i: int) -> None:
            r = self.res[i]
            if r is None:
                instant.append(i)
            else:
                heapq.heappush(heaps.setdefault(r, []), (ready[i], i))

        for i in range(n):
            if waiting[i] == 0:
                enqueue(i)
        done = 0
        while done < n:
            while instant:
                i = instant.pop()
                end[i] = ready[i]
                done += 1
                release(i)
            best, best_r = None, None
            for r, h in heaps.items():
                if h:
                    s = max(h[0][0], free.get(r, 0.0))
                    if best is None or (s, h[0][1]) < best:
                        best, best_r = (s, h[0][1]), r
            if best is None or best_r is None:  # set together
                if done < n and not instant:
                    raise RuntimeError("simulation stalled: a dependency cycle")
                continue
            _, i = heapq.heappop(heaps[best_r])
            start = best[0]
            end[i] = start + self.dur[i]
            free[best_r] = end[i]
            done += 1
            release(i)
        return end

    def busy(self) -> dict[str, float]:
        """Total duration per operation kind (seconds)."""
        out: dict[str, float] = {}
        for k, d in zip(self.kind, self.dur):
            out[k] = out.get(k, 0.0) + d
        return out
