"""A llama model whose stages live on TF devices, generating in one graph call per chunk.

``place_llama(model, assignment)`` (what ``tfnb.place`` runs for llama models) creates each
stage's weights as ``tf.Variable``s directly on its
device. Consecutive stages on one device form a *segment*; each segment has one XLA-compiled
function for prefill and one for a decode step, which read its weights and update its KV caches
(also variables on that device) in place. Generate calls run in the placed model's scheduler
(:mod:`tfnb.runtime.scheduler`): concurrent calls share the batch, joining and leaving between
chunks of decode steps. A chunk is a single ``tf.function``: on one device a loop compiled
whole by XLA (``xla_loop``), over several devices a run of unrolled steps that calls every
segment under ``tf.device(segment.device)``. Only activations (B, T, D) and the int32 next
token cross devices; sampling happens on the head's device.

Examples
--------
>>> from tfnb.models import tiny          # doctest: +SKIP
>>> pm = place_llama(tiny("llama"), ["/device:CPU:0"])  # doctest: +SKIP
>>> pm.generate("Hello", max_new_tokens=8)  # doctest: +SKIP
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections import OrderedDict

import numpy as np
import tensorflow as tf

from tfnb import kernels
from tfnb.errors import GenerateError, GenerateStalled, PlacementError, WorkerLostError
from tfnb.models.chain import segments, stage_names
from tfnb.models.packed import PackedTensor
from tfnb.names import format_bytes, short_device
from tfnb.runtime.devices import resolve_assignment
from tfnb.runtime.faults import call_with_deadline
from tfnb.runtime.fileload import WeightLoader
from tfnb.runtime.graphs import Program, shared_segment_functions
from tfnb.runtime.requests import (
    GenerateOptions,
    GenerateRequest,
    make_batch,
    prompt_ids,
    with_options_signature,
)
from tfnb.runtime.scheduler import Scheduler
from tfnb.runtime.session import GenerateSession
from tfnb.runtime.slots import MAX_ROWS
from tfnb.runtime.tickets import RECENT, SAMPLING_MODES
from tfnb.runtime.weights import (
    check_weights,
    compact_weight,
    kv_caches,
    packed_routes,
    param_variables,
    segment_params,
    segment_weights,
    with_activations,
)
from tfnb.shutdown import start_thread

__all__ = ["place_llama", "PlacedModel"]

_MAX_PROGRAMS = 3  # cache sets (batch, length) kept alive at once

# How packed Q4_0, Q4_1 and Q8_0 matrices multiply unless a placement says
# (``tfnb.kernels.packed_matmul``; docs/kernels.md).
DEFAULT_ACTIVATIONS = "float32"


def check_activations(activations: str | None) -> str:
    """``activations``, or the default for None; anything else is one ``PlacementError``."""
    if activations is None:
        return DEFAULT_ACTIVATIONS
    if activations not in kernels.ACTIVATIONS:
        raise PlacementError(f"activations={activations!r}: expected one of "
                             f"{list(kernels.ACTIVATIONS)} (or None for the default, "
                             f"{DEFAULT_ACTIVATIONS!r})")
    return activations


def place_llama(model, assignment, *, timeout: float | None = 60.0,
                xla_loop: bool = True, files=None, progress=False,
                activations: str | None = None, route=None) -> PlacedModel:
    """Put ``model``'s stages on devices and return a ``PlacedModel`` ready to generate.

    Parameters
    ----------
    model
        Anything with ``.config`` (a ``LlamaConfig``), ``.weights`` (canonical numpy weights)
        and optionally ``.tokenizer``, such as ``tfnb.models.tiny("llama")``.
    assignment : dict or list
        Stage name (``"embed"``, ``"block.0"`` ... ``"head"``) -> TF device string, covering every
        stage; or a list of devices, over which the stages are split evenly in order.
    timeout : float or None
        Seconds a generate call (or one streamed chunk) may take before ``WorkerLostError``
        (None: wait forever). A call that first compiles a function gets
        ``PlacedModel.compile_timeout`` (900 s) instead.
    xla_loop : bool
        When every stage is on one device (default True), each chunk of decode steps is one
        XLA computation, the loop inside it; else a graph loop on the device launches the
        compiled step once per step, each launch passing every weight and cache variable.
        Either compiles once per batch bucket, window and sampling mode (prompts prefill in
        functions of their own, and a chunk's length is an argument). The loop inside XLA is
        the faster of the two by a few percent per step (docs/runtime.md). A chain
        over several devices runs unrolled chunks instead
        (:func:`tfnb.runtime.graphs.unrolled_decode`).
    files : None, False or dict
        Where each worker reads a GGUF model's packed weights (``tfnb.runtime.fileload``):
        None, the client's path on every worker (a worker without it is sent them); False,
        send everything from the client; a dict, per worker (``{"worker:1": "/data/m.gguf"}``,
        None for sending). ``placed.weight_sources`` says what each worker did.
    progress : bool or callable
        A progress bar of the bytes sent to each worker (shown from 64 MB).
    activations : {"float32", "int8"}, optional
        How packed Q4_0, Q4_1 and Q8_0 matrices multiply (``tfnb.kernels.packed_matmul``):
        ``"int8"`` as llama.cpp does (activations rounded to int8 blocks, integer dot
        products), ``"float32"`` with float32 activations. Default
        :data:`DEFAULT_ACTIVATIONS`.
    route : {"auto", "kernel", "xla"} or dict, optional
        Where packed matrices multiply (``tfnb.runtime.weights.packed_routes``): with tfnb's
        fused kernel (CPU devices of ``tfnb worker``), or held as plain tensors and multiplied
        in XLA ops (:mod:`tfnb.runtime.compact`: any TF server, any device). ``"auto"`` (None)
        takes the kernel where a CPU device has it; a dict sets it per worker or device
        (``{"worker:1": "xla"}``). ``placed.routes`` says what each device got.

    Raises
    ------
    PlacementError
        A stage without a device, an unknown stage or device, or missing/misshapen weights.
        Nothing is left created on the devices.

    Examples
    --------
    >>> from tfnb.models import tiny                    # doctest: +SKIP
    >>> pm = place_llama(tiny("llama"), ["/device:CPU:0", "/device:CPU:1"])  # doctest: +SKIP
    >>> pm.segments[0].stages                           # doctest: +SKIP
    ('embed', 'block.0')
    """
    arch = getattr(model, "arch", "llama")
    if arch != "llama" or getattr(model, "weights", None) is None:
        raise PlacementError(f"model {getattr(model, 'name', model)!r:.60} has arch {arch!r}: "
                             "place() expects a llama-family model with canonical weights")
    config, weights = model.config, model.weights
    resolved = resolve_assignment(assignment, stage_names(config.n_layers))
    check_weights(config, weights)
    return PlacedModel(config, weights, getattr(model, "tokenizer", None), resolved,
                       timeout=timeout, name=getattr(model, "name", None), xla_loop=xla_loop,
                       files=files, progress=progress, activations=activations, route=route)


class PlacedModel:
    """A placed llama model. Build with ``tfnb.place``; see ``generate``, ``generate_ids``,
    ``chat`` and ``logits``.

    Attributes
    ----------
    assignment : dict
        Stage -> full TF device name.
    segments : list of Segment
        Runs of consecutive stages on one device, in order; ``params`` holds their weights.
    plan : tfnb.Plan or None
        The plan this placement applied, when it came from one.
    timeout, compile_timeout : float or None
        Seconds a call (one streamed chunk) may take; a call that first compiles a function gets
        the larger of the two. Either way a worker that stops answering fails a call within
        seconds (``tfnb.runtime.faults``).
    scheduler : tfnb.runtime.scheduler.Scheduler
        The request queue and KV-cache lanes every generate call runs in (continuous
        batching): one lane per device of a split chain, so concurrent requests keep every
        stage busy.
    max_batch : int
        Cache rows per lane (concurrent sequences batched together; a request with more
        prompts grows its lane when the lane is idle).
    last_stats : dict or None
        Tokens, chunks, seconds, tokens/s, queue wait and time to first token of the last
        finished generate call.
    compiles : int
        Calls so far that first compiled a function for their shapes (``warmup`` makes them
        ahead of the requests).

    Examples
    --------
    >>> pm.generate(["Hi", "Hello there"], max_new_tokens=4)  # doctest: +SKIP
    """

    def __init__(self, config, weights, tokenizer, assignment: dict[str, str], *,
                 timeout: float | None = 60.0, name: str | None = None, reuse=None,
                 xla_loop: bool = True, plan=None, files=None, progress=False,
                 activations: str | None = None, route=None):
        self.activations = check_activations(activations)
        self.route = route
        self.routes: dict[str, str] = {}  # device -> "kernel", "xla" or "float32", set below
        self.config, self.tokenizer, self.timeout, self.name = config, tokenizer, timeout, name
        self.plan = plan
        self._weights = weights  # the client's copy (not duplicated), for replace()
        self.assignment = dict(assignment)
        self.segments = segments(self.assignment, stage_names(config.n_layers))
        self.devices = list(dict.fromkeys(s.device for s in self.segments))
        self._programs: OrderedDict = OrderedDict()
        self._warm: dict[int, object] = {}  # functions called (so compiled) before
        self.compiles = 0  # calls that compiled a function for a new shape
        self._count_lock = threading.Lock()
        self.compile_timeout: float | None = 900.0
        self.xla_loop = bool(xla_loop)  # see place_llama()
        self._call_lock = threading.RLock()
        self._inflight: threading.Thread | None = None  # a call that Ctrl-C left running
        self._lost: str | None = None
        self.last_stats: dict | None = None
        self.max_batch = MAX_ROWS
        self.moved_stages = list(self.assignment)  # stages whose weights this placement moved
        eos = tuple(config.eos_ids) or tuple(getattr(tokenizer, "eos_ids", ()) or ())
        self.eos_ids = eos
        self.pad_id = eos[0] if eos else 0
        self.scheduler = Scheduler(self, len(self.devices) if len(self.segments) > 1 else 1)
        _LIVE.add(self)
        shared: dict = {}  # device -> the tied (D, V) embedding there
        self._files, self._progress = files, progress
        loader = WeightLoader(weights, self.devices, files, progress)
        self.params = []
        self._requantized: list[tuple[str, str, int, float]] = []
        if any(isinstance(w, PackedTensor) for w in weights.values()):
            self.routes = packed_routes(self.devices, route, timeout=timeout)
        else:
            self.routes = dict.fromkeys(self.devices, "float32")
        loader.check(timeout)  # a worker's file that differs stops here, before any weight
        loader.plan_sends(self.segments, lambda seg: segment_weights(config, weights, seg))
        try:  # copying a large model may take minutes; a silent worker fails it in seconds
            self.params = call_with_deadline(
                self._create_params, (config, weights, shared, reuse, loader.variable),
                timeout=self.compile_timeout, devices=self.devices, what="creating the weights")
        except tf.errors.OpError as e:
            self.params = []
            raise PlacementError(f"creating weights on the devices failed: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200]}") from e
        loader.finish()
        self.weight_sources = loader.summary()
        self._warn_requantized()

    # ----- weights and caches ---------------------------------------------------------------

    def _create_params(self, config, weights, shared, reuse, put) -> list[dict]:
        """Every segment's weights (``segment_params``), each device's on a thread of its own:
        making a variable waits for its worker to have read or received its value, so one
        thread per device keeps all the workers reading at once."""
        made: dict[int, dict] = {}
        errors: list[BaseException] = []

        def routed(device, value, name):  # each packed matrix multiplies on its device's route
            if self.routes[device] == "xla":
                return compact_weight(put, device, value, name, self._requantized)
            return with_activations(put(device, value, name), self.activations)

        def run(device):
            try:
                for i, seg in enumerate(self.segments):
                    if seg.device == device:
                        made[i] = segment_params(config, weights, seg, shared=shared,
                                                 head_device=self.assignment["head"],
                                                 reuse=reuse, put=routed)
            except BaseException as e:  # noqa: BLE001 - raised in the calling thread
                errors.append(e)

        for thread in [start_thread(run, d, name=f"tfnb-weights-{k}")
                       for k, d in enumerate(self.devices)]:
            thread.join()
        if errors:
            raise errors[0]
        return [made[i] for i in range(len(self.segments))]

    def _warn_requantized(self) -> None:
        """One warning for the matrices the XLA route held as Q8_0 instead of their type."""
        if not self._requantized:
            return
        kinds = sorted({k for _, k, _, _ in self._requantized})
        where = sorted({short_device(d).split("/")[0] for d, *_ in self._requantized})
        grown = sum(n for _, _, n, _ in self._requantized)
        error = max(e for *_, e in self._requantized)
        warnings.warn(
            f"route 'xla' holds {len(self._requantized)} {'/'.join(kinds)} matrices as Q8_0 on "
            f"{', '.join(where)} (+{format_bytes(grown)}; largest error "
            f"{100 * error:.2f}% of a row's largest value); the kernel route keeps them as "
            "they are", stacklevel=5)

    def replace(self, assignment) -> PlacedModel:
        """A new placement of the same model; blocks whose device is unchanged keep their
        variables (nothing moves for them), the others are created on their new device. A
        placement that lost a worker reuses nothing: every stage is created afresh.

        Examples
        --------
        >>> moved = pm.replace({**pm.assignment, "block.1": "/device:CPU:1"})  # doctest: +SKIP
        >>> moved.moved_stages                                                 # doctest: +SKIP
        ['block.1']
        """
        resolved = resolve_assignment(assignment, stage_names(self.config.n_layers))
        reuse = {} if self._lost else {
            (i, seg.device): block for seg, p in zip(self.segments, self.params)
            for i, block in zip(seg.blocks, p["blocks"])}
        pm = PlacedModel(self.config, self._weights, self.tokenizer, resolved,
                         timeout=self.timeout, name=self.name, reuse=reuse,
                         xla_loop=self.xla_loop, files=self._files, progress=self._progress,
                         activations=self.activations, route=self.route)
        pm.compile_timeout = self.compile_timeout
        pm.moved_stages = [s for s in resolved
                           if self._lost or resolved[s] != self.assignment.get(s)]
        return pm

    def on_state_lost(self, reason: str) -> None:
        """Called by the cluster when a worker holding our variables restarted or died."""
        self._lost = f"this placed model lost its state on a worker ({reason}); place it again"

    @property
    def lost(self) -> str | None:
        """Why this placement can no longer run (a lost worker), or None."""
        return self._lost

    @property
    def variables(self) -> list[tf.Variable]:
        """Every weight variable, in stage order."""
        return param_variables(self.params)

    def bytes_per_step(self, rows: int, window: int) -> dict[str, dict]:
        """What one decode step of ``rows`` sequences attending ``window`` cache slots reads
        on each device: ``{device: {"weights": bytes, "kv_cache": bytes}}`` (weights as held
        there, packed ones packed; the keys and values of every block there over the window)."""
        cfg = self.config
        slot_bytes = 2 * cfg.n_kv_heads * cfg.head_dim * 4  # one slot's key and value, float32
        out: dict = {}
        for dev in self.devices:
            mine = [(seg, p) for seg, p in zip(self.segments, self.params) if seg.device == dev]
            variables = param_variables([p for _, p in mine])  # a tied table counted once
            out[dev] = {"weights": sum(v.shape.num_elements() * v.dtype.size for v in variables),
                        "kv_cache": (sum(len(seg.blocks) for seg, _ in mine)
                                     * rows * window * slot_bytes)}
        return out

    def program(self, B: int, S: int, owner="logits") -> Program:
        """The compiled functions over a set of KV caches for batch ``B`` and ``S`` slots,
        made on first use. Each scheduler lane (``owner`` its index) has one set, replaced
        when it asks for another size; ``logits`` keeps the ``_MAX_PROGRAMS`` most recent."""
        key = (owner, B, S)
        if key in self._programs:
            self._programs.move_to_end(key)
            return self._programs[key]
        # the lanes of a split placement call this and add to _warm from their own threads:
        # read both as snapshots (list() copies a dict at once, where iterating it would fail
        # when another lane adds a key meanwhile)
        mine = [k for k in list(self._programs) if k[0] == owner]
        while mine and (owner != "logits" or len(mine) >= _MAX_PROGRAMS):
            old = self._programs.pop(mine.pop(0))
            stale = {id(fn) for fn in old.graphs.values()}
            for key in [k for k in list(self._warm) if k[0] in stale]:
                self._warm.pop(key, None)
        cfg = self.config
        shape = [B, cfg.n_kv_heads, S, cfg.head_dim]
        if self._lost:
            raise WorkerLostError(self._lost)
        try:
            caches = call_with_deadline(
                lambda: [kv_caches(seg, shape) for seg in self.segments], (),
                timeout=self.compile_timeout, devices=self.devices,
                what="allocating the KV caches")
        except WorkerLostError as e:
            if e.confirmed:
                self._lost = f"this placed model lost a worker earlier ({e}); place it again"
            raise
        fns = [shared_segment_functions(seg, cfg, self.eos_ids, self.pad_id)
               for seg in self.segments]
        program = Program(self.segments, fns, self.params, caches, S, self.xla_loop)
        self._programs[key] = program
        return program

    def run(self, fn, args=(), what: str = "generate", lock=None):
        """``fn(*args)`` with this placement's deadline and liveness probes; tensor results
        come back as numpy arrays. ``WorkerLostError`` names a lost worker, and the placement
        refuses further calls after one.

        Calls holding the same ``lock`` run one at a time (a scheduler lane passes its own, so
        lanes run at once); by default the placement's own lock, which also makes a call wait
        for one that Ctrl-C interrupted."""
        if self._lost:
            raise WorkerLostError(self._lost)
        with lock or self._call_lock:
            if lock is None:
                self._wait_for_interrupted()
            # A function's first call traces and XLA-compiles it (up to a minute for a real
            # model on a busy machine), so it gets the longer compile_timeout; the liveness
            # probes still fail it within seconds when a worker stops answering.
            warm_key = _warm_key(fn, args)
            first = warm_key not in self._warm
            if first:
                with self._count_lock:  # lanes call at once
                    self.compiles += 1
            timeout = self.timeout
            if first and timeout is not None and self.compile_timeout is not None:
                timeout = max(timeout, self.compile_timeout)
            try:
                # The results are fetched inside the deadline too: a remote call returns its
                # handles at once, and it is reading them that waits for a stopped worker.
                out = call_with_deadline(_fetched(fn), args, timeout=timeout,
                                         devices=self.devices,
                                         what=what + (" (compiling)" if first else ""),
                                         on_start=self._started if lock is None else None)
                self._warm[warm_key] = fn
                return out
            except WorkerLostError as e:
                if e.confirmed:  # else its own workers all answer: nothing of it was lost
                    self._lost = (f"this placed model lost a worker earlier ({e}); place it "
                                  "again after reconnecting")
                raise

    def compiled(self, fn, args) -> bool:
        """Whether ``fn`` ran before with arguments of the shapes of ``args`` (so is compiled)."""
        return _warm_key(fn, args) in self._warm

    def _started(self, thread: threading.Thread) -> None:
        self._inflight = thread

    def _wait_for_interrupted(self) -> None:
        """A call interrupted by Ctrl-C keeps running on the workers; the next call waits for
        it (within the deadline), so the two never race on the KV caches."""
        thread, self._inflight = self._inflight, None
        if thread is None or not thread.is_alive():
            return
        thread.join(self.timeout)
        if thread.is_alive():
            self._inflight = thread
            raise GenerateStalled(f"an interrupted call is still running on the workers after "
                                f"{self.timeout} s; try again later, or place the model again")

    # ----- public API ---------------------------------------------------------------------

    @with_options_signature
    def generate(self, prompts, **options):
        """Continue each prompt; a str for a str prompt, a list of str for a list.

        Parameters
        ----------
        prompts : str or list of str
            Prompts of any lengths (batched with left padding; each row gives the same tokens as
            alone, up to float rounding).
        **options
            ``max_new_tokens=32``, ``do_sample=False``, ``temperature=1.0``, ``top_k=0``,
            ``top_p=1.0``, ``seed=None``, ``stop=None``, ``stream=False``,
            ``chunk_tokens=None``, ``on_chunk=None``: see
            :class:`tfnb.runtime.requests.GenerateOptions`. With ``stream=True`` the result is
            an iterator of new text per chunk (a str, or a list per row).

        Examples
        --------
        >>> pm.generate("The capital of France is", max_new_tokens=8)  # doctest: +SKIP
        >>> for piece in pm.generate("Once", stream=True, chunk_tokens=4):  # doctest: +SKIP
        ...     print(piece, end="")
        """
        session = self._session(prompts, options, text=True)
        return session.iter_text() if session.request.stream else session.run_text()

    @with_options_signature
    def generate_ids(self, prompts, **options):
        """Like ``generate`` but returns new token ids (a list, or a list per row).

        ``prompts`` may also be token ids: a list of int, or a list of such lists. The ids end
        with the EOS token when a row stopped on one.

        Examples
        --------
        >>> pm.generate_ids([1, 40, 41], max_new_tokens=3)  # doctest: +SKIP
        [57, 12, 80]
        """
        session = self._session(prompts, options, text=False)
        return session.iter_ids() if session.request.stream else session.run_ids()

    def chat(self, message_or_messages, **kwargs):
        """Answer a user message (a str) or a conversation (a list of role/content dicts).

        Examples
        --------
        >>> pm.chat("What is the capital of France?", max_new_tokens=16)  # doctest: +SKIP
        'The capital of France is Paris.'
        """
        if self.tokenizer is None:
            raise GenerateError("chat needs a tokenizer: this model has none")
        messages = message_or_messages
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not isinstance(messages, (list, tuple)) or not messages or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise GenerateError(f"message={message_or_messages!r:.80}: expected a str or a "
                                "non-empty list of {'role': ..., 'content': ...} dicts")
        prompt = self.tokenizer.apply_chat_template(list(messages))
        if not isinstance(prompt, str):  # a tokenizer that returns ids
            prompt = [int(t) for t in prompt]
        return self.generate(prompt, **kwargs) if isinstance(prompt, str) else \
            self.tokenizer.decode(self.generate_ids(prompt, **kwargs))

    def logits(self, prompts) -> list[np.ndarray] | np.ndarray:
        """Logits (T, V) for every position of each prompt (padding dropped), via prefill.

        Examples
        --------
        >>> pm.logits([1, 40, 41]).shape  # doctest: +SKIP
        (3, 96)
        """
        rows, single = prompt_ids(prompts, self.tokenizer, self.config.vocab_size)
        batch = make_batch(rows, 1, self.config.max_context, self.pad_id)
        program = self.program(len(batch.pad_B), batch.max_len)
        fn = program.logits_fn(batch.ids_BxP.shape[1])
        out = self.run(fn, (batch.ids_BxP, batch.pad_B), what="logits")
        per_row = [out[b, batch.pad_B[b]:] for b in range(batch.n_real)]
        return per_row[0] if single else per_row

    def warmup(self, modes=("greedy",), prompt_tokens: int | None = None, *, wait: bool = True,
               timeout: float | None = None) -> dict:
        """Compile ahead every shape of call that serving meets, so that no request waits for a
        compilation: each batch bucket (1, 2, 4 ... rows) at each attention window of every
        lane's caches, and each prompt-length bucket up to ``prompt_tokens`` (default 128, or
        the model's context when shorter), for each sampling
        mode of ``modes`` (``"greedy"``, ``"sample"``: temperature only, ``"filter"``: top-k or
        top-p). A new shape otherwise compiles when a request first needs it, and every request
        of its lane waits (about 5 s for SmolLM2 on one core: half tracing in this process,
        half XLA on the worker). Not compiled ahead: prefills of several prompts in one
        request (the endpoint sends one), and modes not asked for.

        Each lane compiles while it has no request, one shape at a time; requests go first
        (though the compiling shares the cores: on a split, one lane's shapes compile on both
        workers). A lane whose caches a longer request makes bigger queues its shapes again.
        With ``wait`` this returns when all are compiled (or after ``timeout`` s); else at once.
        ``serving_status()`` counts the shapes still to compile per lane (``warming``).

        Returns
        -------
        dict
            ``queued`` (shapes asked for), ``compiled`` (compiled by now, the others were
            already), ``left`` (still queued) and ``seconds``.

        Examples
        --------
        >>> pm.warmup(modes=("greedy", "sample"))                       # doctest: +SKIP
        {'queued': 39, 'compiled': 37, 'left': 0, 'seconds': 181.2}
        """
        return warm_up([self], modes, prompt_tokens, wait, timeout)

    def cancel_warmup(self) -> None:
        """Drop the shapes ``warmup`` still has to compile (the one compiling now finishes)."""
        self.scheduler.cancel_warmup()

    def serving_status(self) -> dict:
        """What this model is serving now, as plain data (cheap, read-only, never waits for a
        device call): the same shape as ``ReplicatedModel.serving_status``, with this
        placement as its one replica.

        Returns
        -------
        dict
            ``model``, ``time`` (``time.time()``), ``in_flight`` (requests not finished),
            ``replicas`` (one dict: ``replica``, ``devices``, ``lost``, ``served``, ``lanes``,
            ``requests``, ``recent``, as :meth:`Scheduler.status` gives the last three), and
            ``requests``/``recent`` over every replica.

        Examples
        --------
        >>> st = pm.serving_status()                                    # doctest: +SKIP
        >>> [(r["id"], r["tokens"], round(r["tokens_per_s"]))          # doctest: +SKIP
        ...  for r in st["requests"]]
        [(7, 12, 48), (8, 4, 31)]
        """
        return serving_summary(self.name, [self.replica_status(0)])

    def replica_status(self, index: int) -> dict:
        """This placement as replica ``index`` of a serving status (see ``serving_status``)."""
        status = self.scheduler.status()
        for r in status["requests"] + status["recent"]:
            r["replica"] = index
        return {"replica": index, "devices": list(self.devices), "lost": self._lost,
                "max_batch": self.max_batch, **status}

    def _session(self, prompts, options: dict, text: bool) -> GenerateSession:
        if self._lost:
            raise WorkerLostError(self._lost)
        request = GenerateRequest.check(prompts, tokenizer=self.tokenizer, config=self.config,
                                        text=text, options=GenerateOptions.of(options))
        return GenerateSession(self, request)

    @property
    def stage_routes(self) -> dict[str, str]:
        """Stage -> how its matrices multiply: ``"kernel"`` (tfnb's packed-weight ops),
        ``"xla"`` (compact tensors in XLA ops) or ``"float32"`` (a float model)."""
        return {stage: self.routes[device] for stage, device in self.assignment.items()}

    def route_summary(self) -> str:
        """One line: each device's route, e.g. ``"worker:0/CPU:0 kernel, worker:1/CPU:0 xla"``."""
        return ", ".join(f"{short_device(d)} {r}" for d, r in self.routes.items())

    def __repr__(self) -> str:
        segs = ", ".join(f"{s.stages[0]}..{s.stages[-1]}@{s.device}" if len(s.stages) > 1
                         else f"{s.stages[0]}@{s.device}" for s in self.segments)
        return f"PlacedModel({self.name or 'llama'}: {segs}; weights: {self.route_summary()})"


_LIVE: weakref.WeakSet = weakref.WeakSet()


def live_models() -> list[PlacedModel]:
    """Every placed model this process still holds (a profile finds the ones that ran in it)."""
    return list(_LIVE)


def serving_summary(name, replicas: list[dict]) -> dict:
    """A serving status from its replicas' parts: their requests and recent ones together
    (recent ones in the order they ended, the last ``RECENT``)."""
    requests = sorted((r for rep in replicas for r in rep["requests"]), key=lambda r: r["id"])
    recent = sorted((r for rep in replicas for r in rep["recent"]),
                    key=lambda r: r["ended_at"])[-RECENT:]
    return {"model": name, "time": time.time(), "in_flight": len(requests),
            "replicas": replicas, "requests": requests, "recent": recent}


WARM_PROMPT_TOKENS = 128  # prompt lengths warmup() compiles by default


def warm_up(models: list[PlacedModel], modes, prompt_tokens, wait: bool,
            timeout: float | None) -> dict:
    """``PlacedModel.warmup`` over ``models`` at once (the replicas of one model)."""
    try:
        names = [modes] if isinstance(modes, str) else list(modes)
    except TypeError:
        names = []
    if not names or any(not isinstance(m, str) or m not in SAMPLING_MODES for m in names):
        raise GenerateError(f"modes={modes!r}: expected one or more of "
                            f"{', '.join(map(repr, SAMPLING_MODES))}")
    modes = list(dict.fromkeys(names))
    if prompt_tokens is None:
        prompt_tokens = min(WARM_PROMPT_TOKENS, models[0].config.max_context - 1)
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or not (
            0 <= prompt_tokens <= models[0].config.max_context - 1):
        raise GenerateError(f"prompt_tokens={prompt_tokens!r}: expected an int from 0 to "
                            f"{models[0].config.max_context - 1} (the model's context)")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(
            timeout, (int, float)) or not timeout > 0):
        raise GenerateError(f"timeout={timeout!r}: expected seconds > 0, or None")
    if not isinstance(wait, bool):
        raise GenerateError(f"wait={wait!r}: expected True or False")
    alive = [pm for pm in models if not pm.lost]
    if not alive:  # a replica that lost its worker is skipped (its model drops it)
        raise WorkerLostError(models[0].lost)
    models = alive
    lanes = [lane for pm in models for lane in pm.scheduler.lanes]
    t0, before = time.perf_counter(), sum(lane.warmup.compiled for lane in lanes)
    queued = sum(pm.scheduler.warmup(modes, prompt_tokens) for pm in models)
    if wait:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for pm in models:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                pm.scheduler.wait_warm(left)
        except KeyboardInterrupt:  # Ctrl-C stops the warm-up, not only the wait
            for pm in models:
                pm.cancel_warmup()
            raise
    return {"queued": queued, "compiled": sum(lane.warmup.compiled for lane in lanes) - before,
            "left": sum(pm.scheduler.warming() for pm in models),
            "seconds": round(time.perf_counter() - t0, 1)}


def _warm_key(fn, args) -> tuple:
    return (id(fn),) + tuple(np.shape(a) for a in args)  # a new shape compiles


def _fetched(fn):
    """``fn`` whose tensor results are copied to the client as numpy arrays."""
    def call(*args):
        return tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, fn(*args))
    return call
