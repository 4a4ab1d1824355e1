"""Where a lane's rows sit and write: the row and slot arithmetic of continuous batching.

All busy rows of a lane write the same cache slot each step. A row that joins at slot ``s``
with a prompt of ``n`` tokens is left-padded to ``pad = s - n`` (the runtime's usual padding,
:mod:`tfnb.runtime.forward`), so it attends exactly its own tokens. When the slot would run past
the caches, or the busy rows have moved far from the front, every row is moved by the same
number of slots, which the padding makes invisible. Shapes stay bucketed (rows to a power of
two, the attended window to 64, 128, 256 ... slots, an unrolled chunk to 1, 2, 4, 8 or 16
steps) so that arrivals do not recompile once those buckets are warm.

Pure functions of plain numbers and :class:`~tfnb.runtime.tickets.Seq` values: no device,
no TensorFlow. :class:`tfnb.runtime.lane.Lane` applies them.
"""

from __future__ import annotations

import numpy as np

from tfnb.runtime.requests import bucket

__all__ = ["CHUNK_STEPS", "MIN_SLOTS", "MAX_ROWS", "FREE_PAD", "window", "block_rows",
           "free_block", "chunk_steps", "unrolled_steps", "join_shift", "compact_shift",
           "cache_size", "free_rows", "prompt_block"]

CHUNK_STEPS = 16  # decode steps per call at most: how long a new request may wait to join
MIN_SLOTS = 256   # cache slots per lane at least, so requests join without moving the caches
MAX_ROWS = 8      # rows per lane at least (more when one request brings more prompts)
FREE_PAD = 1 << 30  # a free row's padding: past every slot of every step of a chunk, so the
#                     row attends nothing and its matmul rows are skipped (tfnb.runtime.forward)


def window(slot: int, steps: int, slots: int) -> int:
    """The slots a chunk of ``steps`` decode steps from ``slot`` attends: a bucket of 64,
    128, 256 ... slots (one compiled function each), at most the caches' ``slots``.

    Examples
    --------
    >>> window(40, 16, 256), window(60, 16, 256), window(300, 16, 320)
    (64, 128, 320)
    """
    return min(slots, bucket(slot + steps, 64, fine=False))


def block_rows(n: int) -> int:
    """Rows a call for ``n`` rows runs with: a power of two.

    Examples
    --------
    >>> [block_rows(n) for n in (1, 2, 3, 5)]
    [1, 2, 4, 8]
    """
    return bucket(n, 1, fine=False)


def free_block(seqs: list, n: int) -> int | None:
    """The first row of ``n`` consecutive free rows of ``seqs`` (None marks a free row),
    aligned to ``n``; None when there is none.

    Examples
    --------
    >>> free_block([object(), None, None, None], 2), free_block([None, object()], 2)
    (2, None)
    """
    for start in range(0, len(seqs) - n + 1, n):
        if all(s is None for s in seqs[start:start + n]):
            return start
    return None


def chunk_steps(slot: int, slots: int, busy: list) -> int:
    """Decode steps the next chunk runs for the ``busy`` sequences: at most ``CHUNK_STEPS``,
    the slots left in the caches, and each sequence's tokens until its budget or the end of
    its event (so every caller gets its tokens as often as it asked).

    Examples
    --------
    >>> from tfnb.runtime.tickets import Seq
    >>> chunk_steps(10, 256, [Seq([1], remaining=100, chunk=5)])
    5
    """
    return min([CHUNK_STEPS, slots - slot] +
               [min(s.remaining, s.chunk - s.made % s.chunk) for s in busy])


def unrolled_steps(n: int, slot: int, slots: int, busy: list) -> int:
    """The chunk length an unrolled program runs for ``n`` wanted steps: a graph per length,
    so powers of two only. Rounded up when that wastes at most one step in eight (15 -> 16:
    one call instead of four), the caches allow it and no sequence that goes on would pass the
    end of its event (a sequence that ends within the chunk drops the tokens past its end);
    rounded down otherwise. So a lane's steps may exceed the tokens made by a few per request.

    Examples
    --------
    >>> from tfnb.runtime.tickets import Seq
    >>> [unrolled_steps(n, 0, 256, []) for n in (1, 3, 5, 7, 15)]
    [1, 4, 4, 8, 16]
    >>> unrolled_steps(15, 243, 256, [])  # 16 steps would pass the caches' end
    8
    """
    up = 1 << (n - 1).bit_length()
    cap = min([CHUNK_STEPS, slots - slot] +
              [s.chunk - s.made % s.chunk for s in busy
               if s.remaining > s.chunk - s.made % s.chunk])
    if up - n <= max(1, up // 8) and up <= cap:
        return up
    return 1 << (n.bit_length() - 1)


def join_shift(slot: int, slots: int, P: int, left: int, first: int) -> int | None:
    """How far to move a busy lane's slots before a prompt of bucket ``P`` joins at the write
    slot: 0 where it fits as they are, None when it must wait for busy rows to end.

    ``slot`` is the lane's write slot, ``slots`` its caches' length, ``left`` the most tokens
    any sequence (busy or joining) still makes and ``first`` the earliest slot a busy row
    attends. The prompt needs ``P`` slots before the write slot and every sequence ``left``
    after it; moving keeps the busy rows' content and puts it at the front (or far enough in
    for the prompt).

    Examples
    --------
    >>> join_shift(100, 256, 32, 40, 60)   # fits as it is
    0
    >>> join_shift(230, 256, 32, 40, 200)  # moved to the front: 30 slots of content, 32 prompt
    -198
    >>> join_shift(230, 256, 32, 40, 10)   # 220 slots of content and 40 to come: no room
    """
    if slot >= P and slot + left <= slots:
        return 0
    target = max(P, slot - first)  # slot - first: the slots the busy rows still attend
    if target + left > slots:
        return None
    return target - slot


def compact_shift(slot: int, first: int, steps: int) -> int:
    """How far to move the busy rows' slots before a chunk of ``steps`` (``first`` the
    earliest slot any busy row attends): to the front when that makes the attended window
    smaller, else 0.

    Requests that come and go keep moving the slot on; without this the window would grow to
    the whole cache (every step reading every slot), and each new window size compiles the
    decode functions again. Moving is one copy of the caches, about one decode step's bytes,
    every few dozen steps.

    Examples
    --------
    >>> compact_shift(70, 30, 16), compact_shift(70, 5, 16), compact_shift(40, 20, 16)
    (-30, 0, 0)
    """
    if first <= 0 or bucket(slot + steps, 64, fine=False) <= bucket(
            slot - first + steps, 64, fine=False):
        return 0
    return -first


def cache_size(rows: int, slots: int, n: int, need: int, max_batch: int,
               max_context: int) -> tuple[int, int]:
    """``(rows, slots)`` of caches for ``n`` rows and ``need`` slots, given caches of
    ``rows`` x ``slots`` (0 x 0: none yet): never smaller than those, at least ``max_batch``
    rows and ``MIN_SLOTS`` slots, slots bucketed to 64, 128 ... and at most ``max_context``.

    Examples
    --------
    >>> cache_size(0, 0, 1, 40, 8, 2048), cache_size(8, 256, 16, 300, 8, 2048)
    ((8, 256), (16, 384))
    """
    return (max(rows, n, max_batch),
            max(slots, min(max_context, max(MIN_SLOTS,
                                            bucket(need, 64, maximum=max_context)))))


def free_rows(B: int, pad_id: int):
    """``(tok, pad, done, floats, ints)`` of ``B`` free rows: they see nothing (so their
    matmul rows are skipped) and are done; a call's busy rows are written over them."""
    return (np.full((B,), pad_id, np.int32), np.full((B,), FREE_PAD, np.int32),
            np.ones((B,), bool), np.tile(np.float32([0.0, 1.0]), (B, 1)),
            np.zeros((B, 2), np.int32))


def prompt_block(prompts: list[list[int]], P: int, pad_id: int):
    """``(ids_nxP, pad_n, done_n)``: ``prompts`` left-padded to ``P`` tokens in a block of
    ``n = block_rows(len(prompts))`` rows; rows past the prompts are done from the start.

    Examples
    --------
    >>> ids, pad, done = prompt_block([[5, 6], [7, 8, 9]], 4, 0)
    >>> ids.tolist(), pad.tolist(), done.tolist()
    ([[0, 0, 5, 6], [0, 7, 8, 9]], [2, 1], [False, False])
    """
    n = block_rows(len(prompts))
    ids_nxP = np.full((n, P), pad_id, np.int32)
    pad_n = np.full((n,), P - 1, np.int32)
    for i, ids in enumerate(prompts):
        ids_nxP[i, P - len(ids):] = ids
        pad_n[i] = P - len(ids)
    return ids_nxP, pad_n, np.arange(n) >= len(prompts)
