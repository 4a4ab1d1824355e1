"""The exact planner: the best pipeline of contiguous stage runs over an order of devices.

Claim
-----
Among all assignments in which every device holds at most one contiguous run of stages (a
pipeline: the chain is cut into segments, each segment goes to a different device, in any
order of devices), ``optimal_assignment`` returns one that minimises the objective of
:func:`tfnb.placement.cost.predict` exactly (up to float rounding), under hard memory caps
(parameters + KV cache at the given batch and context):

- ``"latency"``: stage times + hop times + the token-id hop from the last device to the first;
- ``"throughput"``: the slowest resource, i.e. the largest segment time or hop time
  (``bottleneck_s``; the runtime's lanes bound the rate too, ``lane_s``, which ``predict``
  reports for the plan found but which is not searched over).

Of latency-optimal plans it returns the most even one (least sum of squared segment times;
see ``TIE``): with two devices, the one whose slowest segment is fastest.

Assignments that revisit a device (A -> B -> A) are outside the claim; the tests compare
against brute force over every assignment of up to 7 stages onto up to 4 devices, restricted
to the claim's form.

Algorithm
---------
Devices that can be swapped without changing any figure (same memory, speed, stage times and
links; ``Topology.classes``) form K classes of sizes n_1..n_K. A state is
``(u, f, l, j)``: ``u`` counts the devices used per class, ``f`` is the class of the first
device (for the return hop), ``l`` the class of the last device, ``j`` the number of stages
placed. Appending a segment ``[i, j)`` on a fresh device of class ``d``:

    F[u + e_d, f, d, j] = min over l, i of  F[u, f, l, i] (+ or max) hop(l -> d, i)
                                           (+ or max) (P_d[j] - P_d[i])

with ``P_d`` the prefix sums of stage times on class ``d`` and ``i`` restricted to segments that
fit class ``d``'s memory (a window ``[lo_d(j), j)``, at most ``W`` wide). Every state has a
single predecessor ``u - e_d``, so the states are processed once, level by level.

Complexity: ``S = prod(n_c + 1)`` count vectors, each expanded into K classes with
``O(K^2 N + K W N)`` numpy work: ``O(S K^2 N (K + W))`` time and ``O(S K^2 N)`` memory for
back-pointers. Identical devices cost little (16 devices of 4 kinds: S = 625); 16 all-different
devices give S = 2^16, where the branch-and-bound below (partial cost + the cheapest possible
rest of the chain against the best known plan) does most of the work.
"""

from __future__ import annotations

import math

import numpy as np

from tfnb.errors import PlacementError
from tfnb.placement.cost import TOKEN_BYTES, Topology, stage_memory

__all__ = ["optimal_segments", "exact_is_feasible", "TooLarge"]


# Ties. For latency, every split of a chain over equal devices costs the same: the segment
# times add up alike. Each segment then also pays TIE / total x its squared time, a sum that is
# least for the most even split, so of equally fast plans the one with the smallest slowest
# stage (the better pipeline when requests overlap, and the most even memory) is returned. The
# charge is at most TIE of the objective: below the 1e-9 the search and its tests compare at,
# far above float rounding (~1e-15).
TIE = 1e-11


class TooLarge(PlacementError):
    """The exact search outgrew its memory budget."""


def exact_is_feasible(topo: Topology, n_stages: int, max_bytes: float = 1e9) -> bool:
    """Whether the exact search's back-pointer tables fit ``max_bytes`` even if no state is
    pruned (``prod(n_c + 1)`` count vectors of ``K x K x (N + 1)`` floats)."""
    classes = topo.classes()
    states = math.prod(len(c) + 1 for c in classes)
    return states * len(classes) ** 2 * (n_stages + 1) * 8 <= max_bytes * 4


def _tables(chain, topo: Topology, classes, batch: int, context_len: int):
    K, N = len(classes), len(chain)
    rep = [c[0] for c in classes]
    T = np.array([[topo.stage_s(s, r, batch, context_len) for s in chain] for r in rep])
    P = np.zeros((K, N + 1))
    P[:, 1:] = np.cumsum(T, axis=1)
    M = np.concatenate([[0.0], np.cumsum(np.asarray(stage_memory(chain, batch, context_len),
                                                    dtype=float))])
    cap = topo.memory[rep]
    lo = np.stack([np.searchsorted(M, M - cap[c], side="left") for c in range(K)])  # (K, N+1)
    lat, bw = np.full((K, K), np.inf), np.ones((K, K))
    for a in range(K):
        for b in range(K):
            if a != b:
                lat[a, b], bw[a, b] = topo.latency[rep[a], rep[b]], topo.bandwidth[rep[a], rep[b]]
            elif len(classes[a]) > 1:
                x, y = classes[a][:2]
                lat[a, b], bw[a, b] = topo.latency[x, y], topo.bandwidth[x, y]
    act = np.full(N + 1, np.nan)
    act[1:N] = [batch * s.act_bytes_out_per_token for s in list(chain)[:-1]]
    hop = lat[:, :, None] + act[None, None, :] / bw[:, :, None]   # (K, K, N+1): hop before stage i
    hop[:, :, 0] = hop[:, :, N] = np.inf
    hop[np.isnan(hop)] = np.inf
    ret = lat + batch * TOKEN_BYTES / bw                               # (K, K): last -> first
    return T, P, lo, hop, ret


def _bands(P, lo, d: int, N: int, tie: float = 0.0):
    """Candidate segment starts ``i = j - 1 - k`` for every end ``j``, and their costs on ``d``
    (plus ``tie`` x the squared segment time, see ``TIE``)."""
    j = np.arange(N + 1)
    start = np.maximum(lo[d], 1)
    width = max(1, int((j - start).max(initial=0)))
    i = j[None, :] - 1 - np.arange(width)[:, None]                     # (W, N+1)
    valid = (i >= start[None, :]) & (i >= 1)
    i = np.clip(i, 0, N)
    seg = P[d][None, :] - P[d][i]
    seg = np.where(valid, seg + tie * seg * seg, np.inf)
    return i, valid, seg


def _stacked_bands(P, lo, K: int, N: int, tie: float):
    """``_bands`` of every class padded to one width: ``(band_i, band_t, width)``, the first two
    of shape ``(K, N+1, W)`` (the candidate starts of a segment ending at ``j`` and their costs,
    last axis contiguous for ``min()``)."""
    bands = [_bands(P, lo, d, N, tie) for d in range(K)]
    width = max(b[0].shape[0] for b in bands)
    pad = [((0, width - b[0].shape[0]), (0, 0)) for b in bands]
    band_i = np.stack([np.pad(b[0], w).T for b, w in zip(bands, pad)])
    band_t = np.stack([np.pad(np.where(b[1], b[2], np.inf), w, constant_values=np.inf).T
                       for b, w in zip(bands, pad)])
    return band_i, band_t, width


def optimal_segments(chain, topo: Topology, batch: int, context_len: int,
                     objective: str = "latency", upper_bound: float = math.inf,
                     max_bytes: float = 1e9, beam: int | None = None):
    """``[(device, start, stop), ...]`` of an optimal pipeline and its objective value.

    Returns ``(None, inf)`` when no pipeline fits the memory caps. ``upper_bound`` (the value
    of any plan of the claimed form) only prunes; states that cannot beat it are dropped.
    ``beam`` keeps only that many states per level, those with the least partial cost plus
    bound: a beam search for state spaces too large to search exactly (many kinds of device),
    whose result is the best found, not proven optimal.

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> topo = Topology(["a", "b"], memory="1MB", flops=[1e9, 4e9])
    >>> segs, value = optimal_segments(tiny("llama").chain, topo, 1, 16)
    >>> segs
    [('b', 0, 4)]
    """
    search = _Search(chain, topo, batch, context_len, objective, upper_bound, max_bytes)
    N, level = search.N, search.first_level()
    best, best_key = math.inf, None
    for depth in range(1, search.n_devices + 1):
        nxt: dict = {}
        for u, F in level.items():
            done = F[:, :, N] if depth == 1 else search.add(F[:, :, N], search.ret.T)
            if done.min() < best:
                first, last = np.unravel_index(np.argmin(done), done.shape)
                best, best_key = float(done[first, last]), (u, int(first), int(last))
                search.limit = min(search.limit, best * (1 + 1e-9) + 1e-15)
            search.extend(u, F, nxt)
        if beam is not None and len(nxt) > beam:
            nxt = search.keep_best(nxt, beam)
        level = nxt
    if best_key is None:
        return None, math.inf
    return search.trace_back(*best_key), best


class _Search:
    """The exact search's tables and steps (see the module docstring).

    A state ``u`` counts the devices used of each class; its table ``F[f, l, j]`` is the least
    cost of placing stages ``[0, j)`` with the first segment on class ``f`` and the last on
    ``l``. ``table`` keeps every state's ``F`` to trace the best plan back at the end.
    """

    def __init__(self, chain, topo: Topology, batch: int, context_len: int, objective: str,
                 upper_bound: float, max_bytes: float):
        self.topo, self.max_bytes = topo, max_bytes
        self.latency = objective == "latency"
        self.add = np.add if self.latency else np.maximum
        self.classes = topo.classes()
        self.K, self.N = K, N = len(self.classes), len(chain)
        self.sizes = np.array([len(c) for c in self.classes])
        self.n_devices = int(self.sizes.sum())
        self.T, self.P, self.lo, self.hop, self.ret = _tables(chain, topo, self.classes, batch,
                                                              context_len)
        self.tie = TIE / max(float(self.P[:, N].max()), 1e-30) if self.latency else 0.0
        need = np.asarray(stage_memory(chain, batch, context_len), dtype=float)
        self.left = np.append(need[::-1].cumsum()[::-1], 0.0)     # bytes of stages k.. N-1
        self.cap = topo.memory[[c[0] for c in self.classes]]
        self.limit = upper_bound * (1 + 1e-9) + 1e-15
        self.bounds: dict = {}
        self.band_i, self.band_t, self.width = _stacked_bands(self.P, self.lo, K, N, self.tie)
        self.unit = [tuple(int(x == c) for x in range(K)) for c in range(K)]
        self.table: dict = {}

    def bound(self, v):
        """Least the rest can add once the devices counted in ``v`` hold stages [0, j)."""
        if v not in self.bounds:
            N, spare = self.N, self.sizes - np.array(v)
            room = float((spare[spare > 0] * self.cap[spare > 0]).sum())  # caps may be inf
            out = np.full(N + 1, np.inf)
            if (spare > 0).any():
                cheapest = self.T[spare > 0].min(axis=0)[::-1]
                out[:N] = (np.cumsum(cheapest) if self.latency
                           else np.maximum.accumulate(cheapest))[::-1]
            out[N] = 0.0
            out[self.left > room * (1 + 1e-12)] = np.inf           # the rest no longer fits
            self.bounds[v] = out
        return self.bounds[v]

    def prune(self, F, v, j0=0, j1=None):
        """``F`` with the entries that cannot beat ``limit`` set to inf."""
        b = self.bound(v)[j0:self.N + 1 if j1 is None else j1]
        F[~np.isfinite(b) | (self.add(F, b) > self.limit)] = np.inf
        return F

    def first_level(self) -> dict:
        """The states of one device: a single segment from stage 0 on class ``f``."""
        P, lo, level = self.P, self.lo, {}
        for f in range(self.K):
            F = np.full((self.K, self.K, self.N + 1), np.inf)
            F[f, f, 1:] = np.where(lo[f, 1:] == 0, P[f, 1:] + self.tie * P[f, 1:] ** 2, np.inf)
            if np.isfinite(self.prune(F, self.unit[f])).any():
                level[self.unit[f]] = F
        self.table.update(level)
        return level

    def extend(self, u, F, nxt: dict) -> None:
        """Add to ``nxt`` the states reached from ``u`` by one more segment on a free device."""
        K, N, sizes, add = self.K, self.N, self.sizes, self.add
        live = np.isfinite(F[:, :, :N])
        firsts = np.flatnonzero(live.any(axis=(1, 2)))
        ds = np.flatnonzero(np.array(u) < sizes)
        if not len(firsts) or not len(ds):
            return
        cols = np.flatnonzero(live.any(axis=(0, 1)))           # stages placed so far: i
        i0, i1 = int(cols[0]), int(cols[-1]) + 1
        j0, j1 = i0 + 1, min(N, i1 - 1 + self.width) + 1       # where the next run can end
        g = np.full((len(firsts), len(ds), N + 1), np.inf)
        g[:, :, i0:i1] = add(F[firsts][:, :, None, i0:i1],
                             self.hop[None, :, ds, i0:i1]).min(axis=1)   # (f, d, i)
        rows = np.arange(len(ds))[:, None, None]
        new = add(g[:, rows, self.band_i[ds, j0:j1]], self.band_t[ds, j0:j1]).min(axis=3)
        for x in np.flatnonzero(np.isfinite(new).any(axis=(0, 2))):   # new: (f, d, j)
            d = int(ds[x])
            v = tuple(c + (j == d) for j, c in enumerate(u))
            if not np.isfinite(self.prune(new[:, x], v, j0, j1)).any():
                continue
            if v not in nxt:
                self._check_size()
                nxt[v] = self.table[v] = np.full((K, K, N + 1), np.inf)
            nxt[v][firsts, d, j0:j1] = new[:, x]

    def _check_size(self) -> None:
        if len(self.table) * self.K * self.K * (self.N + 1) * 8 >= self.max_bytes:
            raise TooLarge(
                f"the exact planner needs more than {self.max_bytes / 1e9:g} GB "
                f"({len(self.table)} states) for {self.K} kinds among {self.n_devices} "
                "devices: use mode='greedy', or describe devices of one kind "
                "identically (same speed, memory and links)")

    def keep_best(self, nxt: dict, beam: int) -> dict:
        """The ``beam`` states of least partial cost plus bound (a beam search)."""
        score = {v: float(self.add(F, self.bound(v)[None, None, :]).min())
                 for v, F in nxt.items()}
        keep = sorted(nxt, key=score.__getitem__)[:beam]
        for v in set(nxt).difference(keep):
            del self.table[v]
        return {v: nxt[v] for v in keep}

    def trace_back(self, u, first: int, last: int) -> list:
        """``[(device, start, stop), ...]`` of the plan whose value is
        ``table[u][first, last, N]``."""
        j, segs, add = self.N, [], self.add
        while sum(u) > 1:   # recompute which (previous class, start) gave F[u][first, last, j]
            prev = tuple(x - (c == last) for c, x in enumerate(u))
            g = add(self.table[prev][first, :, :], self.hop[:, last, :])      # (last', i)
            starts, costs = self.band_i[last, j], self.band_t[last, j]
            total = add(g[:, starts], costs[None, :])                         # (last', W)
            pl, w = np.unravel_index(np.argmin(total), total.shape)
            i = int(starts[w])
            segs.append((last, i, j))
            u, last, j = prev, int(pl), i
        segs.append((last, 0, j))
        pool = [list(c) for c in self.classes]
        return [(self.topo.devices[pool[c].pop(0)], i, j) for c, i, j in reversed(segs)]
