"""OpenAI's HTTP API as data: checked requests, error bodies and response shapes.

A request body (a JSON object) becomes a :class:`ChatRequest` or a :class:`CompletionRequest`,
whose ``options`` are ready for ``generate``; any field this endpoint cannot honour raises an
:class:`ApiError` that names the field, quotes its value and says what would be accepted, and
whose ``body()`` is the API's ``{"error": {"message", "type", "param", "code"}}``. Responses and
streamed chunks are built here too, so the server only moves bytes. Nothing here imports
Starlette or TensorFlow: it is tested on plain dicts.

One choice per request (``n`` = 1), text in and out: ``logprobs``, tools, penalties, logit
biases and JSON response formats are refused rather than ignored, since each would change the
answer's form.

Examples
--------
>>> req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
...                   "temperature": 0, "max_tokens": 8}, max_context=512)
>>> req.messages, req.options
([{'role': 'user', 'content': 'hi'}], {'max_new_tokens': 8, 'stop': None})
>>> parse_chat({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 512)
... # doctest: +ELLIPSIS
Traceback (most recent call last):
...
tfnb.serving.protocol.ApiError: n=2: this endpoint returns one choice per request; expected 1 ...
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "Chunks", "parse_body",
           "parse_chat", "parse_completion", "generate_options", "chat_prompt", "finish",
           "usage", "completion", "check_size", "DEFAULT_MAX_TOKENS", "MAX_BODY_BYTES"]

DEFAULT_MAX_TOKENS = 64   # the API's default for max_tokens
MAX_BODY_BYTES = 8 << 20  # a request body beyond this gets a 413 (a prompt is far smaller)


class ApiError(Exception):
    """A request the endpoint answers with an HTTP error and the API's JSON error object.

    Parameters
    ----------
    status : int
        The HTTP status (400 for a bad field, 404, 413, 503 ...).
    message : str
        What was received and what would be accepted.
    kind : str
        The error object's ``type``.
    param : str, optional
        The request field at fault.
    code : str, optional
        The error object's ``code``.

    Examples
    --------
    >>> ApiError(400, "stop=0: expected a string", param="stop").body()
    ... # doctest: +NORMALIZE_WHITESPACE
    {'error': {'message': 'stop=0: expected a string', 'type': 'invalid_request_error',
               'param': 'stop', 'code': None}}
    """

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict:
        """The API's error object, ready for JSON."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


# ----- requests -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatRequest:
    """A checked ``/v1/chat/completions`` request.

    ``messages`` are ``{"role", "content"}`` dicts with text content (text parts joined by
    newlines); ``options`` are keyword arguments for ``generate``.
    """

    messages: list
    options: dict
    stream: bool = False
    include_usage: bool = False  # a streamed answer ends with a chunk carrying the usage


@dataclass(frozen=True)
class CompletionRequest:
    """A checked ``/v1/completions`` request: one ``prompt`` and ``generate`` ``options``."""

    prompt: str
    options: dict
    stream: bool = False
    include_usage: bool = False


def parse_chat(body: dict, max_context: int) -> ChatRequest:
    """Check a chat completions request body; an :class:`ApiError` names the first bad field.

    Parameters
    ----------
    body : dict
        The request's JSON object (``model`` is checked by :func:`parse_body`).
    max_context : int
        The model's context length: ``max_tokens`` must stay below it.

    Returns
    -------
    ChatRequest

    Examples
    --------
    >>> parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
    ...             {"type": "text", "text": "b"}]}], "stream": True}, 512)
    ... # doctest: +NORMALIZE_WHITESPACE
    ChatRequest(messages=[{'role': 'user', 'content': 'a\\nb'}],
                options={'max_new_tokens': 64, 'stop': None, 'do_sample': True, 'temperature': 1.0,
                         'top_p': 1.0, 'seed': None},
                stream=True, include_usage=False)
    """
    options = generate_options(body, max_context)
    messages = _messages(body)
    return ChatRequest(messages, options, *_stream(body))


def parse_completion(body: dict, max_context: int) -> CompletionRequest:
    """Check a (legacy) completions request body; an :class:`ApiError` names the first bad field.

    Parameters
    ----------
    body : dict
        The request's JSON object; ``prompt`` is a str, or a list holding one.
    max_context : int
        The model's context length: ``max_tokens`` must stay below it.

    Returns
    -------
    CompletionRequest

    Examples
    --------
    >>> parse_completion({"prompt": ["the cat"], "temperature": 0, "max_tokens": 5}, 512)
    ... # doctest: +NORMALIZE_WHITESPACE
    CompletionRequest(prompt='the cat', options={'max_new_tokens': 5, 'stop': None},
                      stream=False, include_usage=False)
    >>> parse_completion({"prompt": ["a", "b"]}, 512)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tfnb.serving.protocol.ApiError: prompt=['a', 'b']: expected a non-empty str ...)
    """
    options = generate_options(body, max_context)
    prompt = _prompt(body)
    return CompletionRequest(prompt, options, *_stream(body))


def _get(body: dict, key: str, default):
    """``body[key]``, with a missing key or JSON ``null`` meaning the API's default."""
    value = body.get(key)
    return default if value is None else value


def _unsupported(body: dict) -> None:
    """A 400 for fields that would change the answer's form, which this endpoint does not make."""
    n = _get(body, "n", 1)
    if n != 1 or isinstance(n, bool):
        raise ApiError(400, f"n={n!r}: this endpoint returns one choice per request; expected 1 "
                            "(send several requests: they run in one batch)", param="n")
    # what each field's "left out" looks like: the legacy completions API's logprobs=0 still
    # asks for the sampled token's logprob, so only None/False leave that one out
    for key, off in (("logprobs", (None, False)), ("top_logprobs", (None, 0)),
                     ("tools", (None, [])), ("functions", (None, [])), ("echo", (None, False)),
                     ("suffix", (None, "")), ("logit_bias", (None, {})),
                     ("presence_penalty", (None, 0)), ("frequency_penalty", (None, 0)),
                     ("best_of", (None, 1))):
        value = body.get(key)
        if not any(value is o if o is None or isinstance(o, bool)
                   else value == o and not isinstance(value, bool) for o in off):
            raise ApiError(400, f"{key}={value!r:.60}: not supported by this endpoint; "
                                "expected it left out", param=key)
    form = _get(body, "response_format", {"type": "text"})
    if not isinstance(form, dict) or form.get("type") != "text":
        raise ApiError(400, f"response_format={form!r:.60}: this endpoint writes plain text; "
                            "expected {'type': 'text'} or none", param="response_format")


def generate_options(body: dict, max_context: int) -> dict:
    """``generate`` keyword arguments from a request body's sampling fields.

    Temperature 0 means greedy (as the API documents); above it, ``top_p`` and ``seed`` apply.
    Fields that would change the answer's form (``n``, ``logprobs``, tools ...) are refused.

    Parameters
    ----------
    body : dict
        The request's JSON object.
    max_context : int
        The model's context length: ``max_tokens`` (or ``max_completion_tokens``) must be
        from 1 to ``max_context - 1``.

    Returns
    -------
    dict
        ``max_new_tokens`` and ``stop``; with sampling, also ``do_sample``, ``temperature``,
        ``top_p`` and ``seed``.

    Examples
    --------
    >>> generate_options({"temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "\\n"}, 512)
    ... # doctest: +NORMALIZE_WHITESPACE
    {'max_new_tokens': 64, 'stop': ['\\n'], 'do_sample': True, 'temperature': 0.5, 'top_p': 0.9,
     'seed': 3}
    >>> generate_options({"max_tokens": 512}, 512)
    Traceback (most recent call last):
    ...
    tfnb.serving.protocol.ApiError: max_tokens=512: expected an integer from 1 to 511
    """
    _unsupported(body)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    n = _get(body, key, DEFAULT_MAX_TOKENS)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < max_context:
        raise ApiError(400, f"{key}={n!r}: expected an integer from 1 to {max_context - 1}",
                       param=key)
    temperature = _get(body, "temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 <= temperature <= 2:
        raise ApiError(400, f"temperature={temperature!r}: expected a number from 0 to 2",
                       param="temperature")
    top_p = _get(body, "top_p", 1.0)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ApiError(400, f"top_p={top_p!r}: expected a number above 0, at most 1",
                       param="top_p")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"seed={seed!r:.40}: expected an integer", param="seed")
    options = {"max_new_tokens": n, "stop": _stop(body.get("stop"))}
    if temperature > 0:  # 0 means greedy, as the API documents
        options.update(do_sample=True, temperature=float(temperature), top_p=float(top_p),
                       seed=seed)
    return options


def _stop(stop) -> list[str] | None:
    """The API's ``stop``: null, a string, or a list of up to 4 strings."""
    stops = [stop] if isinstance(stop, str) else stop
    if stop is None or stops == []:
        return None
    if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or not all(
            isinstance(s, str) and s and _encodable(s) for s in stops):
        raise ApiError(400, f"stop={stop!r:.80}: expected a non-empty string or a list of up "
                            "to 4 of them", param="stop")
    return stops


def _stream(body: dict) -> tuple[bool, bool]:
    """``(stream, include_usage)`` from ``stream`` and ``stream_options``."""
    stream = _get(body, "stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream={stream!r:.40}: expected true or false", param="stream")
    if not stream:
        return False, False
    options = _get(body, "stream_options", {})
    if not isinstance(options, dict):
        raise ApiError(400, f"stream_options={options!r:.60}: expected an object such as "
                            "{'include_usage': true}", param="stream_options")
    return True, bool(options.get("include_usage"))


def _encodable(text: str) -> bool:
    """Whether ``text`` is valid Unicode (JSON's escapes can carry a lone surrogate, which no
    tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text(content) -> str | None:
    """A message's content as text: a str, or a list of ``{"type": "text", "text": str}`` parts
    (one per line, as vLLM joins them); None for anything else."""
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        content = "\n".join(p["text"] for p in content)
    return content if isinstance(content, str) and _encodable(content) else None


def _prompt(body: dict) -> str:
    """A completions request's prompt: a str, or a list holding one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt or not _encodable(prompt):
        raise ApiError(400, f"prompt={body.get('prompt')!r:.80}: expected a non-empty str (or "
                            "a list of one: this endpoint returns one choice per request)",
                       param="prompt")
    return prompt


# the roles OpenAI's chat API takes (a chat template would print any other as it is)
ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(body: dict) -> list:
    """A chat request's messages, their content as text."""
    messages = body.get("messages")
    texts = [_text(m.get("content")) if isinstance(m, dict) else None
             for m in messages] if isinstance(messages, list) else []
    if not texts or any(t is None or not isinstance(m.get("role"), str)
                        for m, t in zip(messages, texts)):
        raise ApiError(400, f"messages={messages!r:.80}: expected a non-empty list of "
                            "{'role': str, 'content': str or a list of text parts} (valid "
                            "Unicode)", param="messages")
    bad = next((i for i, m in enumerate(messages) if m["role"] not in ROLES), None)
    if bad is not None:
        raise ApiError(400, f"messages[{bad}].role={messages[bad]['role']!r:.40}: expected one "
                            f"of {list(ROLES)}", param=f"messages[{bad}].role")
    return [{"role": m["role"], "content": t} for m, t in zip(messages, texts)]


def chat_prompt(tokenizer, messages: list) -> str:
    """The model's prompt for ``messages``; a chat template that refuses them is a 400.

    HF chat templates raise (jinja's ``raise_exception``) on conversations they do not take,
    such as roles that do not alternate: that is the request's fault, not the server's.

    Parameters
    ----------
    tokenizer : object
        Anything with ``apply_chat_template(messages) -> str``.
    messages : list
        ``ChatRequest.messages``.

    Returns
    -------
    str

    Examples
    --------
    >>> class Strict:
    ...     def apply_chat_template(self, messages):
    ...         raise ValueError("roles must alternate")
    >>> chat_prompt(Strict(), [{"role": "user", "content": "a"}])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tfnb.serving.protocol.ApiError: messages: the model's chat template refused them (roles ...)
    """
    try:
        return tokenizer.apply_chat_template(messages)
    except Exception as e:  # noqa: BLE001 - a jinja template may raise anything it likes
        raise ApiError(400, f"messages: the model's chat template refused them ({e})",
                       param="messages") from None


def check_size(n_bytes: int) -> None:
    """A 413 once a request body has grown past :data:`MAX_BODY_BYTES`.

    Examples
    --------
    >>> check_size(MAX_BODY_BYTES + 1)
    Traceback (most recent call last):
    ...
    tfnb.serving.protocol.ApiError: the request body is over 8 MB: expected a smaller request
    """
    if n_bytes > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MB: expected a "
                            "smaller request", code="body_too_large")


def parse_body(raw: bytes, model: str) -> dict:
    """A request body as a JSON object that asks for ``model``; an :class:`ApiError` otherwise.

    Parameters
    ----------
    raw : bytes
        The request body.
    model : str
        The name of the model this endpoint serves (a 404 for any other).

    Returns
    -------
    dict

    Examples
    --------
    >>> parse_body(b'{"model": "m", "prompt": "hi"}', "m")
    {'model': 'm', 'prompt': 'hi'}
    >>> parse_body(b'[1, 2]', "m")
    Traceback (most recent call last):
    ...
    tfnb.serving.protocol.ApiError: the request body is list: expected an object
    """
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        what = "nested too deeply" if isinstance(e, RecursionError) else e
        raise ApiError(400, f"the request body is not JSON ({what})") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body is {type(body).__name__}: expected an object")
    if body.get("model") != model:
        raise ApiError(404, f"model {body.get('model')!r} does not exist: this endpoint "
                            f"serves {model!r}", param="model", code="model_not_found")
    return body


# ----- responses ----------------------------------------------------------------------------

def _new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def finish(events: list) -> tuple[str, int]:
    """``(finish_reason, new tokens)`` from a ``generate`` call's chunk events.

    ``"stop"`` when the answer ended on an end-of-sequence token or a stop string, ``"length"``
    when it ran out of ``max_tokens``.

    Examples
    --------
    >>> from types import SimpleNamespace as Event
    >>> finish([Event(rows_stopped=[True], n_tokens=7)])
    ('stop', 7)
    >>> finish([])
    ('length', 0)
    """
    if not events:
        return "length", 0
    last = events[-1]
    stopped = bool(last.rows_stopped and last.rows_stopped[0])
    return ("stop" if stopped else "length"), last.n_tokens


def usage(n_prompt: int, n_new: int) -> dict:
    """The API's ``usage`` object.

    Examples
    --------
    >>> usage(5, 3)
    {'prompt_tokens': 5, 'completion_tokens': 3, 'total_tokens': 8}
    """
    return {"prompt_tokens": n_prompt, "completion_tokens": n_new,
            "total_tokens": n_prompt + n_new}


def completion(chat: bool, model: str, text: str, reason: str, used: dict) -> dict:
    """A whole (not streamed) answer: a ``chat.completion`` or a ``text_completion``.

    Parameters
    ----------
    chat : bool
        A chat answer (``message``) rather than a completion (``text``).
    model : str
        The served model's name.
    text : str
        The answer.
    reason : str
        The ``finish_reason`` (see :func:`finish`).
    used : dict
        The ``usage`` object (see :func:`usage`).

    Examples
    --------
    >>> done = completion(True, "m", "Paris.", "stop", usage(9, 2))
    >>> done["object"], done["choices"]  # doctest: +NORMALIZE_WHITESPACE
    ('chat.completion', [{'index': 0, 'message': {'role': 'assistant', 'content': 'Paris.'},
                          'finish_reason': 'stop'}])
    """
    choice = ({"index": 0, "message": {"role": "assistant", "content": text},
               "finish_reason": reason} if chat else
              {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
    return {"id": _new_id(chat), "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": used}


@dataclass(frozen=True)
class Chunks:
    """The server-sent events of one streamed answer, all with one ``id`` and ``created``.

    With ``include_usage`` every chunk carries ``usage`` (null but in the last, which has no
    choices), as the API's ``stream_options.include_usage`` asks.

    Examples
    --------
    >>> events = Chunks("m", chat=True)
    >>> events.piece("", first=True).startswith('data: {"id": "chatcmpl-')
    True
    >>> json.loads(events.piece(None, "stop")[len("data: "):])["choices"]
    [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]
    >>> events.DONE
    'data: [DONE]\\n\\n'
    """

    model: str
    chat: bool
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    DONE = "data: [DONE]\n\n"

    def __post_init__(self):
        if not self.id:
            object.__setattr__(self, "id", _new_id(self.chat))

    def event(self, choices: list, used: dict | None = None) -> str:
        """One event holding ``choices`` (and ``usage`` when asked for)."""
        data = {"id": self.id, "object": "chat.completion.chunk" if self.chat
                else "text_completion", "created": self.created, "model": self.model,
                "choices": choices}
        if self.include_usage:
            data["usage"] = used
        return f"data: {json.dumps(data)}\n\n"

    def piece(self, text: str | None, reason: str | None = None, first: bool = False) -> str:
        """An event with the next piece of text (None for the last, which gives ``reason``);
        a chat stream's ``first`` event names the assistant's role."""
        if self.chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            return self.event([{"index": 0, "delta": delta, "finish_reason": reason}])
        return self.event([{"index": 0, "text": text or "", "finish_reason": reason,
                            "logprobs": None}])

    def usage(self, used: dict) -> str:
        """The closing event with no choices and the ``usage``."""
        return self.event([], used)

    @staticmethod
    def error(e: ApiError) -> str:
        """An error met after the stream began, as an event (the status is already sent)."""
        return f"data: {json.dumps(e.body())}\n\n"
