"""A generate call as the scheduler sees it: a :class:`Ticket` of sequences, and its events.

Every generate call on a ``PlacedModel`` becomes one ticket (one :class:`Seq` per prompt). Its
lane sends back events ``(new_ids, done)`` between chunks, or the exception that ended it; the
caller reads them with :meth:`Ticket.next`, which also notices a lane that stopped making
calls. A finished ticket leaves a summary in its scheduler's record of recent requests.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass

from tfnb.errors import GenerateStalled
from tfnb.runtime.requests import bucket

__all__ = ["Seq", "Ticket", "RECENT", "SAMPLING_MODES", "WATCH_EVERY_S"]

RECENT = 32        # finished requests a scheduler remembers for its status
# How often a caller waiting for tokens wakes to look at its lane's progress (Ticket.next):
# the main thread often (an interrupt simulated with ``_thread.interrupt_main`` lands only when
# a wait returns), other threads (background cells, HTTP requests) seldom, since every wake
# costs CPU that a small machine's workers need (see docs/runtime.md).
WATCH_EVERY_S = (0.1, 1.0)  # (main thread, others)
SAMPLING_MODES = ("greedy", "sample", "filter")  # the heads' modes, by what a batch needs
_IDS = itertools.count(1)  # request ids, increasing over the process (next() is atomic)


@dataclass
class Seq:
    """One prompt of a ticket, and where it sits in its lane."""
    ids: list[int]
    remaining: int           # tokens still to generate
    chunk: int               # the ticket's tokens per event
    row: int = -1
    pad: int = 0             # left padding in the lane's rows
    last: int = 0            # the last token (written to the cache by the next step)
    made: int = 0            # tokens generated so far
    done: bool = False


class Ticket:
    """One request in a scheduler: its sequences, and the events its lane sends back.

    Each event is ``(new_ids, done)``: per sequence, the new token ids since the last event and
    whether it has ended (EOS or its budget); or an exception. ``cancel()`` (the caller stopped
    reading) frees its rows at the next step; ``finish(i)`` ends sequence ``i`` early (a stop
    string).

    ``id`` increases with every request of the process; ``first_token`` and ``ended`` are
    ``time.perf_counter()`` values (None until then) and ``outcome`` is ``"done"``,
    ``"cancelled"`` or ``"error"`` once its lane let it go: what
    :meth:`tfnb.runtime.scheduler.Scheduler.status` reads.

    Examples
    --------
    >>> from tfnb.runtime.requests import Sampling
    >>> t = Ticket([[5, 6, 7]], 8, Sampling("greedy", 1.0, 0, 1.0, 0), chunk=4)
    >>> t.P, t.need, [s.remaining for s in t.seqs]   # prompt bucket, slots it spans
    (16, 24, [8])
    """

    def __init__(self, rows: list[list[int]], max_new: int, sampling, chunk: int,
                 max_context: int | None = None):
        self.id = next(_IDS)
        self.seqs = [Seq(list(r), max_new, chunk) for r in rows]
        self.max_new = max_new
        # the prompt's bucket, but never so long that its tokens and the new ones pass the
        # context (which caps the caches): a bucket may round a long prompt past that
        self.P = bucket(max(len(r) for r in rows), 16,
                        maximum=None if max_context is None else max_context - max_new)
        self.need = self.P + max_new  # slots from the prompt's start to the last token
        mode_floats = 0.0 if sampling.mode == "greedy" else sampling.temperature
        self.mode = sampling.mode
        self.floats = (mode_floats, sampling.top_p)
        self.ints = (sampling.top_k, sampling.seed)
        self.events: queue.Queue = queue.Queue()
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.started: float | None = None   # when its prefill began (queue wait before)
        self.first_token: float | None = None
        self.ended: float | None = None
        self.outcome: str | None = None
        self.lane = None  # the tfnb.runtime.lane.Lane it is queued on

    @property
    def made(self) -> int:
        """Tokens generated so far, all its sequences together."""
        return sum(s.made for s in self.seqs)

    def summary(self, now: float, state: str) -> dict:
        """This request as plain data at ``now`` (``time.perf_counter()``): what a serving
        view shows. Times in seconds from its submission; tokens/s as ``last_stats`` counts
        them (tokens over the time since it was submitted)."""
        end = self.ended or now
        made, age = self.made, end - self.submitted
        return {"id": self.id, "state": state,
                "lane": None if self.lane is None else self.lane.index,
                "prompts": len(self.seqs), "prompt_tokens": [len(s.ids) for s in self.seqs],
                "tokens": made, "max_tokens": self.max_new * len(self.seqs),
                "age_s": age, "queue_s": (self.started or end) - self.submitted,
                "first_token_s": None if self.first_token is None
                else self.first_token - self.submitted,
                "tokens_per_s": made / age if age > 0 else 0.0}

    @property
    def active(self) -> bool:
        return not self.cancelled and not all(s.done for s in self.seqs)

    def cancel(self) -> None:
        self.cancelled = True

    def finish(self, i: int) -> None:
        self.seqs[i].done = True

    def next(self, timeout: float | None):
        """The next event ``(new_ids, done)``; raises the lane's error, or GenerateStalled when
        its lane made no call for ``timeout`` s (its calls have their own deadlines, so this
        only guards against a driver that stopped)."""
        calls, since = -1, time.monotonic()
        every = WATCH_EVERY_S[threading.current_thread() is not threading.main_thread()]
        while True:
            try:
                event = self.events.get(timeout=every)
                break
            except queue.Empty:
                if self.lane is not None and self.lane.calls != calls:
                    calls, since = self.lane.calls, time.monotonic()
                if timeout is not None and time.monotonic() - since > timeout:
                    raise GenerateStalled(f"no tokens for this request within {timeout:.0f} s, "
                                        "and its batch made no progress: try again, or place "
                                        "the model again") from None
        if isinstance(event, BaseException):
            raise event
        return event
