"""One generate call on a ``PlacedModel``: the client-side chunk loop.

Each chunk is one call of the placed model's graph function; between chunks the client collects
the new tokens, checks stop strings, reports a ``ChunkEvent`` and, when streaming, yields text.
All arguments are checked once, by ``GenerateRequest.check``, so a bad argument raises at the
call, also with ``stream=True``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from tfnb.errors import GenerateError, WorkerLostError
from tfnb.runtime.requests import GenerateRequest, make_batch

__all__ = ["ChunkEvent", "GenerateSession"]


@dataclass
class ChunkEvent:
    """What one chunk produced, passed to ``on_chunk`` (all lists have one entry per prompt)."""
    index: int
    new_ids: list[list[int]]
    new_text: list[str] | None
    n_tokens: int            # new tokens so far, all prompts together
    elapsed_s: float
    finished: bool
    rows_finished: list[bool] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second so far (the first chunk includes prefill and compiling)."""
        return self.n_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class GenerateSession:
    """The chunk loop of one checked request on a placed model.

    It uses the placed model's public runtime surface only: ``program(B, S)`` for the compiled
    functions over one set of caches, ``run(fn, args)`` to call one with its deadline,
    ``caches_owner`` (the session whose state the caches hold) and ``last_stats``.
    """

    def __init__(self, pm, request: GenerateRequest):
        self.pm, self.request, self.text = pm, request, request.text
        self.rows, self.single = request.rows, request.single
        self.max_new, self.sampling, self.stops = request.max_new_tokens, request.sampling, \
            request.stops
        self.chunk, self.on_chunk = request.chunk_tokens, request.on_chunk
        self.batch = make_batch(self.rows, self.max_new, pm.config.max_context, pm.pad_id)
        n = len(self.rows)
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.cut: list[str | None] = [None] * n  # text before the stop string, once found
        self.finished = [False] * n

    # ----- the chunk loop -----------------------------------------------------------------

    def _events(self):
        pm, b, s = self.pm, self.batch, self.sampling
        B, P = b.ids_BxP.shape
        program = pm.program(B, b.max_len)
        pm.caches_owner = self
        done_B = b.done_B.copy()
        sampling = (np.float32(s.temperature), np.int32(s.top_k), np.float32(s.top_p),
                    np.int32(s.seed))
        state = None
        remaining, index, start = self.max_new, 0, time.perf_counter()
        while remaining > 0 and not all(self.finished):
            if pm.lost:  # a worker was lost meanwhile (by this stream or another call)
                raise WorkerLostError(pm.lost)
            if pm.caches_owner is not self:
                raise GenerateError("another generate call on this model started while this "
                                    "stream was open: a stream cannot continue after it")
            n = min(self.chunk, remaining)
            if state is None:
                fn = program.generate_fn(P, s.mode)
                x, slot = b.ids_BxP, np.int32(0)
            else:
                fn = program.generate_fn(None, s.mode)
                x, slot = state
            tokens_NxB, count, slot, tok_B, done_t = pm.run(
                fn, (x, b.pad_B, slot, done_B, np.int32(n)) + sampling)
            tokens_NxB = tokens_NxB[:int(count)]  # numpy already: fetched within the deadline
            state, done_B = (tok_B, np.int32(slot)), done_t
            new_ids = self._collect(tokens_NxB)
            for row in range(len(self.rows)):
                done_B[row] |= self.finished[row]
            remaining -= n
            index += 1
            event = ChunkEvent(
                index=index - 1, new_ids=new_ids,
                new_text=self._texts() if (self.text and pm.tokenizer is not None) else None,
                n_tokens=sum(len(r) for r in self.ids),
                elapsed_s=time.perf_counter() - start,
                finished=remaining <= 0 or all(self.finished),
                rows_finished=list(self.finished))
            if self.on_chunk is not None:
                self.on_chunk(event)
            yield event
        pm.last_stats = {"tokens": sum(len(r) for r in self.ids), "chunks": index,
                         "seconds": time.perf_counter() - start}

    def _collect(self, tokens_NxB: np.ndarray) -> list[list[int]]:
        eos = set(self.pm.eos_ids)
        new_ids = []
        for row in range(len(self.rows)):
            got = []
            if not self.finished[row]:
                for t in tokens_NxB[:, row].tolist():
                    got.append(t)
                    if t in eos:
                        self.finished[row] = True
                        break
            self.ids[row] += got
            if got and self.stops:
                self._check_stops(row, len(self.ids[row]) - len(got))
            new_ids.append(got)
        return new_ids

    def _check_stops(self, row: int, first_new: int) -> None:
        tok = self.pm.tokenizer
        text = tok.decode(self.ids[row])
        hits = [text.find(s) for s in self.stops if s in text]
        if not hits:
            return
        self.cut[row] = text[:min(hits)]
        self.finished[row] = True
        for end in range(first_new + 1, len(self.ids[row]) + 1):  # keep ids up to the stop
            if any(s in tok.decode(self.ids[row][:end]) for s in self.stops):
                del self.ids[row][end:]
                break

    def _texts(self) -> list[str]:
        tok = self.pm.tokenizer
        return [self.cut[r] if self.cut[r] is not None else tok.decode(self.ids[r])
                for r in range(len(self.rows))]

    # ----- the four ways to consume it -------------------------------------------------------

    def run_ids(self):
        for _ in self._events():
            pass
        return self.ids[0] if self.single else self.ids

    def run_text(self):
        self.run_ids()
        texts = self._texts()
        return texts[0] if self.single else texts

    def iter_ids(self):
        for event in self._events():
            yield event.new_ids[0] if self.single else event.new_ids

    def iter_text(self):
        """New text per chunk; holds back a possible start of a stop string or a partial
        character until it is resolved."""
        sent = [0] * len(self.rows)
        for event in self._events():
            pieces = []
            for r, text in enumerate(self._texts()):
                end = len(text)
                if not self.finished[r] and not event.finished:
                    end = len(text) - _held_back(text, self.stops)
                pieces.append(text[sent[r]:max(end, sent[r])])
                sent[r] = max(end, sent[r])
            yield pieces[0] if self.single else pieces


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that may still become a stop string or a character."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                n = max(n, k)
                break
    while n < len(text) and text[len(text) - 1 - n] == "\ufffd":
        n += 1
    return n
