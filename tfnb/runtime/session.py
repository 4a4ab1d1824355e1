"""One generate call on a ``PlacedModel``, seen from its caller.

The call's prompts run in the model's scheduler (continuous batching); between the events it
sends, the caller collects the new tokens, checks stop strings, reports a ``ChunkEvent`` and,
when streaming, yields text.
All arguments are checked once, by ``GenerateRequest.check``, so a bad argument raises at the
call, also with ``stream=True``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tfnb.errors import WorkerLostError
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
    rows_stopped: list[bool] = field(default_factory=list)  # ended on EOS or a stop string,
    # not on max_new_tokens (OpenAI's finish_reason "stop" against "length")

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second so far (the first chunk includes prefill and compiling)."""
        return self.n_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class GenerateSession:
    """One checked request on a placed model, as its caller sees it.

    The request runs as a ticket in the model's scheduler (:mod:`tfnb.runtime.scheduler`),
    batched with whatever else runs there; this side collects its new tokens, checks stop
    strings, reports a ``ChunkEvent`` every ``chunk_tokens`` tokens and, when streaming,
    yields text. It uses the placed model's public surface only: ``scheduler``, ``timeout``,
    ``compile_timeout``, ``eos_ids``, ``tokenizer``, ``lost`` and ``last_stats``.

    ``failover``, when set, is asked for another placed model (a copy of the same weights)
    when this one fails with ``WorkerLostError``: ``failover(pm, error)`` returns it, or raises
    when there is none. The rows not finished then continue there from where they stopped: the
    prompt plus the tokens made so far become the new prompt, and what is left of
    ``max_new_tokens`` the new budget, with the same sampling. A seeded sample continues its
    seed stream, since each token's random numbers are keyed by its position in its row
    (``tfnb.runtime.graphs``); greedy rows continue as they would have. The caller sees one
    uninterrupted run of events.
    """

    def __init__(self, pm, request: GenerateRequest):
        self.pm, self.request, self.text = pm, request, request.text
        self.rows, self.single = request.rows, request.single
        self.max_new, self.sampling, self.stops = request.max_new_tokens, request.sampling, \
            request.stops
        self.chunk, self.on_chunk = request.chunk_tokens, request.on_chunk
        make_batch(self.rows, self.max_new, pm.config.max_context)  # checks the context
        n = len(self.rows)
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.cut: list[str | None] = [None] * n  # text before the stop string, once found
        self.finished = [False] * n
        self.stopped = [False] * n  # ended on EOS or a stop string
        self.stats: dict | None = None
        self.failover = None
        self.moves = 0  # times the unfinished rows continued on another copy

    # ----- the event loop -----------------------------------------------------------------

    def _submit(self, error: WorkerLostError | None):
        """A ticket for the rows not finished, on ``self.pm`` or (after ``error``) on the copy
        ``failover`` gives; returns it with the session rows its rows stand for."""
        if error is None and self.pm.lost:
            error = WorkerLostError(self.pm.lost)
        if error is not None:
            if self.failover is None:
                raise error
            self.pm = self.failover(self.pm, error)
            self.moves += 1
        live = [r for r in range(len(self.rows)) if not self.finished[r]]
        made = len(self.ids[live[0]])  # rows of one ticket advance together until they end
        ticket = self.pm.scheduler.submit([self.rows[r] + self.ids[r] for r in live],
                                          self.max_new - made, self.sampling, self.chunk)
        return ticket, live

    def _events(self):
        index, start = 0, time.perf_counter()
        first_token = ticket = first = None
        new_ids = [[] for _ in self.rows]
        try:
            ticket, live = self._submit(None)
            first = ticket  # the queue and first-token times count from its submission
            while not all(self.finished):
                # the lane's calls have their own deadlines; this bound only guards against a
                # lane that stopped making calls at all
                pm = self.pm
                wait = None if pm.timeout is None else pm.timeout + (pm.compile_timeout or 0) + 30
                try:
                    got, ended = ticket.next(wait)
                except WorkerLostError as e:
                    ticket.cancel()
                    ticket, live = self._submit(e)
                    continue
                if first_token is None:
                    first_token = time.perf_counter()
                for i, ids in enumerate(got):
                    row = live[i]
                    if self.finished[row]:
                        continue
                    self.ids[row] += ids
                    new_ids[row] += ids
                    if ended[i]:
                        self.finished[row] = True
                        self.stopped[row] = bool(ids) and ids[-1] in pm.eos_ids
                    if ids and self.stops:
                        self._check_stops(row, len(self.ids[row]) - len(ids))
                        if self.finished[row]:
                            ticket.finish(i)
                over = all(self.finished)
                if not over and not any(len(n) >= self.chunk for n in new_ids):
                    continue
                event = ChunkEvent(
                    index=index, new_ids=new_ids,
                    new_text=self._texts() if (self.text and pm.tokenizer is not None) else None,
                    n_tokens=sum(len(r) for r in self.ids),
                    elapsed_s=time.perf_counter() - start, finished=over,
                    rows_finished=list(self.finished), rows_stopped=list(self.stopped))
                index += 1
                new_ids = [[] for _ in self.rows]
                if self.on_chunk is not None:
                    self.on_chunk(event)
                yield event
        except WorkerLostError as e:  # did some of its output reach the caller already?
            e.reached_caller = index > 0 and (self.on_chunk is not None or self.request.stream)
            raise
        finally:
            if ticket is not None:
                ticket.cancel()  # a caller that stopped reading (or Ctrl-C) frees its rows
        end = time.perf_counter()
        self.stats = {"tokens": sum(len(r) for r in self.ids), "chunks": index,
                      "seconds": end - start,
                      "queue_s": (first.started or end) - first.submitted,
                      "first_token_s": (first_token or end) - first.submitted}
        if self.moves:
            self.stats["moves"] = self.moves
        self.stats["tokens_per_s"] = self.stats["tokens"] / max(end - start, 1e-9)
        self.pm.last_stats = self.stats

    def _check_stops(self, row: int, first_new: int) -> None:
        tok = self.pm.tokenizer
        text = tok.decode(self.ids[row])
        hits = [text.find(s) for s in self.stops if s in text]
        if not hits:
            return
        self.cut[row] = text[:min(hits)]
        self.finished[row] = self.stopped[row] = True
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
