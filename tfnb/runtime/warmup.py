"""Compiling ahead: the call shapes a lane runs, queued for it to compile while it is idle.

A new shape of call compiles when a request first needs it, and every request of its lane waits
meanwhile. ``PlacedModel.warmup`` queues every shape serving meets (:func:`warm_shapes`) on
each lane's :class:`WarmupQueue`; the lane's driver compiles them one at a time while no request
is in the lane (requests go first, each waiting at most for the one shape compiling), each as
one call of that shape on rows nobody reads (:func:`warm_call`).

One vocabulary: a warm-up is *queued* (:meth:`WarmupQueue.queue`, again for new caches by
:meth:`WarmupQueue.requeue`), its shapes *taken* and *done* one at a time, *cancelled* as a
whole; ``left`` counts the shapes still to compile, ``compiled`` those that did, ``error``
(``failure`` as a message) is what stopped it.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from tfnb.runtime.requests import bucket
from tfnb.runtime.slots import CHUNK_STEPS, free_rows

__all__ = ["warm_shapes", "warm_call", "WarmupQueue"]


def warm_shapes(rows: int, slots: int, unrolled: bool, modes, prompt_tokens: int) -> list:
    """The call shapes a lane of ``rows`` x ``slots`` caches runs, as ``(kind, mode, window,
    steps, B)`` (for a prefill, ``B`` is the prompt's bucketed length), likeliest first, each
    tier for every mode in turn: the batch buckets at the first two windows; each prompt
    bucket up to ``prompt_tokens`` and moving the caches; the larger windows; then a chain's
    shorter chunks (a request's first and last events). On a chain the first chunk length of a
    batch and window is the one that compiles the stages; the others of that batch and window
    reuse them and cost much less (see docs/runtime.md).

    Examples
    --------
    >>> len(warm_shapes(8, 256, False, ["greedy"], 48))  # 3 windows x 4 batches, 4 prompts, shift
    17
    >>> warm_shapes(8, 256, False, ["greedy", "sample"], 0)[7:9]
    [('decode', 'greedy', 128, None, 8), ('decode', 'sample', 64, None, 1)]
    """
    windows, w = [], 64
    while not windows or windows[-1] < slots:
        windows.append(min(w, slots))
        w *= 2
    batches = [1 << k for k in range(rows.bit_length()) if 1 << k <= rows]
    main, tails = ((CHUNK_STEPS, 4), (8, 2, 1)) if unrolled else ((None,), ())
    prompts = sorted({bucket(n, 16) for n in range(1, prompt_tokens + 1)})

    def decode(ws, steps):
        return [("decode", mode, w, n, B) for mode in modes for w in ws for B in batches
                for n in steps if (n or 1) <= w]
    return (decode(windows[:2], main)
            + [("prefill", mode, None, None, P) for mode in modes for P in prompts]
            + [("shift", None, None, None, 0)]  # moving the caches (Lane._shift)
            + decode(windows[2:], main) + decode(windows, tails))


def warm_call(program, shape: tuple, slots: int, pad_id: int):
    """``(fn, args)``: one call of ``shape`` (as :func:`warm_shapes` gives it) on ``program``,
    whose caches have ``slots`` slots, that compiles it and writes only rows nobody reads (the
    lane calls it while it has no request); None for a prompt bucket longer than the caches
    (a prompt that long makes bigger caches, and compiles then)."""
    kind, mode, window, steps, B = shape
    if kind == "prefill" and B + 1 > slots:
        return None
    if kind == "shift":
        return program.shift_fn(), (np.int32(0),)
    if kind == "prefill":
        _, _, done, floats, ints = free_rows(1, pad_id)
        floats[:, 0] = 1.0
        return program.prefill_fn(mode), (
            np.full((1, B), pad_id, np.int32), np.zeros(1, np.int32), np.int32(0), np.int32(0),
            ~done, floats, ints)
    window = min(window, slots)
    tok, pad, done, floats, ints = free_rows(B, pad_id)
    floats[:, 0] = 1.0  # a temperature: these rows sample (their tokens go unread)
    n = steps or 1  # a row that is not done runs the step (and so compiles it)
    return program.decode_fn(mode, window, steps), (
        tok, pad, np.int32(window - n), ~done, np.int32(n), floats, ints)


class WarmupQueue:
    """One lane's warm-up: the shapes it still has to compile, and how it went.

    Guarded by the scheduler's condition ``cond`` (notified when a shape is done, so that
    waiters wake).

    Attributes
    ----------
    shapes : deque of tuple
        Shapes queued, next first (as :func:`warm_shapes` gives them).
    compiling : tuple or None
        The shape being compiled now.
    compiled : int
        Shapes compiled so far (a shape that was compiled already is not counted).
    error : BaseException or None
        What stopped the warm-up (it cleared the queue).
    request : tuple or None
        ``(modes, prompt_tokens)`` of the last :meth:`queue`, until cancelled: what
        :meth:`requeue` queues again when the lane's caches are replaced.

    Examples
    --------
    >>> q = WarmupQueue(threading.Condition())
    >>> q.queue(["greedy"], 16, rows=1, slots=64, unrolled=False), q.left
    (3, 3)
    >>> q.take()
    ('decode', 'greedy', 64, None, 1)
    >>> q.done(compiled=True); q.left, q.compiled
    (2, 1)
    """

    def __init__(self, cond: threading.Condition):
        self.cond = cond
        self.shapes: deque[tuple] = deque()
        self.compiling: tuple | None = None
        self.compiled = 0
        self.error: BaseException | None = None
        self.request: tuple | None = None

    @property
    def left(self) -> int:
        """Shapes still to compile, the one compiling now included."""
        return len(self.shapes) + (self.compiling is not None)

    @property
    def failure(self) -> str | None:
        """:attr:`error` as a message, or None."""
        e = self.error
        return None if e is None else f"{type(e).__name__}: {e}"

    def queue(self, modes, prompt_tokens: int, *, rows: int, slots: int,
              unrolled: bool) -> int:
        """Queue the shapes of caches of ``rows`` x ``slots`` (those not queued or compiling
        already), remember the request and forget an earlier error; returns how many shapes
        the request has."""
        shapes = warm_shapes(rows, slots, unrolled, modes, prompt_tokens)
        with self.cond:
            self.request, self.error = (modes, prompt_tokens), None
            self.shapes.extend(s for s in shapes if s not in self.shapes and s != self.compiling)
            self.cond.notify_all()
        return len(shapes)

    def requeue(self, *, rows: int, slots: int, unrolled: bool) -> None:
        """Queue the last request again for new caches (they come with functions of their
        own); nothing when there was none, or it was cancelled."""
        if self.request is not None:
            self.queue(*self.request, rows=rows, slots=slots, unrolled=unrolled)

    def take(self) -> tuple | None:
        """The next shape, now :attr:`compiling`; None when none is queued."""
        with self.cond:
            if not self.shapes:
                return None
            self.compiling = self.shapes.popleft()
            return self.compiling

    def done(self, compiled: bool = False, error: BaseException | None = None) -> None:
        """The shape taken is done: ``compiled`` by its call, or stopped by ``error`` (which
        drops the rest of the queue)."""
        with self.cond:
            if error is not None:
                self.shapes.clear()
                self.error = error
            self.compiled += compiled
            self.compiling = None
            self.cond.notify_all()

    def cancel(self) -> None:
        """Drop the shapes queued (one compiling now finishes) and forget the request, so new
        caches do not queue it again."""
        with self.cond:
            self.shapes.clear()
            self.request = None
