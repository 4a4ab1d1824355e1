"""A lane: KV-cache rows sharing one write slot, and the driver thread that runs them.

The driver loops: retire ended rows, admit waiting tickets (one prefill call each, writing
their keys into free rows at the lane's write slot), then run a chunk of decode steps for
every busy row at once; with nothing to run it compiles its queued warm-up shapes. Tickets join
and leave between chunks. Where rows sit, how far the slots move and which shapes a call has
is :mod:`tfnb.runtime.slots`; the lane holds the state and makes the calls.

Everything a lane runs goes through its placed model (``pm.program`` for the compiled
functions over a set of caches, ``pm.run`` to call one), so a lane runs against any object
with that surface.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque

import numpy as np

from tfnb.errors import WorkerLostError
from tfnb.runtime import slots as S
from tfnb.runtime.tickets import RECENT, SAMPLING_MODES, Seq, Ticket
from tfnb.runtime.warmup import WarmupQueue, warm_call
from tfnb.shutdown import exiting, start_thread

__all__ = ["Lane", "IDLE_EXIT_S"]

IDLE_EXIT_S = 30.0  # a lane's driver thread ends after this long without work


class Lane:
    """A set of cache rows sharing one write slot, and the thread that drives them.

    Attributes
    ----------
    rows, slots : int
        The caches' size (rows x slots); 0 before the first request.
    seqs : list
        The sequence in each row, or None for a free row.
    slot : int
        The slot the next step writes.
    steps, calls, shifts : int
        Decode steps, device calls and cache moves run so far.
    peak_rows : int
        The most rows busy at once so far.
    chunks : deque of tuple
        ``(start ns, end ns, steps, rows B, window)`` of recent decode calls: what a profile
        reads to know how many cache slots each step read (:mod:`tfnb.profiler.bound`).
    warmup : WarmupQueue
        The shapes this lane compiles while idle.
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
        self.chunks: deque = deque(maxlen=4096)
        self.thread: threading.Thread | None = None
        self.joining: Ticket | None = None
        self.warmup = WarmupQueue(cond)

    # ----- state ---------------------------------------------------------------------------

    def busy_rows(self) -> int:
        return sum(s is not None and not s.done for s in self.seqs)

    def load(self) -> int:
        """Rows in use plus rows waiting: where the scheduler sends the next ticket (called
        with the scheduler's condition held, which guards ``pending``)."""
        joining = self.joining
        return self.busy_rows() + sum(len(t.seqs) for t in self.pending) + (
            len(joining.seqs) if joining is not None else 0)

    def cache_shape(self) -> dict:
        """``rows``, ``slots`` and ``unrolled`` of this lane's caches, or of the caches its
        first request makes: what its warm-up compiles for."""
        cfg = self.pm.config
        return {"rows": self.rows or self.pm.max_batch,
                "slots": self.slots or min(cfg.max_context, S.MIN_SLOTS),
                "unrolled": len(self.pm.devices) > 1}

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
    def drive(ref: weakref.ref[Lane], cond: threading.Condition) -> None:
        """The driver thread: admit, step, repeat; ends after ``IDLE_EXIT_S`` without work, or
        once its placed model is gone (it holds the lane only while it works, so dropping a
        placed model frees its variables on the workers at once)."""
        idle_since = time.monotonic()
        while True:
            with cond:
                lane = ref()
                if lane is None or exiting():  # at exit: after the call under way
                    if lane is not None:
                        lane.thread = None
                    return
                if not lane.pending and not lane.busy_rows() and not lane.warmup.shapes and \
                        all(o is None for o in lane.owners):  # ended rows are retired first
                    if time.monotonic() - idle_since > IDLE_EXIT_S:
                        lane.thread = None
                        return
                    del lane
                    cond.wait(1.0)
                    continue
            idle_since = time.monotonic()
            try:
                lane.turn()
            except ReferenceError:  # the placed model was dropped while its last chunk ran
                return
            except BaseException as e:  # noqa: BLE001 - every waiting caller gets it
                try:
                    lane._fail(e)
                except ReferenceError:
                    return
            del lane

    def start(self) -> None:
        """Start the driver thread unless it runs (called with the condition held)."""
        if self.thread is None and not exiting():
            self.thread = start_thread(Lane.drive, weakref.ref(self), self.cond,
                                       name=f"tfnb-lane-{self.index}", wake=self.cond)

    def turn(self) -> None:
        """One turn of the driver: retire ended rows, admit what fits, run a chunk of decode
        steps; with no row busy and no request waiting, compile one shape of the warm-up.
        An error is the caller's to hand on (:meth:`drive` fails the lane's tickets with it)."""
        self._retire()
        self._admit()
        if self.busy_rows():
            self._step()
        elif self.warmup.shapes and not self.pending:
            self._retire()  # rows ended by their callers (stop strings) leave first
            self._warm_next()

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
        n = S.block_rows(len(ticket.seqs))
        if not self.busy_rows():
            self._caches(n, ticket.need)
            self.slot = ticket.P
            return True
        if S.free_block(self.seqs, n) is None or ticket.need > self.slots:
            return False
        busy = [s for s in self.seqs if s is not None and not s.done]
        delta = S.join_shift(self.slot, self.slots, ticket.P,
                             left=max([s.remaining for s in busy] + [ticket.seqs[0].remaining]),
                             first=min(s.pad for s in busy))
        if delta is None:
            return False
        if delta:
            self._shift(delta)
        return True

    def _caches(self, n: int, need: int) -> None:
        """Caches of at least ``n`` rows and ``need`` slots (called while no row is busy): the
        lane's own, or new ones when they are too small or not made yet."""
        if self.program is not None and n <= self.rows and need <= self.slots:
            return
        rows, slots = S.cache_size(self.rows, self.slots, n, need, self.pm.max_batch,
                                   self.pm.config.max_context)
        replaced, self.program = self.program is not None, None  # the old caches go first
        self.program = self.pm.program(rows, slots, owner=self.index)
        self.rows, self.slots = rows, slots
        self.seqs, self.owners = [None] * self.rows, [None] * self.rows
        if replaced:  # new caches come with functions of their own
            self.warmup.requeue(**self.cache_shape())

    def _shift(self, delta: int) -> None:
        """Every cache slot moved by ``delta``, and the busy rows' padding with it."""
        self.pm.run(self.program.shift_fn(), (np.int32(delta),), what="moving the KV caches",
                    lock=self.lock)
        self.shifts += 1
        for s in self.seqs:
            if s is not None:
                s.pad += delta
        self.slot += delta

    # ----- calls ---------------------------------------------------------------------------

    def _prefill(self, ticket: Ticket) -> None:
        pm, P = self.pm, ticket.P
        ids, pad, done = S.prompt_block([seq.ids for seq in ticket.seqs], P, pm.pad_id)
        n = len(done)
        first = S.free_block(self.seqs, n)
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
        B = S.block_rows(busy[-1][0] + 1)
        n = S.chunk_steps(self.slot, self.slots, [s for _, s in busy])
        if self.program.unrolled:
            n = S.unrolled_steps(n, self.slot, self.slots, [s for _, s in busy])
        delta = S.compact_shift(self.slot, min(s.pad for _, s in busy), n)
        if delta:
            self._shift(delta)
        window = S.window(self.slot, n, self.slots)
        tok, pad, done, floats, ints = S.free_rows(B, pm.pad_id)
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

    def _warm_next(self) -> None:
        """Compile the next shape of the warm-up (the driver calls this only while no request
        is in the lane, so the call's writes land in free rows). A failure ends the warm-up."""
        shape = self.warmup.take()
        if shape is None:  # cancelled meanwhile
            return
        compiled, error = False, None
        try:
            kind, _, _, _, B = shape
            self._caches(1 if kind == "prefill" else B, 1)
            call = warm_call(self.program, shape, self.slots, self.pm.pad_id)
            if call is not None and not self.pm.compiled(*call):
                self.pm.run(*call, what="warming up", lock=self.lock)
                compiled = True
        except BaseException as e:
            error = e
            raise
        finally:
            self.warmup.done(compiled, error)

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
