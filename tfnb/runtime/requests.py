"""Checking generate arguments, tokenizing prompts, and bucketing shapes.

Every shape a compiled function sees is bucketed (batch to a power of two, prompt and cache
lengths to 16, 24, 32, 48, 64, 96 ...), so repeated calls with slightly different prompts reuse
the compiled functions.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tfnb import hooks
from tfnb.errors import GenerateError

__all__ = ["Sampling", "check_sampling", "check_max_new_tokens", "prompt_ids", "bucket",
           "Batch", "make_batch", "check_stop", "GenerateOptions", "GenerateRequest",
           "with_options_signature"]

DEFAULT_CHUNK = 16  # tokens per call when streaming, with stop strings or an on_chunk hook


@dataclass(frozen=True)
class GenerateOptions:
    """The keyword options of ``generate``/``generate_ids``, as given (checked by
    :meth:`GenerateRequest.check`). This is the one place they are spelled out.

    Parameters
    ----------
    max_new_tokens : int
        Tokens to generate per row (fewer if a row ends with an EOS token or a stop string).
    do_sample, temperature, top_k, top_p, seed
        Greedy by default; with ``do_sample=True`` sample in-graph, reproducibly per ``seed``
        (the same tokens whatever ``chunk_tokens``).
    stop : str or list of str
        The text is cut before the first stop string; checked on the client between chunks.
    stream : bool
        Return an iterator of new text (or ids) per chunk instead.
    chunk_tokens : int
        Tokens per graph call (default: all at once, or 16 with ``stream``/``stop``/
        ``on_chunk``).
    on_chunk : callable
        Called after each chunk with a ``ChunkEvent`` (token count, tokens/s, new text).
    """
    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: object = None
    stream: bool = False
    chunk_tokens: int | None = None
    on_chunk: Callable | None = None

    @classmethod
    def of(cls, options: dict) -> GenerateOptions:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in options if k not in names]
        if unknown:
            raise GenerateError(f"unknown option {unknown[0]!r}: expected one of {names}")
        return cls(**options)


def with_options_signature(method):
    """Give ``method(self, prompts, **options)`` the signature of :class:`GenerateOptions`'
    fields as keyword-only parameters, so ``help()`` and tab completion show them."""
    sig = inspect.signature(method)
    head = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    extra = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                               annotation=f.type) for f in dataclasses.fields(GenerateOptions)]
    method.__signature__ = sig.replace(parameters=head + extra)
    return method


@dataclass(frozen=True)
class GenerateRequest:
    """One generate call's prompts as token ids and its options, checked once.

    Examples
    --------
    >>> from tfnb.models.decoder import tiny_config
    >>> r = GenerateRequest.check([1, 5], tokenizer=None, config=tiny_config(), text=False,
    ...                           options=GenerateOptions(max_new_tokens=4))
    >>> r.rows, r.max_new_tokens, r.sampling.mode, r.chunk_tokens
    ([[1, 5]], 4, 'greedy', 4)
    """
    rows: list
    single: bool
    text: bool
    max_new_tokens: int
    sampling: Sampling
    stops: tuple
    stream: bool
    chunk_tokens: int
    on_chunk: Callable | None

    @classmethod
    def check(cls, prompts, *, tokenizer, config, text: bool,
              options: GenerateOptions) -> GenerateRequest:
        """Tokenize ``prompts`` and check every option; GenerateError names the first bad one."""
        o = options
        rows, single = prompt_ids(prompts, tokenizer, config.vocab_size)
        longest = max(len(r) for r in rows)
        if longest >= config.max_context:
            raise GenerateError(f"prompt of {longest} tokens does not fit the context of "
                                f"{config.max_context} tokens: expected fewer than "
                                f"{config.max_context}")
        max_new = check_max_new_tokens(o.max_new_tokens, config.max_context)
        sampling = check_sampling(o.do_sample, o.temperature, o.top_k, o.top_p, o.seed)
        stops = check_stop(o.stop)
        if stops and tokenizer is None:
            raise GenerateError(f"stop={o.stop!r}: stop strings need a tokenizer; this model "
                                "has none")
        if not isinstance(o.stream, bool):
            raise GenerateError(f"stream={o.stream!r}: expected True or False")
        on_chunk = o.on_chunk
        if on_chunk is None and text and not o.stream and hooks.display_hook is not None:
            on_chunk = hooks.display_hook()  # a live display in notebooks
        chunk = o.chunk_tokens
        if chunk is None:
            chunk = DEFAULT_CHUNK if (o.stream or stops or on_chunk) else max_new
        if not _is_int(chunk) or chunk < 1:
            raise GenerateError(f"chunk_tokens={chunk!r}: expected an integer >= 1")
        if on_chunk is not None and not callable(on_chunk):
            raise GenerateError(f"on_chunk={on_chunk!r}: expected a callable or None")
        return cls(rows, single, text, max_new, sampling, stops, o.stream, int(chunk), on_chunk)


@dataclass(frozen=True)
class Sampling:
    """Validated sampling settings; ``mode`` is ``"greedy"``, ``"sample"`` or ``"filter"``."""
    mode: str
    temperature: float
    top_k: int
    top_p: float
    seed: int


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_sampling(do_sample, temperature, top_k, top_p, seed) -> Sampling:
    """Validate the sampling arguments of generate.

    Examples
    --------
    >>> check_sampling(True, 0.7, 40, 0.9, 0).mode
    'filter'
    >>> check_sampling(False, 0.0, 0, 1.0, None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tfnb.errors.GenerateError: temperature=0.0: expected a number > 0 (use do_sample=False ...
    """
    if not isinstance(do_sample, bool):
        raise GenerateError(f"do_sample={do_sample!r}: expected True or False")
    if (not isinstance(temperature, numbers.Real) or isinstance(temperature, bool)
            or not np.isfinite(temperature) or temperature <= 0):
        raise GenerateError(f"temperature={temperature!r}: expected a number > 0 "
                            "(use do_sample=False for greedy)")
    if not _is_int(top_k) or top_k < 0:
        raise GenerateError(f"top_k={top_k!r}: expected an integer >= 0 (0 turns top-k off)")
    if (not isinstance(top_p, numbers.Real) or isinstance(top_p, bool)
            or not 0 < top_p <= 1):
        raise GenerateError(f"top_p={top_p!r}: expected a number in (0, 1] (1 turns top-p off)")
    if seed is not None and not _is_int(seed):
        raise GenerateError(f"seed={seed!r}: expected an integer or None")
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (2 ** 31))
    mode = "greedy" if not do_sample else ("filter" if top_k or top_p < 1 else "sample")
    return Sampling(mode, float(temperature), int(top_k), float(top_p), int(seed) % (2 ** 31))


def check_max_new_tokens(max_new_tokens, max_context: int) -> int:
    """Validate ``max_new_tokens`` (an integer in ``[1, max_context)``)."""
    if not _is_int(max_new_tokens) or not 0 < max_new_tokens < max_context:
        raise GenerateError(f"max_new_tokens={max_new_tokens!r}: expected an integer in "
                            f"[1, {max_context - 1}] (the context holds {max_context} tokens)")
    return int(max_new_tokens)


def check_stop(stop) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (``None`` -> ``()``)."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise GenerateError(f"stop={stop!r}: expected a non-empty str or a list of them")
    return tuple(stops)


def prompt_ids(prompts, tokenizer, vocab_size: int):
    """``(ids_per_row, single)`` from a str, a list of str, a list of ids or a list of lists.

    Examples
    --------
    >>> prompt_ids([5, 6], None, 96)
    ([[5, 6]], True)
    >>> prompt_ids("", None, 96)
    Traceback (most recent call last):
    ...
    tfnb.errors.GenerateError: prompt='': expected a non-empty str
    """
    single = isinstance(prompts, str) or (
        isinstance(prompts, (list, tuple, np.ndarray)) and len(prompts) > 0
        and all(_is_int(t) for t in prompts))
    rows = [prompts] if single else prompts
    if not isinstance(rows, (list, tuple)) or not rows:
        raise GenerateError(f"prompts={prompts!r:.80}: expected a str, a non-empty list of str, "
                            "or token ids (a list of int or a list of such lists)")
    out = []
    for row in rows:
        if isinstance(row, str):
            if not row:
                raise GenerateError(f"prompt={row!r}: expected a non-empty str")
            if tokenizer is None:
                raise GenerateError(f"prompt={row!r:.40}: this model has no tokenizer; "
                                    "pass token ids (a list of int)")
            ids = list(tokenizer.encode(row))
            if not ids:
                raise GenerateError(f"prompt={row!r:.40} encodes to no tokens: expected text "
                                    "the tokenizer can encode")
        elif isinstance(row, (list, tuple, np.ndarray)) and len(row) and all(
                _is_int(t) for t in row):
            ids = [int(t) for t in row]
        else:
            raise GenerateError(f"prompt={row!r:.80}: expected a non-empty str or a non-empty "
                                "list of int token ids")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise GenerateError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        out.append(ids)
    return out, single


def bucket(n: int, minimum: int, maximum: int | None = None, fine: bool = True) -> int:
    """Smallest bucket >= n: ``minimum`` times 1, 1.5, 2, 3, 4, 6, 8 ... (powers of two only
    when ``fine`` is False), but at most ``maximum`` (and never below ``n``).

    Fine buckets waste at most a third of a prefill's work on padding; each new bucket costs one
    compilation.

    Examples
    --------
    >>> [bucket(n, 16) for n in (1, 17, 25, 200, 300)]
    [16, 24, 32, 256, 384]
    >>> bucket(300, 16, maximum=310), bucket(5, 1, fine=False)
    (310, 8)
    """
    b = minimum
    while b < n:
        power_of_two = b & (b - 1) == 0
        b = b * 3 // 2 if fine and power_of_two and b >= 2 else (b * 4 // 3 if fine and b >= 2
                                                                  and not power_of_two else b * 2)
    return b if maximum is None else max(n, min(b, maximum))


@dataclass
class Batch:
    """A left-padded batch in bucketed shape; rows past ``n_real`` are dummies, born done."""
    ids_BxP: np.ndarray  # int32
    pad_B: np.ndarray    # int32, padding slots per row
    done_B: np.ndarray   # bool
    n_real: int
    max_len: int         # S, cache slots


def make_batch(rows: list[list[int]], max_new_tokens: int, max_context: int,
               pad_id: int = 0) -> Batch:
    """Left-pad ``rows`` into bucketed shapes; reject prompts that do not fit the context.

    Examples
    --------
    >>> b = make_batch([[5, 6, 7], [8]], 4, 256)
    >>> b.ids_BxP.shape, b.pad_B.tolist(), b.max_len
    ((2, 16), [13, 15], 64)
    """
    longest = max(len(r) for r in rows)
    if longest + max_new_tokens > max_context:
        raise GenerateError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the context of "
            f"{max_context} tokens: expected at most {max_context} in all (shorten the prompt or "
            "ask for fewer tokens)")
    P = bucket(longest, 16, maximum=max_context - max_new_tokens)
    S = bucket(P + max_new_tokens, 64, maximum=max_context)
    B = bucket(len(rows), 1, fine=False)
    ids = np.full((B, P), pad_id, np.int32)
    pad = np.full((B,), P - 1, np.int32)
    for b, r in enumerate(rows):
        ids[b, P - len(r):] = r
        pad[b] = P - len(r)
    done = np.arange(B) >= len(rows)
    return Batch(ids, pad, done, len(rows), S)
