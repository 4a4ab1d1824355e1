"""An OpenAI-compatible HTTP endpoint over a placed model, served from the notebook's kernel.

``tfnb.serve(placed)`` starts a Starlette app under uvicorn in a background thread:
``/v1/chat/completions`` and ``/v1/completions`` (streamed as server-sent events when asked),
``/v1/models`` and ``/health``. Any OpenAI client can talk to it, many at once: each request runs
on a worker thread and joins the running batch of the least loaded replica (a split placement
is one replica). A client that disconnects mid-stream ends its generation and frees its rows.
One choice per request (``n`` = 1), text in and out: ``logprobs``, tools, penalties, logit
biases and JSON response formats get a 400 that says so.

It binds loopback unless told otherwise; any other address needs an ``api_key`` (checked as a
bearer token on every request) and warns. Bad requests get the API's JSON error and a 4xx.

Examples
--------
>>> server = tfnb.serve(placed)                                    # doctest: +SKIP
>>> from openai import OpenAI                                      # doctest: +SKIP
>>> client = OpenAI(base_url=server.url, api_key="none")           # doctest: +SKIP
>>> client.chat.completions.create(model=server.model, messages=[  # doctest: +SKIP
...     {"role": "user", "content": "What is the capital of France?"}]).choices[0].message.content
'The capital of France is Paris.'
"""

from __future__ import annotations

import hmac
import json
import socket
import threading
import time
import uuid
import warnings

from tfnb.cluster.connect import is_loopback
from tfnb.errors import GenerateError, GenerateStalled, TfnbError, WorkerLostError

__all__ = ["serve", "Server", "ServeError", "ExposedEndpointWarning"]

START_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 8 << 20  # a request body beyond this gets a 413 (a prompt is far smaller)


class ServeError(TfnbError, ValueError):
    """A bad argument to ``serve`` (host, port, key, model)."""


class ExposedEndpointWarning(UserWarning):
    """The endpoint listens beyond this machine's loopback interface."""


class _ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


def _check(host, port, api_key) -> None:
    if not isinstance(host, str) or not host:
        raise ServeError(f"host={host!r}: expected an address such as '127.0.0.1'")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ServeError(f"port={port!r}: expected an integer from 0 (any free port) to 65535")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ServeError(f"api_key={api_key!r}: expected a non-empty str or None")
    if not is_loopback(host):
        if api_key is None:
            raise ServeError(f"host={host!r} is reachable from other machines: pass api_key=... "
                             "(clients send it as a bearer token), or serve on 127.0.0.1")
        warnings.warn(f"the endpoint listens on {host}, beyond loopback; every request must "
                      "carry the API key", ExposedEndpointWarning, stacklevel=3)


def _as_replicated(placed):
    from tfnb.runtime import PlacedModel, ReplicatedModel

    if isinstance(placed, ReplicatedModel):
        return placed
    if isinstance(placed, PlacedModel):  # one replica: requests queue on it, never interleave
        return ReplicatedModel([placed], plan=placed.plan)
    raise ServeError(f"placed={placed!r:.60}: expected a model placed with tfnb.place (a "
                     "llama-family model)")


# ----- request checking ---------------------------------------------------------------------

DEFAULT_MAX_TOKENS = 64


def _get(body: dict, key: str, default):
    """``body[key]``, with a missing key or JSON ``null`` meaning the API's default."""
    value = body.get(key)
    return default if value is None else value


def _unsupported(body: dict) -> None:
    """A 400 for fields that would change the answer's form, which this endpoint does not make."""
    n = _get(body, "n", 1)
    if n != 1 or isinstance(n, bool):
        raise _ApiError(400, f"n={n!r}: this endpoint returns one choice per request; expected 1 "
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
            raise _ApiError(400, f"{key}={value!r:.60}: not supported by this endpoint; "
                                 "expected it left out", param=key)
    form = _get(body, "response_format", {"type": "text"})
    if not isinstance(form, dict) or form.get("type") != "text":
        raise _ApiError(400, f"response_format={form!r:.60}: this endpoint writes plain text; "
                             "expected {'type': 'text'} or none", param="response_format")


def _options(body: dict, max_context: int) -> dict:
    """generate() options from an OpenAI request body; _ApiError names a bad field."""
    _unsupported(body)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    n = _get(body, key, DEFAULT_MAX_TOKENS)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < max_context:
        raise _ApiError(400, f"{key}={n!r}: expected an integer from 1 to {max_context - 1}",
                        param=key)
    temperature = _get(body, "temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 <= temperature <= 2:
        raise _ApiError(400, f"temperature={temperature!r}: expected a number from 0 to 2",
                        param="temperature")
    top_p = _get(body, "top_p", 1.0)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise _ApiError(400, f"top_p={top_p!r}: expected a number above 0, at most 1",
                        param="top_p")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _ApiError(400, f"seed={seed!r:.40}: expected an integer", param="seed")
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
        raise _ApiError(400, f"stop={stop!r:.80}: expected a non-empty string or a list of up "
                             "to 4 of them", param="stop")
    return stops


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


def _chat_prompt(tokenizer, messages: list) -> str:
    """The model's prompt for ``messages``; a template that refuses them is a bad request."""
    try:
        return tokenizer.apply_chat_template(messages)
    except Exception as e:  # noqa: BLE001 - a jinja template may raise anything it likes
        raise _ApiError(400, f"messages: the model's chat template refused them ({e})",
                        param="messages") from None


def _prompt(body: dict) -> str:
    """A completions request's prompt: a str, or a list holding one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt or not _encodable(prompt):
        raise _ApiError(400, f"prompt={body.get('prompt')!r:.80}: expected a non-empty str (or "
                             "a list of one: this endpoint returns one choice per request)",
                        param="prompt")
    return prompt


def _messages(body: dict) -> list:
    messages = body.get("messages")
    texts = [_text(m.get("content")) if isinstance(m, dict) else None
             for m in messages] if isinstance(messages, list) else []
    if not texts or any(t is None or not isinstance(m.get("role"), str)
                        for m, t in zip(messages, texts)):
        raise _ApiError(400, f"messages={messages!r:.80}: expected a non-empty list of "
                        "{'role': str, 'content': str or a list of text parts} (valid "
                        "Unicode)", param="messages")
    return [{"role": m["role"], "content": t} for m, t in zip(messages, texts)]


# ----- the app ------------------------------------------------------------------------------

class _Endpoint:
    """The routes over one (replicated) placed model."""

    def __init__(self, model, name: str, api_key: str | None):
        self.model, self.name, self.api_key = model, name, api_key
        self.tokenizer = model.tokenizer

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ], exception_handlers={404: self.not_found, 405: self.not_allowed})

    # -- helpers --
    def _error(self, e: _ApiError):
        from starlette.responses import JSONResponse

        return JSONResponse(e.body(), status_code=e.status)

    async def not_found(self, request, exc):
        return self._error(_ApiError(404, f"no route {request.url.path!r}: expected /v1/models, "
                                          "/v1/chat/completions, /v1/completions or /health",
                                     code="not_found"))

    async def not_allowed(self, request, exc):
        return self._error(_ApiError(405, f"{request.method} is not allowed on "
                                          f"{request.url.path!r}", code="method_not_allowed"))

    def _authorize(self, request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise _ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                            kind="authentication_error", code="invalid_api_key")

    async def _body(self, request) -> dict:
        self._authorize(request)
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise _ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MB: "
                                     "expected a smaller request", code="body_too_large")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            what = "nested too deeply" if isinstance(e, RecursionError) else e
            raise _ApiError(400, f"the request body is not JSON ({what})") from None
        if not isinstance(body, dict):
            raise _ApiError(400, f"the request body is {type(body).__name__}: expected an object")
        if body.get("model") != self.name:
            raise _ApiError(404, f"model {body.get('model')!r} does not exist: this endpoint "
                                 f"serves {self.name!r}", param="model", code="model_not_found")
        return body

    # -- routes --
    async def health(self, request):
        from starlette.responses import JSONResponse

        try:
            self._authorize(request)
        except _ApiError as e:
            return self._error(e)
        alive = [r for r in self.model.replicas if r.lost is None]
        errors = [e for e in (r.scheduler.warm_error() for r in alive) if e]
        return JSONResponse({"status": "ok" if alive else "lost", "replicas": len(alive),
                             "warming": sum(r.scheduler.warming() for r in alive),
                             "warm_error": errors[0] if errors else None},
                            status_code=200 if alive else 503)

    async def models(self, request):
        from starlette.responses import JSONResponse

        try:
            self._authorize(request)
        except _ApiError as e:
            return self._error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": self.name, "object": "model", "created": 0, "owned_by": "tfnb"}]})

    async def chat(self, request):
        return await self._complete(request, chat=True)

    async def completions(self, request):
        return await self._complete(request, chat=False)

    async def _complete(self, request, chat: bool):
        from starlette.concurrency import run_in_threadpool

        try:
            body = await self._body(request)
            options = _options(body, self.model.config.max_context)
            prompt = _chat_prompt(self.tokenizer, _messages(body)) if chat else _prompt(body)
            stream = _get(body, "stream", False)
            if not isinstance(stream, bool):
                raise _ApiError(400, f"stream={stream!r:.40}: expected true or false",
                                param="stream")
            if stream:
                usage = _get(body, "stream_options", {})
                if not isinstance(usage, dict):
                    raise _ApiError(400, f"stream_options={usage!r:.60}: expected an object "
                                         "such as {'include_usage': true}", param="stream_options")
                events: list = []
                chunks = await run_in_threadpool(
                    lambda: self.model.generate(prompt, stream=True, chunk_tokens=4,
                                                on_chunk=events.append, **options))
                return self._sse(chunks, events, chat,
                                 prompt if usage.get("include_usage") else None)
            return await run_in_threadpool(self._whole, prompt, options, chat)
        except _ApiError as e:
            return self._error(e)
        except GenerateStalled as e:  # the request was fine; its batch could not run
            return self._error(_ApiError(503, str(e), "server_error"))
        except GenerateError as e:
            return self._error(_ApiError(400, str(e)))
        except WorkerLostError as e:
            return self._error(_lost(e))

    def _whole(self, prompt, options, chat: bool):
        from starlette.responses import JSONResponse

        events: list = []
        text = self.model.generate(prompt, on_chunk=events.append, **options)
        reason = _finish(events)[0]
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": reason} if chat else
                  {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
        return JSONResponse({
            "id": _id(chat), "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.name, "choices": [choice],
            "usage": self._usage(prompt, events)})

    def _usage(self, prompt: str, events: list) -> dict:
        n_prompt, n_new = len(self.tokenizer.encode(prompt)), _finish(events)[1]
        return {"prompt_tokens": n_prompt, "completion_tokens": n_new,
                "total_tokens": n_prompt + n_new}

    def _sse(self, chunks, events, chat: bool, usage_of: str | None = None):
        """Server-sent events of a streamed generation; with ``usage_of`` (the prompt), a last
        chunk with no choices carries the usage, as ``stream_options.include_usage`` asks."""
        import anyio
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import StreamingResponse

        rid, created = _id(chat), int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, usage: dict | None = None) -> str:
            data = {"id": rid, "object": kind, "created": created, "model": self.name,
                    "choices": choices}
            if usage_of is not None:  # the API's chunks then all carry usage (null but the last)
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        def frame(piece: str | None, reason: str | None, first: bool = False) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                if first:
                    delta["role"] = "assistant"
                return event([{"index": 0, "delta": delta, "finish_reason": reason}])
            return event([{"index": 0, "text": piece or "", "finish_reason": reason,
                           "logprobs": None}])

        async def stream():
            done = object()
            try:
                if chat:
                    yield frame("", None, first=True)
                while True:
                    piece = await run_in_threadpool(next, chunks, done)
                    if piece is done:
                        break
                    if piece:
                        yield frame(piece, None)
                yield frame(None, _finish(events)[0])
                if usage_of is not None:
                    yield event([], self._usage(usage_of, events))
                yield "data: [DONE]\n\n"
            except GenerateError as e:  # the request was checked before: a stalled batch
                yield f"data: {json.dumps(_ApiError(503, str(e), 'server_error').body())}\n\n"
            except WorkerLostError as e:
                yield f"data: {json.dumps(_lost(e).body())}\n\n"
            finally:  # also when the client went away: the generation ends, its replica frees
                # its rows. Shielded: a client that left cancels this task, and an unshielded
                # await would raise at once, leaving the rows to the garbage collector.
                with anyio.CancelScope(shield=True):
                    await run_in_threadpool(_close, chunks)

        return StreamingResponse(stream(), media_type="text/event-stream")


def _lost(e: WorkerLostError) -> _ApiError:
    return _ApiError(503, str(e), kind="server_error", code="worker_lost")


def _close(chunks, wait_s: float = 600.0) -> None:
    """Close a generate stream; if a chunk is being made right now, once it is done."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            chunks.close()
            return
        except ValueError:  # "generator already executing" in another worker thread
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)


def _id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def _finish(events: list) -> tuple[str, int]:
    """``(finish_reason, new tokens)`` from the generate call's chunk events."""
    if not events:
        return "length", 0
    last = events[-1]
    stopped = bool(last.rows_stopped and last.rows_stopped[0])
    return ("stop" if stopped else "length"), last.n_tokens


# ----- the server ---------------------------------------------------------------------------

class Server:
    """A running endpoint: ``url`` (ends in ``/v1``, for OpenAI clients), ``model``, ``close()``;
    ``placed`` is what it serves (a ``ReplicatedModel``; ``tfnb.serving_view(server)`` shows it live).

    Examples
    --------
    >>> with tfnb.serve(placed) as server:                        # doctest: +SKIP
    ...     print(server.url)
    http://127.0.0.1:40213/v1
    """

    def __init__(self, uvicorn_server, thread, host: str, port: int, model: str, placed=None,
                 warmup: bool = False):
        self._server, self._thread, self.warmup = uvicorn_server, thread, warmup
        self.host, self.port, self.model, self.placed = host, port, model, placed
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting requests and end the server thread (within ``timeout`` s); drops the
        shapes its model still had queued to compile."""
        if self.warmup:
            self.placed.cancel_warmup()
        self._server.should_exit = True
        self._thread.join(timeout)

    def serving_status(self) -> dict:
        """What the endpoint's model is serving now (``ReplicatedModel.serving_status``)."""
        return self.placed.serving_status()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<tfnb Server {self.url} model={self.model!r} {'running' if self.running else 'closed'}>"


WARM_MODES = ("greedy", "sample")  # what the API's temperature 0 and its default ask for


def serve(placed, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, *,
          model: str | None = None, warmup: bool = True) -> Server:
    """Serve ``placed`` (a ``PlacedModel`` or ``ReplicatedModel``) over OpenAI's HTTP API.

    Parameters
    ----------
    placed : the result of ``tfnb.place`` for a llama-family model with a tokenizer
    host : the address to listen on; loopback by default. Any other address needs ``api_key``
    port : 0 picks a free port (see ``server.url``)
    api_key : when given, every request must send ``Authorization: Bearer <api_key>``
    model : the model name clients ask for (default: the placed model's name)
    warmup : compile every batch, window and prompt-length bucket of greedy and sampled
        requests in the background (``placed.warmup``), so that requests arriving later never
        wait for a compilation (prompts up to 128 tokens; top-k/top-p requests still compile
        on first use). Requests are served at once all the same: each waits at most for the
        one shape compiling in its lane. ``/health`` counts the shapes still to compile
        (``warming``) and names an error that stopped it (``warm_error``).

    Returns
    -------
    Server
        With ``url`` (``http://host:port/v1``), ``model`` and ``close()``;
        ``tfnb.serving_view(server)`` gives a live view of the requests in flight.

    Examples
    --------
    >>> server = tfnb.serve(placed, port=0)        # doctest: +SKIP
    >>> server.url                                 # doctest: +SKIP
    'http://127.0.0.1:40213/v1'
    """
    _check(host, port, api_key)
    replicated = _as_replicated(placed)
    if replicated.tokenizer is None:
        raise ServeError("this placed model has no tokenizer: the endpoint speaks text")
    name = model or replicated.name or "tfnb"
    if not isinstance(name, str):
        raise ServeError(f"model={model!r}: expected a str")
    if not isinstance(warmup, bool):
        raise ServeError(f"warmup={warmup!r}: expected True or False")
    import uvicorn

    if warmup:  # queued before the server starts: a model that cannot run fails here
        replicated.warmup(WARM_MODES, wait=False)
    endpoint = _Endpoint(replicated, name, api_key)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if warmup:
            replicated.cancel_warmup()
        raise ServeError(f"cannot listen on {host}:{port} ({e.strerror}): expected a free port "
                         "on an address of this machine") from None
    config = uvicorn.Config(endpoint.app(), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="tfnb-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if not server.started:
        server.should_exit = True
        thread.join(START_TIMEOUT_S)
        sock.close()
        if warmup:
            replicated.cancel_warmup()
        raise ServeError(f"the endpoint did not start within {START_TIMEOUT_S} s")
    return Server(server, thread, host, sock.getsockname()[1], name, placed=replicated,
                  warmup=warmup)
