"""A llama model whose stages live on TF devices, generating in one graph call per chunk.

``place(model, assignment)`` creates each stage's weights as ``tf.Variable``s directly on its
device. Consecutive stages on one device form a *segment*; each segment has one XLA-compiled
function for prefill and one for a decode step, which read its weights and update its KV caches
(also variables on that device) in place. A generate call (or one streaming chunk) is a single
multi-device ``tf.function``: prefill, then a ``tf.while_loop`` whose body calls every segment
under ``tf.device(segment.device)``. Only activations (B, T, D) and the int32 next token cross
devices; sampling happens on the head's device.

Examples
--------
>>> from tfnb.models import tiny          # doctest: +SKIP
>>> pm = place(tiny("llama"), ["/device:CPU:0"])  # doctest: +SKIP
>>> pm.generate("Hello", max_new_tokens=8)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

from tfnb.errors import GenerateError, PlacementError, WorkerLostError
from tfnb.runtime import llama as L
from tfnb.runtime.devices import resolve_assignment, stage_names
from tfnb.runtime.faults import call_with_deadline
from tfnb.runtime.session import GenerateSession

__all__ = ["place", "PlacedModel", "Segment"]

_MAX_PROGRAMS = 3  # cache sets (batch, length) kept alive at once


class _QuietRetracing(logging.Filter):
    """Drop TF's "frequent retracing" warning for our functions: each bucket's functions (and
    each calibration loop, :mod:`tfnb.runtime.calibrate`) are separate tf.function objects
    traced once, which TF's detector mistakes for retracing."""

    OURS = ("_outer_function", "_segment_functions", "_logits_function", "_timed_loop")

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("triggered tf.function retracing" in msg
                    and any(name in msg for name in self.OURS))


tf.get_logger().addFilter(_QuietRetracing())


class Segment(NamedTuple):
    """Consecutive stages on one device."""
    device: str
    stages: tuple[str, ...]
    blocks: tuple[int, ...]
    has_embed: bool
    has_head: bool


def _segments(assignment: dict[str, str], names: list[str]) -> list[Segment]:
    runs: list[list[str]] = []
    for name in names:
        if runs and assignment[runs[-1][-1]] == assignment[name]:
            runs[-1].append(name)
        else:
            runs.append([name])
    return [Segment(assignment[r[0]], tuple(r),
                    tuple(int(s.split(".")[1]) for s in r if s.startswith("block.")),
                    "embed" in r, "head" in r) for r in runs]


def place(model, assignment, *, timeout: float | None = 60.0,
          xla_loop: bool = False) -> "PlacedModel":
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
        When every stage is on one device, compile the whole decode loop into one XLA
        computation: faster per token (about 40 us/step less in this process; on a remote
        worker pinned to one core, probed, SmolLM2 ran 34 against 39 ms per token), but every
        new prompt length bucket and streaming recompile the whole loop. Default False: the
        loop is a graph loop calling each segment's compiled step, which new prompt lengths
        reuse.

    Raises
    ------
    PlacementError
        A stage without a device, an unknown stage or device, or missing/misshapen weights.
        Nothing is left created on the devices.

    Examples
    --------
    >>> from tfnb.models import tiny                    # doctest: +SKIP
    >>> pm = place(tiny("llama"), ["/device:CPU:0", "/device:CPU:1"])  # doctest: +SKIP
    >>> pm.segments[0].stages                           # doctest: +SKIP
    ('embed', 'block.0')
    """
    arch = getattr(model, "arch", "llama")
    if arch != "llama" or getattr(model, "weights", None) is None:
        raise PlacementError(f"model {getattr(model, 'name', model)!r:.60} has arch {arch!r}: "
                             "place() expects a llama-family model with canonical weights")
    config, weights = model.config, model.weights
    names = stage_names(config)
    resolved = resolve_assignment(assignment, names)
    _check_weights(config, weights)
    pm = PlacedModel(config, weights, getattr(model, "tokenizer", None), resolved,
                     timeout=timeout, name=getattr(model, "name", None))
    pm.xla_loop = bool(xla_loop)
    return pm


def _check_weights(config, weights) -> None:
    from tfnb.models.llama import weight_shapes

    for name, shape in weight_shapes(config).items():
        if name not in weights:
            raise PlacementError(f"weights lack {name!r}: expected every name of "
                                 "weight_shapes(config)")
        if tuple(np.shape(weights[name])) != shape:
            raise PlacementError(f"weight {name!r} has shape {np.shape(weights[name])}: "
                                 f"expected {shape}")


class _Program(NamedTuple):
    """Compiled functions bound to one set of KV caches of shape (B, K, S, E)."""
    caches: list            # per segment: list of (k_var, v_var) per block
    seg_fns: list           # per segment: (prefill_fn, decode_fn), XLA-compiled
    outer: dict             # (prefill P or None, mode) -> tf.function
    max_len: int            # S


class PlacedModel:
    """A placed llama model. Build with ``place``; see ``generate``, ``generate_ids``, ``chat``.

    Examples
    --------
    >>> pm.generate(["Hi", "Hello there"], max_new_tokens=4)  # doctest: +SKIP
    """

    def __init__(self, config, weights, tokenizer, assignment: dict[str, str], *,
                 timeout: float | None = 60.0, name: str | None = None, reuse=None):
        self.config, self.tokenizer, self.timeout, self.name = config, tokenizer, timeout, name
        self._weights = weights  # the client's copy (not duplicated), for replace()
        reuse = reuse or {}      # (block index, device) -> BlockParams already there
        self.assignment = dict(assignment)
        self.segments = _segments(self.assignment, stage_names(config))
        self.devices = list(dict.fromkeys(s.device for s in self.segments))
        self._programs: OrderedDict = OrderedDict()
        self._warm: dict[int, object] = {}  # functions called (so compiled) before
        self.compile_timeout: float | None = 900.0
        self.xla_loop = False  # see place()
        self._call_lock = threading.RLock()
        self._lost: str | None = None
        self._owner = None  # the GenerateSession whose state is in the caches
        self.moved_stages = list(self.assignment)  # stages whose weights this placement moved
        eos = tuple(config.eos_ids) or tuple(getattr(tokenizer, "eos_ids", ()) or ())
        self.eos_ids = eos
        self.pad_id = eos[0] if eos else 0
        self._embed_on: dict[str, tf.Variable] = {}
        try:
            self.params = [self._create_params(seg, weights, reuse) for seg in self.segments]
        except tf.errors.OpError as e:
            self.params, self._embed_on = [], {}
            raise PlacementError(f"creating weights on the devices failed: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200]}") from e

    # ----- weights and caches ---------------------------------------------------------------

    def _create_params(self, seg: Segment, weights, reuse) -> dict:
        def var(name, value):
            with tf.device(seg.device):
                return tf.Variable(np.asarray(value, np.float32), trainable=False,
                                   name=name.replace(".", "_"))

        # The head multiplies by a (D, V) matrix: faster than by the transposed (V, D) table. A
        # tied model keeps one (D, V) embedding on the head's device, which the embed stage
        # there reads by columns.
        tied, head_device = self.config.tie_embeddings, self.assignment["head"]
        params = {}
        if (seg.has_embed and tied and seg.device == head_device) or (seg.has_head and tied):
            if seg.device not in self._embed_on:
                self._embed_on[seg.device] = var("embed_T", weights["embed"].T)
            if seg.has_embed:
                params["embed_DxV"] = self._embed_on[seg.device]
            if seg.has_head:
                params["out_DxV"] = self._embed_on[seg.device]
        elif seg.has_embed:
            params["embed_VxD"] = var("embed", weights["embed"])
        params["blocks"] = [
            reuse.get((i, seg.device)) or L.BlockParams(
                **{k: var(f"block.{i}.{k}", v) for k, v in L.fuse_block(weights, i).items()})
            for i in seg.blocks]
        if seg.has_head:
            params["final_norm"] = var("final_norm", weights["final_norm"])
            if not tied:
                params["out_DxV"] = var("lm_head", weights["lm_head"])
        return params

    def replace(self, assignment) -> "PlacedModel":
        """A new placement of the same model; blocks whose device is unchanged keep their
        variables (nothing moves for them), the others are created on their new device.

        Examples
        --------
        >>> moved = pm.replace({**pm.assignment, "block.1": "/device:CPU:1"})  # doctest: +SKIP
        >>> moved.moved_stages                                                 # doctest: +SKIP
        ['block.1']
        """
        resolved = resolve_assignment(assignment, stage_names(self.config))
        reuse = {(i, seg.device): block for seg, p in zip(self.segments, self.params)
                 for i, block in zip(seg.blocks, p["blocks"])}
        pm = PlacedModel(self.config, self._weights, self.tokenizer, resolved,
                         timeout=self.timeout, name=self.name, reuse=reuse)
        pm.xla_loop, pm.compile_timeout = self.xla_loop, self.compile_timeout
        pm.moved_stages = [s for s in resolved if resolved[s] != self.assignment.get(s)]
        return pm

    def _on_state_lost(self, reason: str) -> None:
        """Called by the cluster when a worker holding our variables restarted or died."""
        self._lost = f"this placed model lost its state on a worker ({reason}); place it again"

    @property
    def variables(self) -> list[tf.Variable]:
        """Every weight variable, in stage order."""
        out: dict[int, tf.Variable] = {}
        for p in self.params:
            for v in [p[k] for k in ("embed_VxD", "embed_DxV") if k in p] \
                    + [v for b in p["blocks"] for v in b] \
                    + [p[k] for k in ("final_norm", "out_DxV") if k in p]:
                out.setdefault(id(v), v)
        return list(out.values())

    def _program(self, B: int, S: int) -> _Program:
        key = (B, S)
        if key in self._programs:
            self._programs.move_to_end(key)
            return self._programs[key]
        while len(self._programs) >= _MAX_PROGRAMS:
            _, old = self._programs.popitem(last=False)
            for fn in old.outer.values():
                self._warm.pop(id(fn), None)
        cfg = self.config
        shape = [B, cfg.n_kv_heads, S, cfg.head_dim]
        caches, seg_fns = [], []
        for seg, params in zip(self.segments, self.params):
            with tf.device(seg.device):
                seg_caches = [(tf.Variable(tf.zeros(shape), trainable=False, name=f"k_cache_{i}"),
                               tf.Variable(tf.zeros(shape), trainable=False, name=f"v_cache_{i}"))
                              for i in seg.blocks]
            caches.append(seg_caches)
            seg_fns.append(_segment_functions(seg, params, seg_caches, cfg, self.eos_ids,
                                              self.pad_id))
        program = _Program(caches, seg_fns, {}, S)
        self._programs[key] = program
        return program

    def _outer(self, program: _Program, P: int | None, mode: str):
        key = (P, mode)
        if key not in program.outer:
            program.outer[key] = _outer_function(self.segments, program.seg_fns, P, mode,
                                                  program.max_len, self.xla_loop)
        return program.outer[key]

    def _call(self, fn, args, what="generate"):
        if self._lost:
            raise WorkerLostError(self._lost)
        with self._call_lock:
            # A function's first call traces and XLA-compiles it (up to a minute for a real
            # model on a busy machine), so it gets the longer compile_timeout.
            first = id(fn) not in self._warm
            timeout = self.timeout
            if first and timeout is not None and self.compile_timeout is not None:
                timeout = max(timeout, self.compile_timeout)
            try:
                # The results are fetched inside the deadline too: a remote call returns its
                # handles at once, and it is reading them that waits for a stopped worker.
                out = call_with_deadline(_fetched(fn), args, timeout=timeout, devices=self.devices,
                                         what=what + (" (compiling)" if first else ""))
                self._warm[id(fn)] = fn
                return out
            except WorkerLostError as e:
                self._lost = (f"this placed model lost a worker earlier ({e}); place it again "
                              "after reconnecting")
                raise

    # ----- public API ---------------------------------------------------------------------

    def generate(self, prompts, max_new_tokens: int = 32, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed=None,
                 stop=None, *, stream: bool = False, chunk_tokens: int | None = None,
                 on_chunk=None):
        """Continue each prompt; a str for a str prompt, a list of str for a list.

        Parameters
        ----------
        prompts : str or list of str
            Prompts of any lengths (batched with left padding; each row gives the same tokens as
            alone, up to float rounding).
        max_new_tokens : int
            Tokens to generate per row (fewer if a row ends with an EOS token or a stop string).
        do_sample, temperature, top_k, top_p, seed
            Greedy by default; with ``do_sample=True`` sample in-graph, reproducibly per ``seed``
            (the same tokens whatever ``chunk_tokens``).
        stop : str or list of str
            The text is cut before the first stop string; checked on the client between chunks.
        stream : bool
            Return an iterator of new text per chunk (a str, or a list per row) instead.
        chunk_tokens : int
            Tokens per graph call (default: all at once, or 16 with ``stream``/``stop``/
            ``on_chunk``).
        on_chunk : callable
            Called after each chunk with a ``ChunkEvent`` (token count, tokens/s, new text).

        Examples
        --------
        >>> pm.generate("The capital of France is", max_new_tokens=8)  # doctest: +SKIP
        >>> for piece in pm.generate("Once", stream=True, chunk_tokens=4):  # doctest: +SKIP
        ...     print(piece, end="")
        """
        session = self._session(prompts, max_new_tokens, do_sample, temperature, top_k, top_p,
                                seed, stop, stream, chunk_tokens, on_chunk, text=True)
        return session.iter_text() if stream else session.run_text()

    def generate_ids(self, prompts, max_new_tokens: int = 32, do_sample: bool = False,
                     temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed=None,
                     stop=None, *, stream: bool = False, chunk_tokens: int | None = None,
                     on_chunk=None):
        """Like ``generate`` but returns new token ids (a list, or a list per row).

        ``prompts`` may also be token ids: a list of int, or a list of such lists. The ids end
        with the EOS token when a row stopped on one.

        Examples
        --------
        >>> pm.generate_ids([1, 40, 41], max_new_tokens=3)  # doctest: +SKIP
        [57, 12, 80]
        """
        session = self._session(prompts, max_new_tokens, do_sample, temperature, top_k, top_p,
                                seed, stop, stream, chunk_tokens, on_chunk, text=False)
        return session.iter_ids() if stream else session.run_ids()

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
        from tfnb.runtime.requests import make_batch, prompt_ids

        rows, single = prompt_ids(prompts, self.tokenizer, self.config.vocab_size)
        batch = make_batch(rows, 1, self.config.max_context, self.pad_id)
        program = self._program(len(batch.pad_B), batch.max_len)
        key = (batch.ids_BxP.shape[1], "logits")
        if key not in program.outer:
            program.outer[key] = _logits_function(self.segments, program.seg_fns)
        out = self._call(program.outer[key], (batch.ids_BxP, batch.pad_B), what="logits")
        per_row = [out[b, batch.pad_B[b]:] for b in range(batch.n_real)]
        return per_row[0] if single else per_row

    def _session(self, prompts, max_new_tokens, do_sample, temperature, top_k, top_p, seed,
                 stop, stream, chunk_tokens, on_chunk, text):
        if self._lost:
            raise WorkerLostError(self._lost)
        return GenerateSession(self, prompts, max_new_tokens, do_sample, temperature, top_k,
                               top_p, seed, stop, stream, chunk_tokens, on_chunk, text)

    def __repr__(self) -> str:
        segs = ", ".join(f"{s.stages[0]}..{s.stages[-1]}@{s.device}" if len(s.stages) > 1
                         else f"{s.stages[0]}@{s.device}" for s in self.segments)
        return f"PlacedModel({self.name or 'llama'}: {segs})"


# ----- compiled functions -------------------------------------------------------------------

def _embed(ids_BxT, params):
    if "embed_VxD" in params:
        return L.embed(ids_BxT, params["embed_VxD"])
    return L.embed_from_columns(ids_BxT, params["embed_DxV"])


def _fetched(fn):
    """``fn`` whose tensor results are copied to the client as numpy arrays."""
    def call(*args):
        return tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, fn(*args))
    return call


def _segment_functions(seg: Segment, params: dict, caches, cfg, eos_ids, pad_id):
    """The XLA-compiled (prefill, decode) functions of one segment over its caches.

    Arguments are packed to keep the tensors crossing devices per step few: ``ctl`` is int32
    ``[slot, pad_0 .. pad_{B-1}]`` (a decode step of the embedding's segment gets the tokens
    appended instead of ``x``); only the head's segment gets ``head_in = (done_B,
    [temperature, top_p], [top_k, seed])`` and returns ``(next_token_B, done_B)``.
    """
    eos_E = tf.constant(list(eos_ids) or [-1], tf.int32)

    def head(h_BxD, slot, mode, head_in):
        done_B, floats_2, ints_2 = head_in
        logits_BxV = L.logits(h_BxD, params["final_norm"], params["out_DxV"], cfg)
        seed_2 = tf.stack([ints_2[1], slot])
        tok_B = L.next_token(logits_BxV, mode, floats_2[0], ints_2[0], floats_2[1], seed_2)
        tok_B = tf.where(done_B, tf.constant(pad_id, tf.int32), tok_B)
        done_B = done_B | tf.reduce_any(tok_B[:, None] == eos_E[None, :], axis=-1)
        return tok_B, done_B

    def prefill(x, ctl, mode, head_in, want_logits=False):
        pad_B = ctl[1:]
        h_BxTxD = _embed(x, params) if seg.has_embed else x
        for p, (ck, cv) in zip(params["blocks"], caches):
            h_BxTxD, k, v = L.block_prefill(h_BxTxD, p, ck, cv, pad_B, cfg)
            ck.assign(k)
            cv.assign(v)
        if not seg.has_head:
            return h_BxTxD
        if want_logits:
            return L.logits(h_BxTxD, params["final_norm"], params["out_DxV"], cfg)
        T = h_BxTxD.shape[1]
        return head(h_BxTxD[:, -1], tf.constant(T, tf.int32), mode, head_in)

    def decode(x, ctl, mode, head_in):
        if seg.has_embed:  # x is None: ctl also carries the tokens, [slot, pad.., token..]
            B = (ctl.shape[0] - 1) // 2
            slot, pad_B = ctl[0], ctl[1:1 + B]
            h_Bx1xD = _embed(ctl[1 + B:, None], params)
        else:
            slot, pad_B, h_Bx1xD = ctl[0], ctl[1:], x
        for p, (ck, cv) in zip(params["blocks"], caches):
            h_Bx1xD, k, v = L.block_decode(h_Bx1xD, p, ck, cv, pad_B, slot, cfg)
            ck.assign(k)
            cv.assign(v)
        if not seg.has_head:
            return h_Bx1xD
        return head(h_Bx1xD[:, 0], slot + 1, mode, head_in)

    return (tf.function(prefill, jit_compile=True, reduce_retracing=False),
            tf.function(decode, jit_compile=True, reduce_retracing=False))


def _outer_function(segments, seg_fns, P: int | None, mode: str, S: int, fused: bool):
    """One multi-device graph: (prefill if ``P``), then up to ``n_steps`` decode steps.

    With a single segment the whole function, loop included, is one XLA computation (as HF's
    XLA generate); otherwise a ``tf.while_loop`` calls each segment's XLA function on its device.
    """
    fused = fused and len(segments) == 1
    # The loop and its state live on the head's device (the last segment): per step, only
    # the packed tokens go to the first segment and activations along the chain; the client
    # is not involved until the chunk ends.
    loop_device = segments[-1].device

    def run_segments(x, which, pad_B, slot, done_B, floats_2, ints_2):
        ctl = tf.concat([slot[None], pad_B], axis=0)
        for seg, fns in zip(segments, seg_fns):
            # only the head depends on the sampling mode: the others compile once for all
            head_in, seg_mode = ((done_B, floats_2, ints_2), mode) if seg.has_head else (None, None)
            seg_x, seg_ctl = x, ctl
            if which == "decode" and seg.has_embed:
                seg_x, seg_ctl = None, tf.concat([ctl, x], axis=0)
            with tf.device(seg.device):
                x = fns[0 if which == "prefill" else 1](seg_x, seg_ctl, seg_mode, head_in)
        return x

    def run(x, pad_B, slot, done_B, n_steps, temperature, top_k, top_p, seed):
      with tf.device(loop_device):
        floats_2, ints_2 = tf.stack([temperature, top_p]), tf.stack([top_k, seed])
        pad_B, n_steps, done_B, slot = (tf.identity(t) for t in (pad_B, n_steps, done_B, slot))
        B = pad_B.shape[0]
        # new tokens, one row per step: a fixed buffer inside XLA, else a TensorArray
        tokens = (tf.zeros([S, B], tf.int32) if fused else
                  tf.TensorArray(tf.int32, size=n_steps, element_shape=pad_B.shape))

        def write(tokens, i, tok_B):
            if fused:
                return xla.dynamic_update_slice(tokens, tok_B[None], tf.stack([i, 0]))
            return tokens.write(i, tok_B)

        i = tf.constant(0)
        if P is not None:  # x: prompt ids (B, P); the first token comes from prefill
            tok_B, done_B = run_segments(x, "prefill", pad_B, slot, done_B, floats_2, ints_2)
            tokens = write(tokens, i, tok_B)
            i, slot = i + 1, tf.constant(P, tf.int32)
        else:              # x: the last token (B,), to be written at ``slot``
            tok_B = tf.identity(x)

        def cond(i, slot, tok_B, done_B, tokens):
            with tf.device(loop_device):
                return (i < n_steps) & tf.logical_not(tf.reduce_all(done_B))

        def body(i, slot, tok_B, done_B, tokens):
            with tf.device(loop_device):
                tok_B, done_B = run_segments(tok_B, "decode", pad_B, slot, done_B, floats_2,
                                             ints_2)
                return i + 1, slot + 1, tok_B, done_B, write(tokens, i, tok_B)

        i, slot, tok_B, done_B, tokens = tf.while_loop(
            cond, body, (i, slot, tok_B, done_B, tokens),
            maximum_iterations=S if fused else None)
        return (tokens if fused else tokens.stack()), i, slot, tok_B, done_B

    if fused:
        compiled = tf.function(run, jit_compile=True)

        @tf.function
        def graph(*args):  # TF cannot run a compiled function eagerly on a remote device
            with tf.device(loop_device):
                return compiled(*args)
    else:
        graph = tf.function(run)
    return _OnDevice(graph, loop_device)


class _OnDevice:
    """Calls a graph function with ``loop_device`` as its default device, so the function (and
    its loop) runs on that worker: called from the client's default device instead, each loop
    iteration costs a client round trip (about 2 ms between local processes)."""

    def __init__(self, fn, device: str):
        self.fn, self.device = fn, device

    def __call__(self, *args):
        with tf.device(self.device):
            return self.fn(*args)

    def experimental_get_tracing_count(self) -> int:
        return self.fn.experimental_get_tracing_count()


def _logits_function(segments, seg_fns):
    @tf.function
    def run(ids_BxP, pad_B):
        x = ids_BxP
        ctl = tf.concat([[0], pad_B], axis=0)
        head_in = (tf.zeros(pad_B.shape, tf.bool), tf.constant([1.0, 1.0]), tf.constant([0, 0]))
        for seg, fns in zip(segments, seg_fns):
            with tf.device(seg.device):
                x = fns[0](x, ctl, "greedy" if seg.has_head else None,
                           head_in if seg.has_head else None, want_logits=True)
        return x
    return _OnDevice(run, segments[-1].device)
