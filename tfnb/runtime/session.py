"""One generate call on a ``PlacedModel``: the client-side chunk loop.

Each chunk is one call of the placed model's graph function; between chunks the client collects
the new tokens, checks stop strings, reports a ``ChunkEvent`` and, when streaming, yields text.
All arguments are checked when the session is made, so a bad argument raises at the call, also
with ``stream=True``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from tfnb import hooks
from tfnb.errors import GenerateError
from tfnb.runtime.requests import (_is_int, check_max_new_tokens, check_sampling, check_stop,
                                   make_batch, prompt_ids)

__all__ = ["ChunkEvent", "GenerateSession"]

_DEFAULT_CHUNK = 16  # tokens per call when streaming, with stop strings or an on_chunk hook


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
    """Checked arguments and the chunk loop of one generate call (internal)."""

    def __init__(self, pm, prompts, max_new_tokens, do_sample, temperature, top_k, top_p, seed,
                 stop, stream, chunk_tokens, on_chunk, text):
        cfg = pm.config
        self.pm, self.text = pm, text
        self.rows, self.single = prompt_ids(prompts, pm.tokenizer, cfg.vocab_size)
        longest = max(len(r) for r in self.rows)
        if longest >= cfg.max_context:
            raise GenerateError(f"prompt of {longest} tokens does not fit the context of "
                                f"{cfg.max_context} tokens: expected fewer than {cfg.max_context}")
        self.max_new = check_max_new_tokens(max_new_tokens, cfg.max_context)
        self.sampling = check_sampling(do_sample, temperature, top_k, top_p, seed)
        self.stops = check_stop(stop)
        if self.stops and pm.tokenizer is None:
            raise GenerateError(f"stop={stop!r}: stop strings need a tokenizer; this model has "
                                "none")
        if not isinstance(stream, bool):
            raise GenerateError(f"stream={stream!r}: expected True or False")
        if on_chunk is None and text and not stream and hooks.display_hook is not None:
            on_chunk = hooks.display_hook()  # a live display in notebooks
        if chunk_tokens is None:
            chunk_tokens = _DEFAULT_CHUNK if (stream or self.stops or on_chunk) else self.max_new
        if not _is_int(chunk_tokens) or chunk_tokens < 1:
            raise GenerateError(f"chunk_tokens={chunk_tokens!r}: expected an integer >= 1")
        if on_chunk is not None and not callable(on_chunk):
            raise GenerateError(f"on_chunk={on_chunk!r}: expected a callable or None")
        self.chunk, self.on_chunk = int(chunk_tokens), on_chunk
        self.batch = make_batch(self.rows, self.max_new, cfg.max_context, pm.pad_id)
        n = len(self.rows)
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.cut: list[str | None] = [None] * n  # text before the stop string, once found
        self.finished = [False] * n

    # ----- the chunk loop -----------------------------------------------------------------

    def _events(self):
        pm, b, s = self.pm, self.batch, self.sampling
        B, P = b.ids_BxP.shape
        program = pm._program(B, b.max_len)
        pm._owner = self
        done_B = b.done_B.copy()
        sampling = (np.float32(s.temperature), np.int32(s.top_k), np.float32(s.top_p),
                    np.int32(s.seed))
        state = None
        remaining, index, start = self.max_new, 0, time.perf_counter()
        while remaining > 0 and not all(self.finished):
            if pm._owner is not self:
                raise GenerateError("another generate call on this model started while this "
                                    "stream was open: a stream cannot continue after it")
            n = min(self.chunk, remaining)
            if state is None:
                fn = pm._outer(program, P, s.mode)
                x, slot = b.ids_BxP, np.int32(0)
            else:
                fn = pm._outer(program, None, s.mode)
                x, slot = state
            tokens_NxB, count, slot, tok_B, done_t = pm._call(
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
