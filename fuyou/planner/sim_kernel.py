"""The discrete-event simulation's fast path: ``Sim.run_reference``'s list scheduling, compiled with numba.

Same algorithm, same arithmetic, same tie-breaking — every end time is bit-identical to the reference's
(``tests/unit/planner/test_sim_kernel.py``): an operation becomes ready when its last dependency ends
(ready = the latest of their ends); among the resources, the next operation to start is the one with the
smallest (start, id), start = max(its ready time, when its resource is free); operations on no resource
end when they become ready. A planner search simulates tens of thousands of operations (a state chunk's
read, update and write each) per candidate plan, which the interpreted loop took seconds for.

Inputs are flat arrays: each operation's resource code (−1: none), duration (s), and its dependencies in
compressed form (``dep_ptr[i]:dep_ptr[i+1]`` into ``dep_idx``; repeats allowed, counted once). Each
resource's ready operations wait in a binary heap keyed by (ready time, id).

All jitted code lives in this one file: numba's on-disk cache (``cache=True``) checks only the source
file of the cached function.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, inline="always")
def _less(ka: float, ia: int, kb: float, ib: int) -> bool:
    return ka < kb or (ka == kb and ia < ib)


@njit(cache=True)
def _push(keys: np.ndarray, ids: np.ndarray, base: int, size: np.ndarray, r: int, key: float, i: int) -> None:
    """Push (key, i) onto resource ``r``'s heap, stored at ``base`` in ``keys``/``ids``."""
    n = size[r]
    size[r] = n + 1
    while n > 0:
        parent = (n - 1) // 2
        if not _less(key, i, keys[base + parent], ids[base + parent]):
            break
        keys[base + n], ids[base + n] = keys[base + parent], ids[base + parent]
        n = parent
    keys[base + n], ids[base + n] = key, i


@njit(cache=True)
def _pop(keys: np.ndarray, ids: np.ndarray, base: int, size: np.ndarray, r: int) -> int:
    """Remove and return the id at the top of resource ``r``'s heap."""
    top = ids[base]
    n = size[r] - 1
    size[r] = n
    if n == 0:
        return top
    key, i = keys[base + n], ids[base + n]
    pos = 0
    while True:
        child = 2 * pos + 1
        if child >= n:
            break
        if child + 1 < n and _less(
            keys[base + child + 1], ids[base + child + 1], keys[base + child], ids[base + child]
        ):
            child += 1
        if not _less(keys[base + child], ids[base + child], key, i):
            break
        keys[base + pos], ids[base + pos] = keys[base + child], ids[base + child]
        pos = child
    keys[base + pos], ids[base + pos] = key, i
    return top


@njit(cache=True)
def _release(i: int, end: np.ndarray, waiting: np.ndarray, user_ptr: np.ndarray, users: np.ndarray, q: tuple) -> None:
    """Operation ``i`` has ended: each user it was the last dependency of becomes ready (``_enqueue``)."""
    ready = q[1]
    for p in range(user_ptr[i], user_ptr[i + 1]):
        u = users[p]
        ready[u] = max(ready[u], end[i])
        waiting[u] -= 1
        if waiting[u] == 0:
            _enqueue(u, q)


@njit(cache=True)
def _enqueue(u: int, q: tuple) -> None:
    """Ready operation ``u`` onto the stack of instants (no resource) or its resource's heap. ``q``: the
    queues — (resource codes, ready times, instants stack, [its height], heap keys, heap ids, each
    resource's heap base, heap sizes)."""
    res, ready, instant, height, keys, ids, cap, size = q
    if res[u] < 0:
        instant[height[0]] = u
        height[0] += 1
    else:
        _push(keys, ids, cap[res[u]], size, res[u], ready[u], u)


@njit(cache=True)
def simulate_ends(res: np.ndarray, dur: np.ndarray, dep_ptr: np.ndarray, dep_idx: np.ndarray, n_res: int) -> np.ndarray:
    """End time (s) of every operation; raises RuntimeError on a dependency cycle."""
    n = res.shape[0]
    end = np.zeros(n)
    ready = np.zeros(n)
    waiting = np.zeros(n, np.int64)
    seen = np.full(n, -1, np.int64)
    n_users = np.zeros(n, np.int64)
    for i in range(n):  # distinct dependencies: each counts once
        for p in range(dep_ptr[i], dep_ptr[i + 1]):
            j = dep_idx[p]
            if seen[j] != i:
                seen[j] = i
                n_users[j] += 1
                waiting[i] += 1
    user_ptr = np.zeros(n + 1, np.int64)
    for j in range(n):
        user_ptr[j + 1] = user_ptr[j] + n_users[j]
    users = np.empty(user_ptr[n], np.int64)
    fill = user_ptr[:-1].copy()
    seen[:] = -1
    for i in range(n):  # users in creation order, as the reference appends them
        for p in range(dep_ptr[i], dep_ptr[i + 1]):
            j = dep_idx[p]
            if seen[j] != i:
                seen[j] = i
                users[fill[j]] = i
                fill[j] += 1
    # one heap per resource, each with room for all of that resource's operations
    cap = np.zeros(n_res + 1, np.int64)
    for i in range(n):
        if res[i] >= 0:
            cap[res[i] + 1] += 1
    for r in range(n_res):
        cap[r + 1] += cap[r]
    keys = np.empty(max(cap[n_res], 1))
    ids = np.empty(max(cap[n_res], 1), np.int64)
    size = np.zeros(n_res, np.int64)
    free = np.zeros(n_res)
    instant = np.empty(n, np.int64)
    height = np.zeros(1, np.int64)
    q = (res, ready, instant, height, keys, ids, cap, size)
    for i in range(n):
        if waiting[i] == 0:
            _enqueue(i, q)
    done = 0
    while done < n:
        while height[0] > 0:
            height[0] -= 1
            i = instant[height[0]]
            end[i] = ready[i]
            done += 1
            _release(i, end, waiting, user_ptr, users, q)
        best_r, best_s, best_i = -1, 0.0, 0
        for r in range(n_res):
            if size[r] > 0:
                s = max(keys[cap[r]], free[r])
                if best_r < 0 or _less(s, ids[cap[r]], best_s, best_i):
                    best_r, best_s, best_i = r, s, ids[cap[r]]
        if best_r < 0:
            if done < n and height[0] == 0:
                raise RuntimeError("simulation stalled: a dependency cycle")
            continue
        i = _pop(keys, ids, cap[best_r], size, best_r)
        end[i] = best_s + dur[i]
        free[best_r] = end[i]
        done += 1
        _release(i, end, waiting, user_ptr, users, q)
    return end
