"""Continuous batching: a placed model's request queue over its lanes of KV-cache rows.

Every generate call on a ``PlacedModel`` becomes a :class:`~tfnb.runtime.tickets.Ticket`
that the scheduler queues on its least loaded :class:`~tfnb.runtime.lane.Lane`; the lane's
driver thread takes it into free rows of its caches and decodes it together with every other
busy row, so concurrent callers (threads, background cells, HTTP clients) share the batch
without waiting for each other to finish. How rows join and the caches move is
:mod:`tfnb.runtime.slots`; compiling ahead is :mod:`tfnb.runtime.warmup`.

A placement split over several devices gets one lane per device in the chain, each driven by
its own thread: while one lane's stage runs on one worker, the other lane's runs on the next,
so two requests keep both workers busy (see docs/runtime.md for the measurements behind this,
and behind the choices not made: micro-batches pipelined inside one graph, shared prefills,
chunked prompts).

Examples
--------
>>> import threading
>>> out = {}
>>> threads = [threading.Thread(target=lambda p=p: out.update({p: pm.generate(p)}))
...            for p in ("Hi", "Hello there")]                      # doctest: +SKIP
>>> for t in threads: t.start()                                     # doctest: +SKIP
>>> pm.scheduler.lanes[0].peak_rows                                 # doctest: +SKIP
2
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque

from tfnb.runtime.lane import Lane
from tfnb.runtime.slots import CHUNK_STEPS, MAX_ROWS, MIN_SLOTS
from tfnb.runtime.tickets import RECENT, SAMPLING_MODES, Seq, Ticket
from tfnb.runtime.warmup import warm_shapes

__all__ = ["Scheduler", "Lane", "Ticket", "Seq", "CHUNK_STEPS", "MIN_SLOTS", "MAX_ROWS",
           "RECENT", "SAMPLING_MODES", "warm_shapes"]


class Scheduler:
    """A placed model's request queue over its lanes (see the module docstring).

    Attributes
    ----------
    lanes : list of Lane
    served : int
        Tickets admitted so far.
    recent : deque of dict
        The last ``RECENT`` finished requests, oldest first, as :meth:`Ticket.summary` gives
        them (with ``outcome`` as their state).
    """

    def __init__(self, pm, n_lanes: int):
        self.pm = weakref.proxy(pm)
        self.cond = threading.Condition()
        self.recent: deque = deque(maxlen=RECENT)
        self.lanes = [Lane(pm, i, self.cond, self.recent) for i in range(n_lanes)]
        self.served = 0

    def submit(self, rows: list[list[int]], max_new: int, sampling, chunk: int) -> Ticket:
        """Queue a request on the least loaded lane and make sure its driver runs."""
        ticket = Ticket(rows, max_new, sampling, chunk, self.pm.config.max_context)
        with self.cond:
            lane = min(self.lanes, key=Lane.load)
            ticket.lane = lane
            lane.pending.append(ticket)
            self.served += 1
            lane.start()
            self.cond.notify_all()
        return ticket


    def warmup(self, modes, prompt_tokens: int) -> int:
        """Queue every shape of call (:func:`warm_shapes`) on each lane, for its driver to
        compile while the lane is idle (a shape compiled already is skipped when its turn
        comes); requests go first, each waiting at most for the one shape compiling. Returns
        how many shapes were queued. When a longer request makes a lane's caches bigger, the
        lane queues the shapes of its new caches again (they come with functions of their
        own); prompt buckets longer than the caches wait for that."""
        queued = 0
        for lane in self.lanes:
            queued += lane.warmup.queue(modes, prompt_tokens, **lane.cache_shape())
            with self.cond:
                lane.start()
        return queued

    def warming(self) -> int:
        """Shapes still to compile, over the lanes (the ones compiling now included)."""
        return sum(lane.warmup.left for lane in self.lanes)

    def warm_error(self) -> str | None:
        """The first error that stopped a lane's warm-up, as a message, or None."""
        return next((lane.warmup.failure for lane in self.lanes if lane.warmup.failure), None)

    def cancel_warmup(self) -> None:
        """Drop the shapes still queued (one compiling now finishes), and forget the warm-up
        (bigger caches later do not queue it again)."""
        with self.cond:
            for lane in self.lanes:
                lane.warmup.cancel()

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait until every lane compiled its queued shapes (True), or ``timeout`` s passed
        (False); raises the error that stopped a lane's compiling."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                for lane in self.lanes:
                    if lane.warmup.error is not None:
                        raise lane.warmup.error
                if not self.warming():
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(0.5 if left is None else min(0.5, left))

    def busy_rows(self) -> list[int]:
        """Rows in use per lane."""
        return [lane.busy_rows() for lane in self.lanes]

    def decode_chunks(self, t_begin: int, t_end: int) -> list[tuple[int, int, int]]:
        """``(steps, rows, window)`` of each decode call that ran within ``[t_begin, t_end]``
        (``time.time_ns()``), over every lane."""
        return [(n, B, window) for lane in self.lanes for t0, t1, n, B, window in list(lane.chunks)
                if t0 >= t_begin and t1 <= t_end]

    def status(self) -> dict:
        """What is being served now, as plain data: ``{"lanes", "requests", "recent",
        "served"}``.

        ``lanes``: per lane its ``rows`` and ``slots`` (the caches' size), ``rows_in_use``,
        ``waiting`` (requests queued) and ``waiting_rows``, the write ``slot``, counters
        ``steps``/``calls``/``shifts``/``peak_rows`` and whether its driver ``running``.
        ``requests``: every request in flight (``state`` waiting, prefill or decoding), as
        :meth:`Ticket.summary` gives them, oldest first; ``recent``: the last finished ones
        (``state`` their outcome, ``ended_at`` a ``time.time()``).

        Cheap and read-only: holds the condition only to copy the queues, so it never waits
        for a device call and never delays one.

        Examples
        --------
        >>> [r["tokens"] for r in pm.scheduler.status()["requests"]]   # doctest: +SKIP
        [12, 4]
        """
        now = time.perf_counter()
        with self.cond:
            queued = [(list(lane.pending), lane.joining) for lane in self.lanes]
            recent = list(self.recent)
        lanes, requests = [], []
        for lane, (pending, joining) in zip(self.lanes, queued):
            seqs, owners = list(lane.seqs), list(lane.owners)
            running = [t for t in dict.fromkeys(o for o in owners if o is not None)
                       if t.ended is None]
            requests += [t.summary(now, "decoding") for t in running]
            if joining is not None and joining.ended is None and joining not in running:
                requests.append(joining.summary(now, "prefill"))
            requests += [t.summary(now, "waiting") for t in pending if t.ended is None]
            thread = lane.thread
            lanes.append({"lane": lane.index, "rows": lane.rows, "slots": lane.slots,
                          "rows_in_use": sum(s is not None and not s.done for s in seqs),
                          "waiting": len(pending),
                          "waiting_rows": sum(len(t.seqs) for t in pending),
                          "slot": lane.slot, "steps": lane.steps, "calls": lane.calls,
                          "shifts": lane.shifts, "peak_rows": lane.peak_rows,
                          "running": thread is not None and thread.is_alive(),
                          "warming": lane.warmup.left,
                          "warm_error": lane.warmup.failure})
        requests.sort(key=lambda r: r["id"])
        return {"lanes": lanes, "requests": requests, "recent": recent, "served": self.served}
