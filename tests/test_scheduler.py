"""Continuous batching against a fake placed model: no workers, no device calls, milliseconds.

The fake's "model" reads a row's cache the way the real graphs do (a row attends the slots from
its padding up to the write slot, within the call's window) and picks the next token from
exactly what it sees, so a row padded, windowed or moved wrongly gets other tokens than its
prompt alone would. The tests assert what a caller notices: its tokens, when it waits, and
the errors it gets. Real workers are ``test_batching.py``'s."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from tfnb.errors import WorkerLostError
from tfnb.runtime import slots as S
from tfnb.runtime.lane import Lane
from tfnb.runtime.requests import Sampling
from tfnb.runtime.scheduler import Scheduler
from tfnb.runtime.tickets import Seq, Ticket
from tfnb.runtime.warmup import WarmupQueue, warm_shapes

EOS = 3
PAD = 0
GREEDY = Sampling("greedy", 1.0, 0, 1.0, 0)


def next_token(seen: list[int]) -> int:
    """The fake model: a token from every token a row attends, in order (never EOS, except
    that a prompt starting with 99 ends once its row holds 6 tokens)."""
    if seen and seen[0] == 99 and len(seen) >= 6:
        return EOS
    return (sum((i + 1) * t for i, t in enumerate(seen)) * 7 + len(seen)) % 50 + 10


def alone(prompt: list[int], max_new: int) -> list[int]:
    """The tokens ``prompt`` gets by itself: the reference every batched run must match."""
    seen, out = list(prompt), []
    for _ in range(max_new):
        out.append(next_token(seen))
        if out[-1] == EOS:
            break
        seen.append(out[-1])
    return out


class FakeFn:
    def __init__(self, key, run):
        self.key, self.run = key, run

    def __call__(self, *args):
        return self.run(*args)


class FakeProgram:
    """A set of caches (token ids per row and slot) and the calls a lane makes on them."""

    def __init__(self, rows: int, slots: int, unrolled: bool):
        self.rows, self.slots, self.unrolled = rows, slots, unrolled
        self.cache_RxS = np.full((rows, slots), -1, np.int64)
        self.graphs: dict = {}

    def _fn(self, key, run):
        return self.graphs.setdefault(key, FakeFn(key, run))

    def prefill_fn(self, mode):
        def run(ids_nxP, pad_n, start, first, done_n, floats, ints):
            n, P = ids_nxP.shape
            assert 0 <= start and start + P <= self.slots, (start, P, self.slots)
            self.cache_RxS[first:first + n, start:start + P] = ids_nxP
            tok = [next_token(list(self.cache_RxS[first + i, start + pad_n[i]:start + P]))
                   for i in range(n)]
            return np.array(tok, np.int32), None
        return self._fn(("prefill", mode), run)

    def decode_fn(self, mode, window=None, steps=None):
        def run(tok_B, pad_B, slot, done_B, n_steps, floats, ints):
            tok_B, done_B, out = tok_B.copy(), done_B.copy(), []
            count = steps if self.unrolled else int(n_steps)  # a loop's length is an argument
            assert len(tok_B) <= self.rows and int(slot) + count <= window <= self.slots
            for i in range(count):
                if not self.unrolled and done_B.all():
                    break
                at = int(slot) + i
                assert at < self.slots, (at, self.slots)
                self.cache_RxS[:len(tok_B), at] = tok_B
                new = np.full_like(tok_B, PAD)
                for b in np.flatnonzero(~done_B):  # attention reads the window only
                    new[b] = next_token(list(self.cache_RxS[b, pad_B[b]:min(at + 1, window)]))
                tok_B, done_B = np.where(done_B, tok_B, new), done_B | (new == EOS)
                out.append(new)
            return np.array(out, np.int32).reshape(len(out), len(tok_B)), len(out), \
                int(slot) + len(out), tok_B, done_B
        return self._fn(("decode", mode, window, steps if self.unrolled else None), run)

    def shift_fn(self):
        def run(delta):
            self.cache_RxS = np.roll(self.cache_RxS, int(delta), axis=1)
            return delta
        return self._fn(("shift",), run)


class FakePlaced:
    """The surface of a ``PlacedModel`` a scheduler uses; ``fail`` makes a kind of call raise."""

    def __init__(self, max_batch=8, max_context=1024, unrolled=False, lanes=1):
        self.config = SimpleNamespace(max_context=max_context)
        self.max_batch, self.pad_id, self.eos_ids = max_batch, PAD, [EOS]
        self.devices = ["/device:CPU:0", "/device:CPU:1"] if unrolled else ["/device:CPU:0"]
        self.unrolled, self.lost, self.fail = unrolled, None, {}
        self.compiles: list = []  # the shapes of call run for the first time
        self.gate = threading.Event()  # every call waits for it
        self.gate.set()
        self.programs: list = []
        self.scheduler = Scheduler(self, lanes)

    def program(self, rows, slots, owner=0):
        self.programs.append(FakeProgram(rows, slots, self.unrolled))
        return self.programs[-1]

    def _key(self, fn, args):
        return (fn.key,) + tuple(np.shape(a) for a in args)

    def compiled(self, fn, args) -> bool:
        return self._key(fn, args) in self.compiles

    def run(self, fn, args, what, lock):
        assert self.gate.wait(10)
        with lock:
            if fn.key[0] in self.fail:
                raise self.fail[fn.key[0]]
            if not self.compiled(fn, args):
                self.compiles.append(self._key(fn, args))
            return fn(*args)


def lane_of(pm=None, **kw) -> Lane:
    pm = pm or FakePlaced(**kw)
    lane = pm.scheduler.lanes[0]
    lane._keep = pm  # the lane holds its model weakly
    return lane


def queue(lane: Lane, prompts, max_new=8, chunk=None) -> Ticket:
    t = Ticket(prompts, max_new, GREEDY, chunk or max_new, lane.pm.config.max_context)
    t.lane = lane
    lane.pending.append(t)
    return t


def tokens(t: Ticket) -> list[list[int]]:
    """Every token the ticket's events carried so far, per prompt."""
    got = [[] for _ in t.seqs]
    while not t.events.empty():
        event = t.events.get()
        if isinstance(event, BaseException):
            raise event
        for g, new in zip(got, event[0]):
            g += new
    return got


def run_out(lane: Lane, limit=500) -> int:
    turns = 0
    while lane.pending or lane.busy_rows():
        lane.turn()
        turns += 1
        assert turns < limit, "the lane made no progress"
    lane.turn()  # retire the last rows
    return turns


PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19], [20, 21, 22]]


# ----- row and slot arithmetic ---------------------------------------------------------------

def test_a_prompt_joins_at_the_write_slot_when_it_and_every_row_fit():
    assert S.join_shift(slot=100, slots=256, P=32, left=40, first=60) == 0


def test_a_prompt_longer_than_the_write_slot_moves_the_rows_back_to_make_room_before_it():
    assert S.join_shift(slot=20, slots=256, P=48, left=8, first=4) == 28


def test_rows_that_would_run_past_the_caches_move_to_the_front_keeping_their_content():
    delta = S.join_shift(slot=230, slots=256, P=16, left=40, first=190)
    assert delta == -(190 - 0) and 230 + delta == 40  # 40 slots of content, now at the front


def test_a_prompt_waits_when_the_busy_rows_leave_no_room():
    assert S.join_shift(slot=230, slots=256, P=16, left=40, first=10) is None


def test_compaction_moves_rows_to_the_front_only_when_that_shrinks_the_window():
    assert S.compact_shift(slot=70, first=30, steps=16) == -30   # 128 slots -> 64
    assert S.compact_shift(slot=70, first=5, steps=16) == 0      # still 128: not worth a copy
    assert S.compact_shift(slot=40, first=0, steps=16) == 0


def test_unrolled_chunks_are_1_2_4_8_or_16_steps_and_never_pass_the_caches():
    for slot in (0, 240, 250, 255):
        for n in range(1, min(16, 256 - slot) + 1):
            got = S.unrolled_steps(n, slot, 256, [])
            assert got in (1, 2, 4, 8, 16) and got <= 256 - slot
            assert n / 2 < got < 2 * n  # the power of two next above or below
    assert [S.unrolled_steps(n, 0, 256, []) for n in (3, 5, 7, 13, 15)] == [4, 4, 8, 8, 16]


def test_an_unrolled_chunk_stops_at_the_event_of_a_row_that_goes_on():
    busy = [Seq([1], remaining=100, chunk=16, made=1)]  # 15 steps to its next event
    assert S.unrolled_steps(15, 0, 256, busy) == 8
    ending = [Seq([1], remaining=15, chunk=16, made=1)]  # ends there: padding past it is dropped
    assert S.unrolled_steps(15, 0, 256, ending) == 16


def test_a_chunk_ends_at_the_next_event_budget_or_cache_end_of_any_row():
    assert S.chunk_steps(0, 256, [Seq([1], 100, 4)]) == 4
    assert S.chunk_steps(0, 256, [Seq([1], 3, 16), Seq([1], 100, 16)]) == 3
    assert S.chunk_steps(250, 256, [Seq([1], 100, 16)]) == 6
    assert S.chunk_steps(0, 256, [Seq([1], 100, 100)]) == S.CHUNK_STEPS


def test_attention_windows_are_buckets_of_64_128_256_slots_capped_by_the_caches():
    assert [S.window(s, 16, 1024) for s in (0, 48, 49, 112, 113, 500)] == \
        [64, 64, 128, 128, 256, 1024]
    assert S.window(300, 16, 320) == 320


def test_rows_are_taken_in_aligned_blocks_first_fit():
    busy = Seq([1], 1, 1)
    assert S.free_block([busy, None, None, None], 1) == 1
    assert S.free_block([busy, None, None, None], 2) == 2  # aligned: not rows 1-2
    assert S.free_block([None, busy, None, busy], 2) is None


def test_caches_grow_to_fit_and_never_shrink():
    assert S.cache_size(0, 0, 1, 40, 8, 2048) == (8, S.MIN_SLOTS)
    assert S.cache_size(8, 384, 1, 40, 8, 2048) == (8, 384)
    assert S.cache_size(8, 256, 16, 300, 8, 2048) == (16, 384)
    assert S.cache_size(0, 0, 1, 4000, 8, 2048) == (8, 2048)  # never past the context


def test_a_prompt_block_is_left_padded_and_its_spare_rows_are_done():
    ids, pad, done = S.prompt_block([[5, 6], [7, 8, 9], [1]], 4, PAD)
    assert ids.tolist() == [[0, 0, 5, 6], [0, 7, 8, 9], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert pad.tolist() == [2, 1, 3, 3] and done.tolist() == [False, False, False, True]


# ----- a lane, turn by turn ------------------------------------------------------------------

def test_a_ticket_takes_free_rows_and_gets_the_tokens_it_gets_alone():
    lane = lane_of()
    t = queue(lane, [PROMPTS[0], PROMPTS[1]], max_new=10)
    run_out(lane)
    assert tokens(t) == [alone(PROMPTS[0], 10), alone(PROMPTS[1], 10)]
    assert t.outcome == "done" and lane.busy_rows() == 0


def test_tickets_share_the_batch_each_getting_the_tokens_it_gets_alone():
    lane = lane_of()
    ts = [queue(lane, [p], max_new=40) for p in PROMPTS]
    lane.turn()
    assert lane.busy_rows() == len(PROMPTS) and not lane.pending  # all admitted in one turn
    run_out(lane)
    assert [tokens(t)[0] for t in ts] == [alone(p, 40) for p in PROMPTS]
    assert lane.peak_rows == len(PROMPTS)


def test_a_ticket_waits_in_the_queue_while_every_row_is_busy_and_joins_when_one_frees():
    lane = lane_of(max_batch=2)
    short = queue(lane, [PROMPTS[0]], max_new=4, chunk=1)
    long_ = queue(lane, [PROMPTS[1]], max_new=40)
    late = queue(lane, [PROMPTS[2]], max_new=6)
    lane.turn()
    assert lane.busy_rows() == 2 and list(lane.pending) == [late]
    while late in lane.pending:
        lane.turn()
    assert short.outcome == "done" and long_.outcome is None  # it took the short one's row
    assert late.seqs[0].row == short.seqs[0].row
    run_out(lane)
    assert [tokens(t)[0] for t in (short, long_, late)] == [
        alone(PROMPTS[0], 4), alone(PROMPTS[1], 40), alone(PROMPTS[2], 6)]


def test_a_row_joining_at_slot_s_is_left_padded_to_s_minus_its_prompt_length():
    lane = lane_of()
    first = queue(lane, [PROMPTS[2]], max_new=100)
    lane.turn()
    lane.turn()
    joining = queue(lane, [PROMPTS[3]], max_new=5)
    slot = lane.slot
    lane.turn()
    assert joining.seqs[0].pad == slot - len(PROMPTS[3])
    run_out(lane)
    assert tokens(joining)[0] == alone(PROMPTS[3], 5)
    assert tokens(first)[0] == alone(PROMPTS[2], 100)


def test_joining_near_the_end_of_the_caches_moves_them_and_changes_no_token():
    lane = lane_of(max_context=256)
    long_ = queue(lane, [PROMPTS[0]], max_new=230)
    while lane.slot < 224:  # 40 more tokens from here would pass the caches' end
        lane.turn()
    assert lane.shifts == 0
    late = queue(lane, [PROMPTS[4]], max_new=40)
    lane.turn()
    assert late.seqs[0].row >= 0 and lane.shifts == 1 and lane.slots == 256  # moved, not grown
    run_out(lane)
    assert tokens(long_)[0] == alone(PROMPTS[0], 230)
    assert tokens(late)[0] == alone(PROMPTS[4], 40)


def test_a_ticket_that_does_not_fit_beside_the_busy_rows_waits_for_them():
    lane = lane_of(max_context=256)
    long_ = queue(lane, [PROMPTS[0]], max_new=200)
    lane.turn()
    late = queue(lane, [PROMPTS[4]], max_new=240)  # its 240 slots and the busy row's content
    lane.turn()                                     # do not fit in 256, even moved
    assert late in lane.pending
    run_out(lane)
    assert tokens(late)[0] == alone(PROMPTS[4], 240) and long_.outcome == "done"


def test_rows_that_came_and_went_are_compacted_so_the_window_stays_small():
    lane = lane_of(max_context=1024)
    ts = []
    for i in range(12):  # one after another, each joining a busy lane
        ts.append(queue(lane, [PROMPTS[i % 6]], max_new=40))
        lane.turn()
    run_out(lane)
    assert [tokens(t)[0] for t in ts] == [alone(PROMPTS[i % 6], 40) for i in range(12)]
    assert lane.shifts > 0
    assert max(window for *_, window in lane.chunks) <= 128


def test_every_decode_call_runs_a_bucketed_window_that_covers_its_steps():
    lane = lane_of()
    ts = [queue(lane, [p], max_new=50, chunk=7) for p in PROMPTS[:3]]
    run_out(lane)
    assert {w for *_, w in lane.chunks} <= {64, 128, 256}
    assert [tokens(t)[0] for t in ts] == [alone(p, 50) for p in PROMPTS[:3]]


def test_an_unrolled_lane_runs_only_chunks_of_1_2_4_8_or_16_steps():
    lane = lane_of(unrolled=True)
    ts = [queue(lane, [p], max_new=n, chunk=5) for p, n in zip(PROMPTS, (21, 9, 33))]
    run_out(lane)
    assert {steps for _, _, steps, _, _ in lane.chunks} <= {1, 2, 4, 8, 16}
    assert [tokens(t)[0] for t in ts] == [alone(p, n) for p, n in zip(PROMPTS, (21, 9, 33))]


def test_events_arrive_every_chunk_tokens_the_caller_asked_for():
    lane = lane_of()
    t = queue(lane, [PROMPTS[0]], max_new=10, chunk=4)
    run_out(lane)
    sizes = []
    while not t.events.empty():
        new, done = t.events.get()
        sizes.append(len(new[0]))
    assert sizes == [1, 3, 4, 2] and done == [True]  # the first token comes with the prefill


def test_a_sequence_ends_at_EOS_and_its_row_is_retired_for_the_next_ticket():
    lane = lane_of(max_batch=1)
    t = queue(lane, [[99, 5]], max_new=50)
    run_out(lane)
    assert tokens(t)[0] == alone([99, 5], 50)
    assert alone([99, 5], 50)[-1] == EOS and len(alone([99, 5], 50)) == 5
    assert lane.seqs == [None] and lane.owners == [None]
    nxt = queue(lane, [PROMPTS[1]], max_new=3)
    run_out(lane)
    assert nxt.seqs[0].row == 0 and tokens(nxt)[0] == alone(PROMPTS[1], 3)


def test_a_row_whose_sequence_ended_is_free_for_a_waiting_ticket_while_its_sibling_goes_on():
    lane = lane_of(max_batch=2)
    pair = queue(lane, [[99, 5], PROMPTS[0]], max_new=50, chunk=2)  # the first ends at EOS
    late = queue(lane, [PROMPTS[1]], max_new=6)
    while late in lane.pending:
        lane.turn()
    assert pair.outcome is None and late.seqs[0].row == pair.seqs[0].row == 0
    run_out(lane)
    assert tokens(pair) == [alone([99, 5], 50), alone(PROMPTS[0], 50)]
    assert tokens(late)[0] == alone(PROMPTS[1], 6)


def test_a_cancelled_ticket_leaves_its_rows_at_the_next_turn():
    lane = lane_of()
    t = queue(lane, [PROMPTS[0]], max_new=100, chunk=4)
    other = queue(lane, [PROMPTS[1]], max_new=100, chunk=4)
    lane.turn()
    t.cancel()
    lane.turn()
    assert lane.busy_rows() == 1 and t.outcome == "cancelled"
    assert lane.owners[other.seqs[0].row] is other


# ----- the scheduler, with its driver threads -------------------------------------------------

def read_all(t: Ticket, timeout=10.0) -> list[list[int]]:
    got = [[] for _ in t.seqs]
    while True:
        new, done = t.next(timeout)
        for g, n in zip(got, new):
            g += n
        if all(done):
            return got


def test_concurrent_callers_each_get_the_tokens_they_get_alone():
    pm = FakePlaced(lanes=2)
    pm.gate.clear()  # the lanes' first calls wait until every request is queued
    tickets = [pm.scheduler.submit([p], 20, GREEDY, 5) for p in PROMPTS]
    assert [t.lane.index for t in tickets] == [0, 1] * 3  # each to the least loaded lane
    pm.gate.set()
    results = {}

    def call(p, t):
        results[tuple(p)] = read_all(t)[0]
    threads = [threading.Thread(target=call, args=(p, t)) for p, t in zip(PROMPTS, tickets)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert results == {tuple(p): alone(p, 20) for p in PROMPTS}
    assert [r["state"] for r in pm.scheduler.status()["recent"]] == ["done"] * len(PROMPTS)


def test_a_failing_call_raises_its_error_in_the_waiting_caller():
    pm = FakePlaced()
    pm.fail["decode"] = RuntimeError("the device said no")
    t = pm.scheduler.submit([PROMPTS[0]], 20, GREEDY, 20)
    with pytest.raises(RuntimeError, match="the device said no"):
        read_all(t)
    assert t.outcome == "error" and pm.scheduler.busy_rows() == [0]
    pm.fail.clear()  # the lane serves the next request
    assert read_all(pm.scheduler.submit([PROMPTS[1]], 4, GREEDY, 4))[0] == alone(PROMPTS[1], 4)


def test_a_lost_worker_fails_the_queued_tickets_as_well():
    lane = lane_of(max_batch=1)
    running, queued = queue(lane, [PROMPTS[0]], 30), queue(lane, [PROMPTS[1]], 30)
    lane.turn()
    lane.pm.fail["decode"] = WorkerLostError("worker 1 is gone")
    with pytest.raises(WorkerLostError):
        lane.turn()
    lane._fail(WorkerLostError("worker 1 is gone"))
    assert (running.outcome, queued.outcome) == ("error", "error") and not lane.pending
    with pytest.raises(WorkerLostError):
        read_all(queued)


# ----- warm-up ---------------------------------------------------------------------------------

def test_warmup_compiles_every_shape_once_while_idle_and_counts_down_to_zero():
    pm = FakePlaced(max_batch=2, max_context=256)
    queued = pm.scheduler.warmup(["greedy"], 20)
    assert queued == len(warm_shapes(2, 256, False, ["greedy"], 20))
    assert pm.scheduler.wait_warm(10) and pm.scheduler.warming() == 0
    lane = pm.scheduler.lanes[0]
    assert lane.warmup.compiled == queued  # every shape was new
    before = list(pm.compiles)
    assert read_all(pm.scheduler.submit([PROMPTS[0]], 8, GREEDY, 8))[0] == alone(PROMPTS[0], 8)
    assert pm.compiles == before  # the request met only warm shapes
    pm.scheduler.warmup(["greedy"], 20)
    assert pm.scheduler.wait_warm(10) and lane.warmup.compiled == queued  # nothing new


def test_a_warmup_failure_is_reported_and_ends_the_warmup():
    pm = FakePlaced()
    pm.fail["decode"] = RuntimeError("out of memory")
    pm.scheduler.warmup(["greedy"], 16)
    with pytest.raises(RuntimeError, match="out of memory"):
        pm.scheduler.wait_warm(10)
    assert pm.scheduler.warm_error() == "RuntimeError: out of memory"
    assert pm.scheduler.warming() == 0


def test_a_warmup_is_queued_again_for_new_caches_unless_cancelled():
    q = WarmupQueue(threading.Condition())
    q.queue(["greedy"], 16, rows=1, slots=64, unrolled=False)
    while q.take():
        q.done(compiled=True)
    q.requeue(rows=2, slots=128, unrolled=False)
    assert q.left == len(warm_shapes(2, 128, False, ["greedy"], 16))
    q.cancel()
    q.requeue(rows=4, slots=256, unrolled=False)
    assert q.left == 0 and q.compiled == 3
