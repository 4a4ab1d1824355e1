"""The endpoint's HTTP side: a Starlette app under uvicorn in a background thread.

``serve`` checks its arguments, binds the socket and starts the thread; :class:`Server` is the
handle it returns. Each request is checked by :mod:`tfnb.serving.protocol`, then runs on a
worker thread and joins the running batch of the least loaded replica (a split placement is
one replica). A client that disconnects mid-stream ends its generation and frees its rows.

It binds loopback unless told otherwise; any other address needs an ``api_key`` (checked as a
bearer token on every request) and warns.

Examples
--------
>>> with tfnb.serve(placed) as server:                        # doctest: +SKIP
...     print(server.url)
http://127.0.0.1:40213/v1
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
import warnings

from tfnb.cluster.connect import is_loopback
from tfnb.errors import GenerateError, GenerateStalled, TfnbError, WorkerLostError
from tfnb.serving.protocol import (
    ApiError,
    Chunks,
    chat_prompt,
    check_size,
    completion,
    finish,
    parse_body,
    parse_chat,
    parse_completion,
    usage,
)

__all__ = ["serve", "Server", "ServeError", "ExposedEndpointWarning"]

START_TIMEOUT_S = 10.0
RETRY_AFTER_S = 5  # Retry-After of a 503 while every copy is lost and healing brings it back
WARM_MODES = ("greedy", "sample")  # what the API's temperature 0 and its default ask for


class ServeError(TfnbError, ValueError):
    """A bad argument to ``serve`` (host, port, key, model)."""


class ExposedEndpointWarning(UserWarning):
    """The endpoint listens beyond this machine's loopback interface."""


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


def _as_replicated(placed, heal: bool = True):
    from tfnb.runtime import PlacedModel, ReplicatedModel

    if isinstance(placed, ReplicatedModel):
        return placed
    if isinstance(placed, PlacedModel):  # one replica: requests queue on it, never interleave
        return ReplicatedModel([placed], plan=placed.plan, heal=heal)
    raise ServeError(f"placed={placed!r:.60}: expected a model placed with tfnb.place (a "
                     "llama-family model)")


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
    def _error(self, e: ApiError):
        from starlette.responses import JSONResponse

        return JSONResponse(e.body(), status_code=e.status, headers=self._retry_after(e.status))

    def _retry_after(self, status: int) -> dict:
        """``Retry-After`` on a 503 while no copy serves and healing will place one again."""
        if status == 503 and self.model.healing and not self.model.replicas:
            return {"Retry-After": str(RETRY_AFTER_S)}
        return {}

    async def not_found(self, request, exc):
        return self._error(ApiError(404, f"no route {request.url.path!r}: expected /v1/models, "
                                         "/v1/chat/completions, /v1/completions or /health",
                                    code="not_found"))

    async def not_allowed(self, request, exc):
        return self._error(ApiError(405, f"{request.method} is not allowed on "
                                         f"{request.url.path!r}", code="method_not_allowed"))

    def _authorize(self, request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           kind="authentication_error", code="invalid_api_key")

    async def _body(self, request) -> dict:
        self._authorize(request)
        raw = bytearray()
        async for part in request.stream():
            raw += part
            check_size(len(raw))
        return parse_body(raw, self.name)

    # -- routes --
    async def health(self, request):
        from starlette.responses import JSONResponse

        try:
            self._authorize(request)
        except ApiError as e:
            return self._error(e)
        alive = [r for r in self.model.replicas if r.lost is None]
        errors = [e for e in (r.scheduler.warm_error() for r in alive) if e]
        serving = self.model.serving_status()
        copies = [{k: part[k] for k in ("replica", "devices", "state", "lost", "lost_at",
                                        "restored_at", "heal_error")}
                  for part in serving["replicas"]]
        status = 200 if alive else 503
        return JSONResponse({"status": "ok" if alive else "lost", "replicas": len(alive),
                             "warming": sum(r.scheduler.warming() for r in alive),
                             "warm_error": errors[0] if errors else None,
                             "healing": self.model.healing, "moved": serving["moved"],
                             "copies": copies},
                            status_code=status, headers=self._retry_after(status))

    async def models(self, request):
        from starlette.responses import JSONResponse

        try:
            self._authorize(request)
        except ApiError as e:
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
            max_context = self.model.config.max_context
            if chat:
                req = parse_chat(body, max_context)
                prompt = chat_prompt(self.tokenizer, req.messages)
            else:
                req = parse_completion(body, max_context)
                prompt = req.prompt
            if req.stream:
                events: list = []
                chunks = await run_in_threadpool(
                    lambda: self.model.generate(prompt, stream=True, chunk_tokens=4,
                                                on_chunk=events.append, **req.options))
                return self._sse(chunks, events, prompt,
                                 Chunks(self.name, chat, include_usage=req.include_usage))
            return await run_in_threadpool(self._whole, prompt, req.options, chat)
        except ApiError as e:
            return self._error(e)
        except GenerateStalled as e:  # the request was fine; its batch could not run
            return self._error(ApiError(503, str(e), "server_error"))
        except GenerateError as e:
            return self._error(ApiError(400, str(e)))
        except WorkerLostError as e:  # 503, with Retry-After while healing brings a copy back
            return self._error(_lost(e))

    def _whole(self, prompt, options, chat: bool):
        from starlette.responses import JSONResponse

        events: list = []
        text = self.model.generate(prompt, on_chunk=events.append, **options)
        return JSONResponse(completion(chat, self.name, text, finish(events)[0],
                                       self._usage(prompt, events)))

    def _usage(self, prompt: str, events: list) -> dict:
        return usage(len(self.tokenizer.encode(prompt)), finish(events)[1])

    def _sse(self, chunks, events, prompt: str, shape: Chunks):
        """Server-sent events of a streamed generation (``chunks``, its pieces of text)."""
        import anyio
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import StreamingResponse

        async def stream():
            done = object()
            try:
                if shape.chat:
                    yield shape.piece("", first=True)
                while True:
                    piece = await run_in_threadpool(next, chunks, done)
                    if piece is done:
                        break
                    if piece:
                        yield shape.piece(piece)
                yield shape.piece(None, finish(events)[0])
                if shape.include_usage:
                    yield shape.usage(self._usage(prompt, events))
                yield shape.DONE
            except GenerateError as e:  # the request was checked before: a stalled batch
                yield shape.error(ApiError(503, str(e), "server_error"))
            except WorkerLostError as e:
                yield shape.error(_lost(e))
            finally:  # also when the client went away: the generation ends, its replica frees
                # its rows. Shielded: a client that left cancels this task, and an unshielded
                # await would raise at once, leaving the rows to the garbage collector.
                with anyio.CancelScope(shield=True):
                    await run_in_threadpool(_close, chunks)

        return StreamingResponse(stream(), media_type="text/event-stream")


def _lost(e: WorkerLostError) -> ApiError:
    return ApiError(503, str(e), kind="server_error", code="worker_lost")


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


# ----- the server ---------------------------------------------------------------------------

class Server:
    """A running endpoint: ``url`` (ends in ``/v1``, for OpenAI clients), ``model``, ``close()``;
    ``placed`` is what it serves (a ``ReplicatedModel``; ``tfnb.serving_view(server)`` shows it
    live).

    Examples
    --------
    >>> with tfnb.serve(placed) as server:                        # doctest: +SKIP
    ...     print(server.url)
    http://127.0.0.1:40213/v1
    """

    def __init__(self, uvicorn_server, thread, host: str, port: int, model: str, placed=None,
                 warmup: bool = False, owns_placed: bool = False):
        self._server, self._thread, self.warmup = uvicorn_server, thread, warmup
        self._owns_placed = owns_placed  # serve() wrapped a PlacedModel: close() ends it too
        self.host, self.port, self.model, self.placed = host, port, model, placed
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting requests and end the server thread (within ``timeout`` s); drops the
        shapes its model still had queued to compile (and its healing, when ``serve`` was
        given a split placement)."""
        if self._owns_placed:
            self.placed.close()
        elif self.warmup:
            self.placed.cancel_warmup()
        self._server.should_exit = True
        self._thread.join(timeout)

    def serving_status(self) -> dict:
        """What the endpoint's model is serving now (``ReplicatedModel.serving_status``)."""
        return self.placed.serving_status()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "closed"
        return f"<tfnb Server {self.url} model={self.model!r} {state}>"


def serve(placed, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, *,
          model: str | None = None, warmup: bool = True, heal: bool = True) -> Server:
    """Serve ``placed`` (a ``PlacedModel`` or ``ReplicatedModel``) over OpenAI's HTTP API.

    Parameters
    ----------
    placed : PlacedModel or ReplicatedModel
        The result of ``tfnb.place`` for a llama-family model with a tokenizer.
    host : str
        The address to listen on; loopback by default. Any other address needs ``api_key``
        and warns (:class:`ExposedEndpointWarning`).
    port : int
        0 picks a free port (see ``server.url``).
    api_key : str, optional
        When given, every request must send ``Authorization: Bearer <api_key>``.
    model : str, optional
        The model name clients ask for (default: the placed model's name).
    warmup : bool
        Compile every batch, window and prompt-length bucket of greedy and sampled requests
        in the background (``placed.warmup``), so that requests arriving later never wait for
        a compilation (prompts up to 128 tokens; top-k/top-p requests still compile on first
        use). Requests are served at once all the same: each waits at most for the one shape
        compiling in its lane. ``/health`` counts the shapes still to compile (``warming``)
        and names an error that stopped it (``warm_error``).
    heal : bool
        Place a lost copy again once its workers answer (a worker restarted on the same
        address), warm it and put it back in rotation: ``ReplicatedModel.heal``, which this
        sets on a replicated model. A split placement is one copy: while it is down, requests
        get a 503 with ``Retry-After``. ``/health`` gives each copy's ``state`` (``serving``,
        ``lost``, ``restoring``), ``lost_at`` and ``restored_at``. False: a lost copy stays
        lost.

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
    if not isinstance(heal, bool):
        raise ServeError(f"heal={heal!r}: expected True or False")
    replicated = _as_replicated(placed, heal)
    owns = replicated is not placed
    if replicated.tokenizer is None:
        raise ServeError("this placed model has no tokenizer: the endpoint speaks text")
    name = model or replicated.name or "tfnb"
    if not isinstance(name, str):
        raise ServeError(f"model={model!r}: expected a str")
    if not isinstance(warmup, bool):
        raise ServeError(f"warmup={warmup!r}: expected True or False")
    import uvicorn

    if not owns:
        replicated.heal(heal)
    if warmup:  # queued before the server starts: a model that cannot run fails here
        replicated.warmup(WARM_MODES, wait=False)
    endpoint = _Endpoint(replicated, name, api_key)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if owns:
            replicated.close()
        elif warmup:
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
        if owns:
            replicated.close()
        elif warmup:
            replicated.cancel_warmup()
        raise ServeError(f"the endpoint did not start within {START_TIMEOUT_S} s")
    return Server(server, thread, host, sock.getsockname()[1], name, placed=replicated,
                  warmup=warmup, owns_placed=owns)
