"""Continuous batching: a placed model's request queue and its lanes of KV-cache rows.

Every generate call on a ``PlacedModel`` becomes a :class:`Ticket` (one sequence per prompt)
that a :class:`Lane` takes into free rows of its caches. A lane's driver thread loops: admit
waiting tickets (one prefill call each, which writes their keys into free rows at the lane's
current slot), then run a chunk of decode steps for every busy row at once. Sequences join and
leave between chunks, so concurrent callers (threads, background cells, HTTP clients) share
the batch without waiting for each other to finish.

All busy rows of a lane write the same cache slot each step; a row that joins at slot ``s``
with a prompt of ``n`` tokens is left-padded to ``pad = s - n`` (the runtime's usual padding,
:mod:`tfnb.runtime.forward`), so its tokens, positions and attention are exactly those of the
prompt alone. When the slot would run past the caches, the busy rows are moved to the front
(:func:`tfnb.runtime.graphs.shift_function`), which the padding makes invisible. Shapes stay
bucketed: busy rows to a power of two, the attended window to 64, 128, 256 ... slots (and a
chain's unrolled chunks to 1, 2, 4, 8 or 16 steps), so arrivals never recompile once those
buckets are warm.

A split placement gets one lane per device in the chain. Probed on TF 2.21 with SmolLM2 split
over two local workers pinned to one core each: one 32-step chunk alone ran 28.5 ms per step;
two chunks on separate caches called from two client threads at once ran 29.5 ms per step
*each* (1.94x the tokens per second at batch 1, 1.98x at batch 4), because each worker works on
one lane's step while the other worker works on the other's. So two requests on a split model
keep both workers busy, which one loop over both stages cannot (see the facts on overlap).

A chain's decode chunks run as unrolled graphs (:func:`tfnb.runtime.graphs.unrolled_decode`)
of 1, 2, 4, 8 or 16 steps, not a loop: a loop over several workers sends its condition round
before every step. Probed on the same machine, two lanes of 4 rows each decoding 128 tokens at
once (no prefills between): 3.0-3.9 s unrolled against 4.0-4.2 s looped, alternating in one
process, where one worker took 4.7-6.0 s for the same 8 rows. With requests arriving (8
clients, 2 requests each, 48 tokens) the gain was 8% (167-169 against 153-158 tokens/s,
interleaved): there each lane's prefills, one call per request, hold its rows and a worker for
tens of milliseconds, and the two workers were busy about 80% of the time.

What two lanes leave on the table besides, probed before unrolling: serialising each worker's
stages (a ``tf.CriticalSection`` per device around every stage call) changed nothing
measurable; a third lane adds slack but reads every weight once more per round (slower).
Probed again with unrolled chunks, as a one-token FIFO queue per worker taken once a stage's
inputs had arrived: 8 clients on the split gave 1.21-1.50x one worker with it and 1.20-1.54x
without (two processes of 3 rounds each). Decode alone is near its ceiling there: a worker's
round is one stage call per lane, 4 rows over half the model (about 12 ms), against one
worker's 8 rows over the whole model (about 36 ms).

Why micro-batches are not pipelined inside one graph instead: TF runs a single function's
calls to other workers almost one after another even where no dependency orders them. Probed
with 4 micro-batches through two workers' stages in one function: 528-558 ms compiled (431-486
not compiled) against 531-696 ms for the calls one by one, where overlapped stages would take
332-435 ms; a prefill cut into 4 such parts on the split took 488-622 ms against 549-592 ms
whole. Two lanes driven by two threads are what overlaps the workers.

Each request prefills in a call of its own. Requests queued together could share one (4
prompts of 37 tokens: 473-511 ms in one call against 560-613 ms in four, one one-core worker),
but every group size then compiles once per lane and prompt length (7-10 s there) and served
throughput did not move beyond the noise, so arrivals keep one shape per prompt length.

Nor does a prompt on a split go in chunks. While one lane's prompt fills a worker, the other
lane's next step waits behind it and the other worker idles
(:mod:`tfnb.placement.cost` counts that wait). Calls of a few prompt positions each, every
chunk attending the keys the earlier ones stored, would let that step through between them.
Probed on SmolLM2 split over two one-core workers (8 clients of 2 requests, 48 tokens, the
settings alternated in one process, 4 rounds each): the whole prompt in one call gave 203-210
tokens/s; chunks of 16 positions (3 calls for the 48-position prompt) gave 194-204; chunks of
8 gave 176-182. A lone prompt's prefill and first token took 136, 141 and 178 ms. Each call's
own cost outweighed the wait it saved.

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

import itertools
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

import numpy as np

from tfnb.errors import GenerateStalled, WorkerLostError
from tfnb.runtime.requests import bucket

__all__ = ["Scheduler", "Lane", "Ticket", "Seq", "CHUNK_STEPS", "MIN_SLOTS", "MAX_ROWS",
           "SAMPLING_MODES", "warm_shapes"]

CHUNK_STEPS = 16  # decode steps per call at most: how long a new request may wait to join
MIN_SLOTS = 256   # cache slots per lane at least, so requests join without moving the caches
MAX_ROWS = 8      # rows per lane at least (more when one request brings more prompts)
FREE_PAD = 1 << 30  # a free row's padding: past every slot of every step of a chunk, so the
#                     row attends nothing and its matmul rows are skipped (tfnb.runtime.forward)
IDLE_EXIT_S = 30.0  # a lane's driver thread ends after this long without work
RECENT = 32        # finished requests a scheduler remembers for its status
# How often a caller waiting for tokens wakes to look at its lane's progress (Ticket.next):
# the main thread often, other threads (background cells, HTTP requests) seldom. Each wake
# costs its thread about 60 us of CPU (Python 3.11, Zen 4): 8 callers waking every 0.1 s took
# 0.5% of a core, which a 2-core machine serving on two workers takes from them. A real SIGINT
# (Ctrl-C, Jupyter's interrupt on Linux) ends a timed wait at once; a simulated one
# (``_thread.interrupt_main``) only when the wait returns (probed: 0.5 s into a wait of 5 s,
# and 3.0 s into one of 3 s), so the main thread keeps short waits.
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
    whether it has ended (EOS or its budget); or an exception. ``cancel()`` (the caller stopped reading) frees its rows at the next step;
    ``finish(i)`` ends sequence ``i`` early (a stop string).

    ``id`` increases with every request of the process; ``first_token`` and ``ended`` are
    ``time.perf_counter()`` values (None until then) and ``outcome`` is ``"done"``,
    ``"cancelled"`` or ``"error"`` once its lane let it go: what :meth:`Scheduler.status`
    reads."""

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
        self.lane: Lane | None = None

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


class Lane:
    """A set of cache rows sharing one write slot, and the thread that drives them.

    Attributes
    ----------
    rows, slots : int
        The caches' size (rows x slots); 0 before the first request.
    seqs : list
        The sequence in each row, or None for a free row.
    steps, calls, shifts : int
        Decode steps, device calls and cache moves run so far.
    peak_rows : int
        The most rows busy at once so far.
    """

    def __init__(self, pm, index: int, cond: threading.Condition, recent: deque | None = None):
        # a proxy: the placed model owns its scheduler, not the other way round
        self.pm, self.index, self.cond = weakref.proxy(pm), index, cond
        self.recent = deque(maxlen=RECENT) if recent is None else recent  # finished requests
        self.lock = threading.Lock()   # one device call of this lane at a time
        self.pending: deque[Ticket] = deque()
        self.program = None
        self.rows = self.slots = 0
        self.seqs: list[Seq | None] = []
        self.owners: list[Ticket | None] = []
        self.slot = 0
        self.steps = self.calls = self.shifts = self.peak_rows = 0
        # (start ns, end ns, steps, rows B, window) of recent decode calls: what a profile
        # reads to know how many cache slots each step read (tfnb.profiler.bound)
        self.chunks: deque = deque(maxlen=4096)
        self.thread: threading.Thread | None = None
        self.joining: Ticket | None = None
        # shapes to compile while the lane is idle (Scheduler.warmup), and the one compiling
        self.warming: deque[tuple] = deque()
        self.compiling: tuple | None = None
        self.warmed = 0
        self.warm_error: BaseException | None = None
        self.warm_request: tuple | None = None  # (modes, prompt_tokens) of the last warmup

    # ----- state ---------------------------------------------------------------------------

    def busy_rows(self) -> int:
        return sum(s is not None and not s.done for s in self.seqs)

    def load(self) -> int:
        """Rows in use plus rows waiting: where the scheduler sends the next ticket (called
        with the scheduler's condition held, which guards ``pending``)."""
        joining = self.joining
        return self.busy_rows() + sum(len(t.seqs) for t in self.pending) + (
            len(joining.seqs) if joining is not None else 0)

    def _free(self, ticket: Ticket) -> None:
        for row, owner in enumerate(self.owners):
            if owner is ticket:
                self.seqs[row] = self.owners[row] = None

    def _ended(self, ticket: Ticket, outcome: str | None = None) -> None:
        """Note once that ``ticket`` left this lane, in the record of recent requests
        (``outcome`` by default: done when every sequence ended, else cancelled)."""
        if ticket.ended is not None:
            return
        if outcome is None:
            outcome = "done" if all(s.done for s in ticket.seqs) else "cancelled"
        ticket.ended, ticket.outcome = time.perf_counter(), outcome
        with self.cond:  # a status reads the record under the condition too
            self.recent.append({**ticket.summary(ticket.ended, outcome),
                                "ended_at": time.time()})

    # ----- the driver --------------------------------------------------------------------

    @staticmethod
    def drive(ref: "weakref.ref[Lane]", cond: threading.Condition) -> None:
        """The driver thread: admit, step, repeat; ends after ``IDLE_EXIT_S`` without work, or
        once its placed model is gone (it holds the lane only while it works, so dropping a
        placed model frees its variables on the workers at once, as before batching)."""
        idle_since = time.monotonic()
        while True:
            with cond:
                lane = ref()
                if lane is None:
                    return
                if not lane.pending and not lane.busy_rows() and not lane.warming and \
                        all(o is None for o in lane.owners):  # ended rows are retired first
                    if time.monotonic() - idle_since > IDLE_EXIT_S:
                        lane.thread = None
                        return
                    del lane
                    cond.wait(1.0)
                    continue
            idle_since = time.monotonic()
            try:
                lane._retire()
                lane._admit()
                if lane.busy_rows():
                    lane._step()
                elif lane.warming and not lane.pending:
                    lane._retire()  # rows ended by their callers (stop strings) leave first
                    lane._warm_next()
            except ReferenceError:  # the placed model was dropped while its last chunk ran
                return
            except BaseException as e:  # noqa: BLE001 - every waiting caller gets it
                try:
                    lane._fail(e)
                except ReferenceError:
                    return
            del lane

    def _fail(self, error: BaseException) -> None:
        """Hand ``error`` to every ticket in the lane; queued ones too when the placement is
        lost (they cannot run either)."""
        failed = {id(t): t for t in self.owners + [self.joining] if t is not None}
        self.joining = None
        if self.pm.lost or isinstance(error, WorkerLostError):
            with self.cond:
                while self.pending:
                    t = self.pending.popleft()
                    failed[id(t)] = t
        for t in failed.values():
            t.events.put(error)
            self._free(t)
            self._ended(t, "error")
        self.slot = 0

    def _retire(self) -> None:
        for row, (seq, owner) in enumerate(zip(self.seqs, self.owners)):
            if seq is not None and (seq.done or owner.cancelled):
                self.seqs[row] = self.owners[row] = None
                if not owner.active:
                    self._ended(owner)

    def _admit(self) -> None:
        while self.pending:
            ticket = self.pending[0]
            if ticket.cancelled:
                with self.cond:
                    self.pending.popleft()
                self._ended(ticket, "cancelled")
                continue
            if self.pm.lost:
                raise WorkerLostError(self.pm.lost)
            try:
                room = self._make_room(ticket)
            except BaseException:
                with self.cond:  # it fails with the lane's error, not stays first in the queue
                    self.joining = self.pending.popleft()
                raise
            if not room:
                return  # it waits for busy rows to finish (first come, first served)
            with self.cond:  # counted in load() until it holds rows; a failing prefill fails it
                self.joining = self.pending.popleft()
            self._prefill(ticket)
            self.joining = None

    def _make_room(self, ticket: Ticket) -> bool:
        """Rows and slots for ``ticket`` (the caches grow, or move, only when that is needed);
        False when it must wait for busy rows to end."""
        n = bucket(len(ticket.seqs), 1, fine=False)
        if not self.busy_rows():
            self._caches(n, ticket.need)
            self.slot = ticket.P
            return True
        if self._free_block(n) is None or ticket.need > self.slots:
            return False
        busy = [s for s in self.seqs if s is not None and not s.done]
        left = max([s.remaining for s in busy] + [ticket.seqs[0].remaining])
        if self.slot >= ticket.P and self.slot + left <= self.slots:
            return True
        content = self.slot - min(s.pad for s in busy)  # slots the busy rows still attend
        target = max(ticket.P, content)
        if target + left > self.slots:
            return False
        self._shift(target - self.slot)
        return True

    def _caches(self, n: int, need: int) -> None:
        """Caches of at least ``n`` rows and ``need`` slots (called while no row is busy): the
        lane's own, or new ones when they are too small or not made yet."""
        if self.program is not None and n <= self.rows and need <= self.slots:
            return
        cfg = self.pm.config
        rows = max(self.rows, n, self.pm.max_batch)
        slots = max(self.slots, min(cfg.max_context, max(
            MIN_SLOTS, bucket(need, 64, maximum=cfg.max_context))))
        replaced, self.program = self.program is not None, None  # the old caches go first
        self.program = self.pm.program(rows, slots, owner=self.index)
        self.rows, self.slots = rows, slots
        self.seqs, self.owners = [None] * self.rows, [None] * self.rows
        if replaced and self.warm_request is not None:
            self.queue_warm(*self.warm_request)  # new caches come with functions of their own

    @property
    def warm_left(self) -> int:
        """Shapes still to compile, the one compiling now included."""
        return len(self.warming) + (self.compiling is not None)

    @property
    def warm_failure(self) -> str | None:
        """The error that stopped this lane's warm-up, as a message, or None."""
        e = self.warm_error
        return None if e is None else f"{type(e).__name__}: {e}"

    def queue_warm(self, modes, prompt_tokens: int) -> int:
        """Queue the shapes (:func:`warm_shapes`) of this lane's caches, or of the caches its
        first request makes; returns how many."""
        cfg = self.pm.config
        shapes = warm_shapes(self.rows or self.pm.max_batch,
                             self.slots or min(cfg.max_context, MIN_SLOTS),
                             len(self.pm.devices) > 1, modes, prompt_tokens)
        with self.cond:
            self.warm_request, self.warm_error = (modes, prompt_tokens), None
            self.warming.extend(s for s in shapes if s not in self.warming and s != self.compiling)
            self.cond.notify_all()
        return len(shapes)

    def _compact(self, first: int, n: int) -> None:
        """Move the busy rows' slots to the front when that makes the attended window smaller
        (``first`` is the earliest slot any busy row attends, ``n`` the next chunk's steps).

        Requests that come and go keep moving the slot on; without this the window would
        grow to the whole cache (every step reading every slot), and each new window size
        compiles the decode functions again. Moving is one copy of the caches, about one
        decode step's bytes, every few dozen steps."""
        if first <= 0 or bucket(self.slot + n, 64, fine=False) <= bucket(
                self.slot - first + n, 64, fine=False):
            return
        self._shift(-first)

    def _shift(self, delta: int) -> None:
        """Every cache slot moved by ``delta``, and the busy rows' padding with it."""
        self.pm.run(self.program.shift_fn(), (np.int32(delta),), what="moving the KV caches",
                    lock=self.lock)
        self.shifts += 1
        for s in self.seqs:
            if s is not None:
                s.pad += delta
        self.slot += delta

    def _free_block(self, n: int) -> int | None:
        """The first row of ``n`` consecutive free rows (aligned to ``n``), or None."""
        for start in range(0, self.rows - n + 1, n):
            if all(s is None for s in self.seqs[start:start + n]):
                return start
        return None

    def _prefill(self, ticket: Ticket) -> None:
        pm, P = self.pm, ticket.P
        n = bucket(len(ticket.seqs), 1, fine=False)
        first = self._free_block(n)
        ids = np.full((n, P), pm.pad_id, np.int32)
        pad = np.full((n,), P - 1, np.int32)
        for i, seq in enumerate(ticket.seqs):
            ids[i, P - len(seq.ids):] = seq.ids
            pad[i] = P - len(seq.ids)
        done = np.arange(n) >= len(ticket.seqs)
        floats = np.tile(np.float32(ticket.floats), (n, 1))
        ints = np.tile(np.int32(ticket.ints), (n, 1))
        ticket.started = time.perf_counter()
        tok, _ = pm.run(self.program.prefill_fn(ticket.mode),
                        (ids, pad, np.int32(self.slot - P), np.int32(first), done, floats, ints),
                        what="generate", lock=self.lock)
        self.calls += 1
        for i, seq in enumerate(ticket.seqs):
            seq.row, seq.pad = first + i, self.slot - len(seq.ids)
            self.seqs[seq.row], self.owners[seq.row] = seq, ticket
        self.peak_rows = max(self.peak_rows, self.busy_rows())
        self._deliver(tok[None], [ticket], first_row=first)

    def _step(self) -> None:
        pm = self.pm
        busy = [(r, s) for r, s in enumerate(self.seqs) if s is not None and not s.done]
        B = bucket(busy[-1][0] + 1, 1, fine=False)
        n = min([CHUNK_STEPS, self.slots - self.slot] +
                [min(s.remaining, s.chunk - s.made % s.chunk) for _, s in busy])
        if self.program.unrolled:
            n = self._unrolled_steps(n, busy)
        self._compact(min(s.pad for _, s in busy), n)
        window = min(self.slots, bucket(self.slot + n, 64, fine=False))
        tok, pad, done, floats, ints = _free_rows(B, pm.pad_id)
        modes = set()
        for r, s in busy:
            t = self.owners[r]
            tok[r], pad[r], done[r] = s.last, s.pad, False
            floats[r], ints[r] = t.floats, t.ints
            modes.add(t.mode)
        mode = max(modes, key=SAMPLING_MODES.index)
        t0 = time.time_ns()
        tokens, count, slot, _, _ = pm.run(
            self.program.decode_fn(mode, window, n),
            (tok, pad, np.int32(self.slot), done, np.int32(n), floats, ints),
            what="generate", lock=self.lock)
        self.calls += 1
        self.steps += int(count)
        self.chunks.append((t0, time.time_ns(), int(count), B, window))
        self.slot = int(slot)
        owners = list(dict.fromkeys(self.owners[r] for r, _ in busy))
        self._deliver(tokens[:int(count)], owners)

    def _unrolled_steps(self, n: int, busy) -> int:
        """The chunk length an unrolled program runs for ``n`` wanted steps: a graph per
        length, so powers of two only. Rounded up when that wastes at most one step in eight
        (15 -> 16: one call instead of four), the caches allow it and no row that goes on
        would pass the end of its event chunk (a row that ends within the chunk drops the
        tokens past its end); rounded down otherwise. So ``Lane.steps`` may exceed the tokens
        made by a few steps per request."""
        up = 1 << (n - 1).bit_length()
        cap = min([CHUNK_STEPS, self.slots - self.slot] +
                  [s.chunk - s.made % s.chunk for _, s in busy
                   if s.remaining > s.chunk - s.made % s.chunk])
        if up - n <= max(1, up // 8) and up <= cap:
            return up
        return 1 << (n.bit_length() - 1)

    # ----- compiling ahead ----------------------------------------------------------------

    def _warm_next(self) -> None:
        """Compile the first shape of ``warming`` (the driver calls this only while no request
        is in the lane, so the call's writes land in free rows): one call of the shape that
        requests would make, on rows nobody reads. A failure clears the rest."""
        with self.cond:
            if not self.warming:  # cancelled meanwhile
                return
            self.compiling = self.warming.popleft()
        kind, mode, window, steps, B = self.compiling
        try:
            self._caches(1 if kind == "prefill" else B, 1)
            if kind == "prefill" and B + 1 > self.slots:
                fn = None  # a prompt this long makes bigger caches (and compiles then)
            elif kind == "shift":
                fn, args = self.program.shift_fn(), (np.int32(0),)
            elif kind == "prefill":
                fn = self.program.prefill_fn(mode)
                _, pad, done, floats, ints = _free_rows(1, self.pm.pad_id)
                floats[:, 0] = 1.0
                args = (np.full((1, B), self.pm.pad_id, np.int32), np.zeros(1, np.int32),
                        np.int32(0), np.int32(0), ~done, floats, ints)
            else:
                window = min(window, self.slots)
                fn = self.program.decode_fn(mode, window, steps)
                tok, pad, done, floats, ints = _free_rows(B, self.pm.pad_id)
                floats[:, 0] = 1.0  # a temperature: these rows sample (their tokens go unread)
                n = steps or 1  # a row that is not done runs the step (and so compiles it)
                args = (tok, pad, np.int32(window - n), ~done, np.int32(n), floats, ints)
            if fn is not None and not self.pm.compiled(fn, args):
                self.pm.run(fn, args, what="warming up", lock=self.lock)
                self.warmed += 1
        except BaseException as e:
            with self.cond:
                self.warming.clear()
                self.warm_error = e
            raise
        finally:
            with self.cond:
                self.compiling = None
                self.cond.notify_all()

    def _deliver(self, tokens_NxB: np.ndarray, tickets: list[Ticket], first_row: int = 0) -> None:
        """Hand each ticket its sequences' new tokens (up to EOS or their budget); column
        ``b`` of ``tokens_NxB`` is row ``first_row + b``."""
        eos = set(self.pm.eos_ids)
        for t in tickets:
            new = []
            for seq in t.seqs:
                got = []
                if not seq.done:
                    for tok in tokens_NxB[:, seq.row - first_row].tolist():
                        got.append(tok)
                        seq.made += 1
                        seq.remaining -= 1
                        if tok in eos or seq.remaining == 0:
                            seq.done = True
                            break
                    if got:
                        seq.last = got[-1]
                new.append(got)
            if t.first_token is None and any(new):
                t.first_token = time.perf_counter()
            t.events.put((new, [seq.done for seq in t.seqs]))
            if not t.active:
                self._free(t)
                self._ended(t)


def _free_rows(B: int, pad_id: int):
    """``(tok, pad, done, floats, ints)`` of ``B`` free rows: they see nothing (so their
    matmul rows are skipped) and are done; a call's busy rows are written over them."""
    return (np.full((B,), pad_id, np.int32), np.full((B,), FREE_PAD, np.int32),
            np.ones((B,), bool), np.tile(np.float32([0.0, 1.0]), (B, 1)),
            np.zeros((B, 2), np.int32))


def warm_shapes(rows: int, slots: int, unrolled: bool, modes, prompt_tokens: int) -> list:
    """The call shapes a lane of ``rows`` x ``slots`` caches runs, as ``(kind, mode, window,
    steps, B)`` (for a prefill, ``B`` is the prompt's bucketed length), likeliest first, each
    tier for every mode in turn: the batch buckets at the first two windows; each prompt
    bucket up to ``prompt_tokens`` and moving the caches; the larger windows; then a chain's
    shorter chunks (a request's first and last events). On a chain the first chunk length of a
    batch and window is the one that compiles the stages (about 5 s for SmolLM2 on one core);
    the others of that batch and window cost about 1 s each.

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
            + [("shift", None, None, None, 0)]  # moving the caches (Lane._compact)
            + decode(windows[2:], main) + decode(windows, tails))


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
            self._drive(lane)
            self.cond.notify_all()
        return ticket

    def _drive(self, lane: Lane) -> None:
        """Start ``lane``'s driver thread unless it runs (called with the condition held)."""
        if lane.thread is None:
            lane.thread = threading.Thread(target=Lane.drive, args=(weakref.ref(lane), self.cond),
                                           name=f"tfnb-lane-{lane.index}", daemon=True)
            lane.thread.start()

    def warmup(self, modes, prompt_tokens: int) -> int:
        """Queue every shape of call (:func:`warm_shapes`) on each lane, for its driver to
        compile while the lane is idle (a shape compiled already is skipped when its turn
        comes); requests go first, each waiting at most for the one shape compiling. Returns
        how many shapes were queued. When a longer request makes a lane's caches bigger, the
        lane queues the shapes of its new caches again (they come with functions of their
        own); prompt buckets longer than the caches wait for that."""
        queued = 0
        for lane in self.lanes:
            queued += lane.queue_warm(modes, prompt_tokens)
            with self.cond:
                self._drive(lane)
        return queued

    def warming(self) -> int:
        """Shapes still to compile, over the lanes (the ones compiling now included)."""
        return sum(lane.warm_left for lane in self.lanes)

    def warm_error(self) -> str | None:
        """The first error that stopped a lane's warm-up, as a message, or None."""
        return next((lane.warm_failure for lane in self.lanes if lane.warm_failure), None)

    def cancel_warmup(self) -> None:
        """Drop the shapes still queued (one compiling now finishes), and forget the warm-up
        (bigger caches later do not queue it again)."""
        with self.cond:
            for lane in self.lanes:
                lane.warming.clear()
                lane.warm_request = None

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait until every lane compiled its queued shapes (True), or ``timeout`` s passed
        (False); raises the error that stopped a lane's compiling."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                for lane in self.lanes:
                    if lane.warm_error is not None:
                        raise lane.warm_error
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
                          "warming": lane.warm_left, "warm_error": lane.warm_failure})
        requests.sort(key=lambda r: r["id"])
        return {"lanes": lanes, "requests": requests, "recent": recent, "served": self.served}
