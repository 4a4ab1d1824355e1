"""The compiled-segment protocol: what runs on each device, and the graphs that chain them.

A *segment* (:class:`tfnb.models.chain.Segment`, the type plans show too) is a run of
consecutive stages on one device. Each segment has two XLA-compiled
functions over its weights and KV caches (:class:`SegmentFns`): ``prefill(x, ctl, mode,
head_in)`` and ``decode(x, ctl, mode, head_in, window=None)``. Their arguments are packed to keep
the tensors crossing devices per step few:

- a decode's ``ctl`` (int32) is ``[slot, pad_0 .. pad_{B-1}]`` (:func:`pack_ctl`); the decode
  step of the embedding's segment gets the tokens appended, ``[slot, pad.., token..]``, instead
  of ``x``. A prefill's is ``[first_slot, pad.., first_row]`` (:func:`pack_prefill_ctl`): a
  prompt may join cache rows that are already decoding (continuous batching,
  :mod:`tfnb.runtime.scheduler`);
- only the head's segment gets ``head_in`` (:class:`HeadIn`) and a sampling ``mode``, and returns
  ``(next_token_B, done_B)``; the others return the hidden state.

:func:`run_segments` is the one entry that calls every segment in order under its device; the
prefill and decode graphs (:func:`prefill_function`, :func:`decode_function`), the logits graph
(:func:`logits_function`) and the calibration loops (:mod:`tfnb.runtime.calibrate`) all go
through it or through :func:`segment_functions`. A :class:`Program` holds the functions bound
to one set of caches.

Examples
--------
>>> pack_ctl(3, tf.constant([0, 2])).numpy().tolist()
[3, 0, 2]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from collections import OrderedDict
from typing import NamedTuple

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla
from tensorflow.python.eager import context

from tfnb.cluster.connect import generation
from tfnb.models.chain import Segment, block_stage
from tfnb.runtime import forward as L
from tfnb.runtime import wire

__all__ = ["HeadIn", "SegmentFns", "pack_ctl", "pack_prefill_ctl", "with_tokens", "unpack_ctl",
           "segment_functions", "shared_segment_functions", "shared_entry", "weights_arg",
           "segment_traces", "program_traces", "run_segments", "prefill_function",
           "decode_function", "unrolled_decode", "shift_function", "logits_function", "OnDevice",
           "Program", "client_cpu"]


class _QuietRetracing(logging.Filter):
    """Drop TF's "frequent retracing" warning for our functions: each bucket's functions (and
    each calibration loop) are separate tf.function objects traced once, which TF's detector
    mistakes for retracing."""

    OURS = ("prefill_function", "decode_function", "unrolled_decode", "shift_function",
            "segment_functions", "logits_function", "timed_loop", "Packed")

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("triggered tf.function retracing" in msg
                    and any(name in msg for name in self.OURS))


tf.get_logger().addFilter(_QuietRetracing())


class HeadIn(NamedTuple):
    """What the head's segment needs besides the hidden state, per row."""
    done_B: tf.Tensor     # bool: rows already finished (they emit padding)
    floats_Bx2: tf.Tensor  # [temperature (0: greedy), top_p]
    ints_Bx2: tf.Tensor    # [top_k, seed]

    @classmethod
    def greedy(cls, B: int) -> HeadIn:
        return cls(tf.zeros([B], tf.bool), tf.tile([[0.0, 1.0]], [B, 1]),
                   tf.zeros([B, 2], tf.int32))


class SegmentFns(NamedTuple):
    """A segment's XLA-compiled functions (see the module docstring for their arguments)."""
    prefill: object
    decode: object


def pack_ctl(slot, pad_B, tok_B=None):
    """``[slot, pad_0 .. pad_{B-1}]`` (int32), with ``tok_B`` appended when given."""
    ctl = tf.concat([tf.convert_to_tensor(slot, tf.int32)[None], pad_B], axis=0)
    return ctl if tok_B is None else with_tokens(ctl, tok_B)


def pack_prefill_ctl(first_slot, first_row, pad_B):
    """A prefill's ``[first_slot, pad_0 .. pad_{B-1}, first_row]``: where in the caches the
    prompt's keys go (``pad_B`` counts each prompt's own left padding)."""
    return tf.concat([pack_ctl(first_slot, pad_B),
                      tf.convert_to_tensor(first_row, tf.int32)[None]], axis=0)


def with_tokens(ctl, tok_B):
    """``ctl`` with the tokens appended, for the decode step of the embedding's segment."""
    return tf.concat([ctl, tok_B], axis=0)


def unpack_ctl(ctl, with_tokens: bool):
    """``(slot, pad_B, tok_B or None)`` from :func:`pack_ctl`'s encoding (static length)."""
    if not with_tokens:
        return ctl[0], ctl[1:], None
    B = (ctl.shape[0] - 1) // 2
    return ctl[0], ctl[1:1 + B], ctl[1 + B:]


def _embed(ids_BxT, params, cfg):
    """Token embeddings, times ``cfg.embed_scale`` when it is not 1 (Gemma: sqrt(D))."""
    if "embed_VxD" in params:
        x_BxTxD = L.embed(ids_BxT, params["embed_VxD"])
    else:
        x_BxTxD = L.embed_from_columns(ids_BxT, params["embed_DxV"])
    return x_BxTxD if cfg.embed_scale == 1.0 else x_BxTxD * cfg.embed_scale


# Traced functions shared by every placement of the same stages of the same model (on one
# device, wherever it is; a chain over several devices, on the same devices): segment functions
# and the chunk graphs over them (:class:`Program`) take the weights and caches as an argument,
# so a copy placed anew (a healed copy, a replacement, another replica, a lane's caches for
# another batch size) reuses the traces of the copy before it, and its workers the programs XLA
# compiled for them. TF keys a trace by the variables' shapes and dtypes, not by which variables
# they are, and never gives a trace's memory back (docs/runtime.md, "Compiled segments and
# chunks"). The table holds one cluster connection's traces: another cluster's workers (the same
# device names) lack the functions they call. The LRU bound keeps calibrations of many models
# from piling up.
_SHARED_LIMIT = 256
_shared_generation = None  # tfnb.cluster.connect.generation() of the table's traces
_shared: OrderedDict = OrderedDict()  # key -> SegmentFns (over weights) or OnDevice (of a Program)
_shared_lock = threading.Lock()
_segment_traces = 0  # segment graphs traced (a Python side effect of the traced functions runs
                     # at trace time only)


def shared_entry(key, make):
    """The table's entry for ``key``, made by ``make()`` (cheap: nothing is traced yet) if new:
    any traced function the workers of the current cluster run (``key`` names what it is)."""
    global _shared_generation
    with _shared_lock:
        if _shared_generation != generation():
            _shared.clear()
            _shared_generation = generation()
        entry = _shared.get(key)
        if entry is None:
            entry = _shared[key] = make()
            while len(_shared) > _SHARED_LIMIT:
                _shared.popitem(last=False)
        _shared.move_to_end(key)
    return entry


def shared_segment_functions(seg: Segment, cfg, eos_ids, pad_id) -> SegmentFns:
    """The (prefill, decode) functions of one segment, taking ``weights=(params, caches)``:
    one pair per (stages, config, eos, pad) in this process (see ``_shared``). Their graphs
    name no device: they run on the device they are called under."""
    eos_ids, seg = tuple(eos_ids), dataclasses.replace(seg, device="")
    return shared_entry(("segment", seg, cfg, eos_ids, pad_id),
                         lambda: _segment_functions(seg, cfg, eos_ids, pad_id))


def weights_arg(params: dict, caches) -> tuple:
    """The ``weights`` argument of a segment's functions: ``(params, ((k, v), ...))``."""
    return params, tuple(tuple(pair) for pair in caches)


def segment_functions(seg: Segment, params: dict, caches, cfg, eos_ids, pad_id) -> SegmentFns:
    """The XLA-compiled (prefill, decode) functions of one segment over its caches.

    ``params`` holds the segment's weights (``tfnb.runtime.weights.segment_params``), ``caches``
    one ``(k, v)`` variable pair per block of the segment. The functions are bound to them;
    the traces behind them are shared (:func:`shared_segment_functions`).
    """
    shared = shared_segment_functions(seg, cfg, eos_ids, pad_id)
    weights = weights_arg(params, caches)
    return SegmentFns(functools.partial(shared.prefill, weights=weights),
                      functools.partial(shared.decode, weights=weights))


def segment_traces() -> int:
    """How many times this process has traced a segment's graph: placing a model again, on
    any worker, at shapes it ran, adds none."""
    with _shared_lock:
        return _segment_traces


def program_traces() -> int:
    """How many times this process has traced the chunk graphs (:class:`Program`'s) it holds:
    a copy placed again, on its worker or on another one's, adds none."""
    with _shared_lock:
        graphs = [g for key, g in _shared.items() if key[0] == "program"]
    return sum(g.experimental_get_tracing_count() for g in graphs)


def _segment_functions(seg: Segment, cfg, eos_ids: tuple, pad_id) -> SegmentFns:
    """:func:`segment_functions`' traced functions, taking ``weights=(params, caches)``."""

    def head(h_BxD, pos_B, mode, head_in: HeadIn, params):
        done_B, floats_Bx2, ints_Bx2 = head_in
        if L.SKIP_UNREAD_ROWS and L.is_packed(params["out_DxV"]):
            # a done row's token is dropped: its zero row costs the packed matmul nothing
            h_BxD = tf.where(done_B[:, None], tf.zeros_like(h_BxD), h_BxD)
        logits_BxV = L.logits(h_BxD, params["final_norm"], params["out_DxV"], cfg)
        seeds_Bx2 = tf.stack([ints_Bx2[:, 1], pos_B], axis=1)  # the token's position
        tok_B = L.next_token(logits_BxV, mode, floats_Bx2[:, 0], ints_Bx2[:, 0],
                             floats_Bx2[:, 1], seeds_Bx2)
        tok_B = tf.where(done_B, tf.constant(pad_id, tf.int32), tok_B)
        eos_E = tf.constant(list(eos_ids) or [-1], tf.int32)
        done_B = done_B | tf.reduce_any(tok_B[:, None] == eos_E[None, :], axis=-1)
        return tok_B, done_B

    # Each stage's math runs under its stage's name scope (embed, block.i, head): XLA keeps the
    # scopes in its ops' metadata, which is how a profile attributes compiled time to stages.
    # each block's static Layer (its sliding window and rotary base); the rotary tables are made
    # once per call for each distinct base among them
    layers = [L.layer_of(cfg, i) for i in seg.blocks]

    def blocks_of(weights):
        global _segment_traces
        with _shared_lock:
            _segment_traces += 1
        params, caches = weights
        return params, [(block_stage(i), p, ck, cv, layer) for i, p, (ck, cv), layer
                        in zip(seg.blocks, params["blocks"], caches, layers)]

    def rope_of(ropes, layer):
        return ropes[(layer.theta, layer.scale)]

    def prefill(x, ctl, mode, head_in, weights, want_logits=False):
        params, blocks = blocks_of(weights)
        first_slot, pad_B, first_row = ctl[0], ctl[1:-1], ctl[-1]  # pack_prefill_ctl
        if seg.has_embed:
            with tf.name_scope("embed"):
                x = _embed(x, params, cfg)
        h_BxTxD = x
        ropes = L.ropes_for(pad_B, 0, x.shape[1], cfg, layers)
        for stage, p, ck, cv, layer in blocks:
            with tf.name_scope(stage):
                h_BxTxD = L.block_prefill(h_BxTxD, p, ck, cv, pad_B, cfg, first_slot, first_row,
                                          rope_of(ropes, layer), layer)
        if not seg.has_head:
            return h_BxTxD
        with tf.name_scope("head"):
            if want_logits:
                return L.logits(h_BxTxD, params["final_norm"], params["out_DxV"], cfg)
            T = h_BxTxD.shape[1]
            return head(h_BxTxD[:, -1], T - pad_B, mode, HeadIn(*head_in), params)

    def decode(x, ctl, mode, head_in, weights, window=None):
        params, blocks = blocks_of(weights)
        slot, pad_B, tok_B = unpack_ctl(ctl, with_tokens=seg.has_embed)
        if seg.has_embed:
            with tf.name_scope("embed"):
                x = _embed(tok_B[:, None], params, cfg)
        h_Bx1xD = x
        ropes = L.ropes_for(pad_B, slot, 1, cfg, layers)
        for stage, p, ck, cv, layer in blocks:
            with tf.name_scope(stage):
                h_Bx1xD = L.block_decode(h_Bx1xD, p, ck, cv, pad_B, slot, cfg, window,
                                         rope_of(ropes, layer), layer)
        if not seg.has_head:
            return h_Bx1xD
        with tf.name_scope("head"):
            return head(h_Bx1xD[:, 0], slot + 1 - pad_B, mode, HeadIn(*head_in), params)

    return SegmentFns(tf.function(prefill, jit_compile=True, reduce_retracing=False),
                      tf.function(decode, jit_compile=True, reduce_retracing=False))


def run_segments(segs, fns, which: str, x, ctl, head_in: HeadIn, mode: str, weights,
                 want_logits: bool = False, window: int | None = None):
    """Every segment in order, each under its device: ``which`` is "prefill" or "decode".

    ``fns`` are :func:`shared_segment_functions`, ``weights`` one :func:`weights_arg` per
    segment. ``x`` is the prompt ids (B, P) for prefill and the last tokens (B,) for decode,
    ``ctl`` :func:`pack_prefill_ctl`'s or :func:`pack_ctl`'s encoding (made once, on the
    caller's device; each segment receives it); returns the head's ``(next_token_B, done_B)``
    (or the logits with ``want_logits``).
    """
    for seg, seg_fns, seg_weights in zip(segs, fns, weights):
        # only the head depends on the sampling mode: the others compile once for all
        seg_head_in, seg_mode = (tuple(head_in), mode) if seg.has_head else (None, None)
        seg_x, seg_ctl = x, ctl
        if which == "decode" and seg.has_embed:
            seg_x, seg_ctl = None, with_tokens(ctl, x)
        with _on(seg.device):
            if which == "prefill":
                x = seg_fns.prefill(seg_x, seg_ctl, seg_mode, seg_head_in, weights=seg_weights,
                                    **({"want_logits": True} if want_logits else {}))
            else:
                x = seg_fns.decode(seg_x, seg_ctl, seg_mode, seg_head_in, weights=seg_weights,
                                   **({"window": window} if window else {}))
    return x


def prefill_function(segs, fns, mode: str) -> OnDevice:
    """``f(ids_BxP, pad_B, first_slot, first_row, done_B, floats_Bx2, ints_Bx2)``: the prompts'
    keys into cache rows ``[first_row, first_row + B)`` at slots ``[first_slot, first_slot +
    P)``; returns the first new token per row and ``done_B``. Like every graph here it takes
    the segments' weights as a last argument (:meth:`OnDevice.bind`)."""
    @tf.function
    def run(ids_BxP, pad_B, first_slot, first_row, done_B, floats_Bx2, ints_Bx2, weights):
        return run_segments(segs, fns, "prefill", ids_BxP,
                            pack_prefill_ctl(first_slot, first_row, pad_B),
                            HeadIn(done_B, floats_Bx2, ints_Bx2), mode, weights)
    return OnDevice(run, segs[-1].device)


def _decode_step(segs, fns, mode, window, tok_B, slot, pad_B, done_B, floats_Bx2, ints_Bx2,
                 weights):
    """One decode step through every segment: the next tokens and ``done_B``."""
    return run_segments(segs, fns, "decode", tok_B, pack_ctl(slot, pad_B),
                        HeadIn(done_B, floats_Bx2, ints_Bx2), mode, weights, window=window)


def decode_function(segs, fns, mode: str, S: int, window: int | None,
                    fused: bool) -> OnDevice:
    """One multi-device graph of up to ``n_steps`` decode steps for the caches' first ``B``
    rows, attention reading the first ``window`` slots.

    Called as ``f(tok_B, pad_B, slot, done_B, n_steps, floats_Bx2, ints_Bx2)`` (``tok_B`` the
    last tokens, to be written at ``slot``); returns ``(tokens_NxB, steps, slot, last_tok_B,
    done_B)``. With a single segment and ``fused`` the whole loop is one XLA computation (as
    HF's XLA generate); otherwise a ``tf.while_loop`` calls each segment's XLA function on its
    device. A chain over several workers runs :func:`unrolled_decode` instead.
    """
    fused = fused and len(segs) == 1
    # The loop and its state live on the head's device (the last segment): per step, only
    # the packed tokens go to the first segment and activations along the chain; the client
    # is not involved until the chunk ends.
    loop_device = segs[-1].device

    def decode_loop(tok_B, pad_B, slot, done_B, n_steps, floats_Bx2, ints_Bx2, weights):
      with _on(loop_device):
        pad_B, n_steps, done_B, slot, tok_B = (tf.identity(t) for t in
                                               (pad_B, n_steps, done_B, slot, tok_B))
        B = pad_B.shape[0]
        # new tokens, one row per step: a fixed buffer inside XLA, else a TensorArray
        tokens = (tf.zeros([S, B], tf.int32) if fused else
                  tf.TensorArray(tf.int32, size=n_steps, element_shape=pad_B.shape))

        def cond(i, slot, tok_B, done_B, tokens):
            with _on(loop_device):
                return (i < n_steps) & tf.logical_not(tf.reduce_all(done_B))

        def body(i, slot, tok_B, done_B, tokens):
            with _on(loop_device):
                tok_B, done_B = _decode_step(segs, fns, mode, window, tok_B, slot, pad_B,
                                             done_B, floats_Bx2, ints_Bx2, weights)
                tokens = (xla.dynamic_update_slice(tokens, tok_B[None], tf.stack([i, 0]))
                          if fused else tokens.write(i, tok_B))
                return i + 1, slot + 1, tok_B, done_B, tokens

        i, slot, tok_B, done_B, tokens = tf.while_loop(
            cond, body, (tf.constant(0), slot, tok_B, done_B, tokens),
            maximum_iterations=S if fused else None)
        return (tokens if fused else tokens.stack()), i, slot, tok_B, done_B

    if fused:
        compiled = tf.function(decode_loop, jit_compile=True)

        @tf.function
        def graph(*args):  # TF cannot run a compiled function eagerly on a remote device
            with _on(loop_device):
                return compiled(*args)
    else:
        graph = tf.function(decode_loop)
    return OnDevice(graph, loop_device)


def unrolled_decode(segs, fns, mode: str, window: int | None, steps: int) -> OnDevice:
    """:func:`decode_function`'s graph as ``steps`` decode steps in a row, with no loop.

    A ``tf.while_loop`` over segments on several workers pays the loop's own control between
    them every step: the head's worker computes the condition and sends it to every other
    worker, which only then starts the step and asks for its inputs, so each hop is a
    condition and a tensor in turn. Unrolled, every receive of the chunk is posted when the
    graph starts, and a step's tensors flow on as soon as they are made (faster per step:
    docs/runtime.md). The price:
    rows that all finish early still run the chunk out (they emit padding), so the scheduler
    keeps chunks to powers of two and no longer than ``CHUNK_STEPS``.
    """
    loop_device = segs[-1].device

    def run(tok_B, pad_B, slot, done_B, n_steps, floats_Bx2, ints_Bx2, weights):
        with tf.device(loop_device):
            tokens, at = [], slot
            for _ in range(steps):
                tok_B, done_B = _decode_step(segs, fns, mode, window, tok_B, at, pad_B,
                                             done_B, floats_Bx2, ints_Bx2, weights)
                tokens.append(tok_B)
                at = at + 1
            return tf.stack(tokens), tf.constant(steps), at, tok_B, done_B

    return OnDevice(tf.function(run), loop_device)


def shift_function(segs) -> OnDevice:
    """``f(delta)``: every cache's slots rolled by ``delta`` (int32; negative moves them to
    the front). Slots that wrap around end up outside every row's attended range."""
    @tf.function
    def run(delta, weights):
        for seg, (_, seg_caches) in zip(segs, weights):
            with _on(seg.device):
                for ck, cv in seg_caches:
                    ck.assign(tf.roll(ck, delta, axis=2))
                    cv.assign(tf.roll(cv, delta, axis=2))
        return delta
    return OnDevice(run, segs[-1].device)


def logits_function(segs, fns) -> OnDevice:
    """``f(ids_BxP, pad_B)``: the logits (B, P, V) of every position, by prefill."""
    @tf.function
    def run(ids_BxP, pad_B, weights):
        return run_segments(segs, fns, "prefill", ids_BxP, pack_prefill_ctl(0, 0, pad_B),
                            HeadIn.greedy(pad_B.shape[0]), "greedy", weights, want_logits=True)
    return OnDevice(run, segs[-1].device)


def _on(device: str):
    """``tf.device(device)``, or no scope for a graph traced without devices (see
    :class:`Program`): its ops run on the device its call is made under."""
    return tf.device(device) if device else contextlib.nullcontext()


def client_cpu() -> str:
    """This process's own CPU device (``/job:<client job>/replica:0/task:0/device:CPU:0``)."""
    return context.context().host_address_space() + "/device:CPU:0"


class OnDevice:
    """Calls a graph function with ``device`` as its default device, so the function (and its
    loop) runs on that worker: called from the client's default device instead, each loop
    iteration costs a client round trip (about 2 ms between local processes).

    Plain arguments (numpy values and Python numbers) travel as one tensor and the results
    come back as one, as numpy values (:mod:`tfnb.runtime.wire`): each tensor copied to or
    from a worker is a round trip of its own. Calls with tensor arguments go as they are.

    The arguments become tensors on the client's own CPU first. Converting a Python or numpy
    value under a remote device scope blocks in C++ while holding the GIL until the worker
    answers (TF 2.21: with the worker stopped the whole process freezes, while the same call
    with client-side tensors waits with the GIL free, so deadlines can fire).

    A graph that takes its weights as a last argument is called through :meth:`bind`, which
    supplies them: its traces are shared by every binding.
    """

    def __init__(self, fn, device: str):
        self.fn, self.device = fn, device
        self._packed: dict = {}  # argument signature -> wire.Packed
        self.weights = None      # what bind() supplies as the last argument
        self._flat: dict = {}    # Packed -> self.weights as its graph's inputs

    def bind(self, weights, device: str | None = None) -> OnDevice:
        """This function with ``weights`` as its last argument, run on ``device`` (default:
        its own); it shares the traces."""
        bound = OnDevice(self.fn, device or self.device)
        bound._packed, bound.weights = self._packed, weights
        return bound

    def _wired(self, args):
        """The packed call for ``args`` and their bytes as a client tensor, or None."""
        sig = wire.signature(args)
        if sig is None:
            return None
        call = self._packed.get(sig)
        if call is None:
            call = self._packed.setdefault(sig, wire.Packed(self.fn, sig,
                                                            weighted=self.weights is not None))
        with tf.device(client_cpu()):
            return call, tf.constant(wire.pack(args))

    def __call__(self, *args):
        wired = self._wired(args)
        if wired is not None:
            call, blob = wired
            with tf.device(self.device):
                if self.weights is None:
                    out = call.run(blob)
                else:
                    flat = self._flat.get(call)
                    if flat is None:
                        flat = self._flat[call] = call.weight_inputs(blob, self.weights)
                    out = call.run(blob, flat)
            return call.unpack(out.numpy())
        with tf.device(client_cpu()):
            args = [a if isinstance(a, tf.Tensor) or a is None else tf.constant(a) for a in args]
        with tf.device(self.device):
            return self.fn(*args, *(() if self.weights is None else (self.weights,)))

    def trace(self, *args) -> None:
        """Trace the graph a call with ``args`` runs (which sends it to the workers), without
        running it."""
        wired = self._wired(args)
        weights = () if self.weights is None else (self.weights,)
        with tf.device(self.device):
            if wired is None:
                self.fn.get_concrete_function(*args, *weights)
            else:
                wired[0].concrete(wired[1], *weights)

    def experimental_get_tracing_count(self) -> int:
        """Traces so far, of the packed calls and of calls as they are (of every binding)."""
        return self.fn.experimental_get_tracing_count() + sum(
            call.fn.experimental_get_tracing_count() for call in list(self._packed.values()))


def _weights_spec(weights) -> tuple:
    """What a trace over ``weights`` depends on: each variable's dtype and shape, and the
    plain values (packed types, column counts, absent biases) among them."""
    return tuple((v.dtype.name, tuple(v.shape)) if isinstance(v, tf.Variable) else v
                 for v in tf.nest.flatten(weights))


class Program:
    """The compiled functions bound to one set of KV caches of shape (B, K, S, E).

    ``fns`` are the segments' :func:`shared_segment_functions`, ``params`` their weights and
    ``caches`` per segment one ``(k, v)`` variable pair per block. The graphs are made on first
    use per sampling mode (and attention window), each tracing once per batch shape; their
    traces are shared with every Program over the same stages and shapes (``_shared``), so a
    copy placed again, or a lane back at a size it had, traces nothing anew. The graphs of a
    Program on one device name no device (each call runs where it is made, see
    :class:`OnDevice`), so the replicas of a model on several workers share them as well; a
    chain over several devices names each segment's.
    """

    def __init__(self, segs, fns, params, caches, max_len: int, fused: bool):
        self.segments, self.fns, self.caches = list(segs), list(fns), caches
        self.max_len, self.fused = max_len, fused
        self.rows = caches[0][0][0].shape[0] if caches and caches[0] else None
        self.weights = tuple(weights_arg(p, c) for p, c in zip(params, caches))
        self.device = self.segments[-1].device  # where the graphs' calls are made
        # on one device the graphs are traced without it (see _on)
        self._segs = self.segments if self.unrolled else [
            dataclasses.replace(seg, device="") for seg in self.segments]
        # what the graphs close over (the shared segment functions are alive in the table while
        # a graph over them is) and the shapes they are traced for
        self._spec = (tuple(self._segs), tuple(map(id, self.fns)), _weights_spec(self.weights),
                      max_len, fused)
        self.graphs: dict = {}  # (kind, mode, window) -> OnDevice bound to self.weights

    def _graph(self, key, make):
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = shared_entry(("program", key, self._spec),
                                                     make).bind(self.weights, self.device)
        return graph

    def prefill_fn(self, mode: str) -> OnDevice:
        """:func:`prefill_function` over these caches, sampling in ``mode``."""
        segs, fns = self._segs, self.fns
        return self._graph(("prefill", mode), lambda: prefill_function(segs, fns, mode))

    @property
    def unrolled(self) -> bool:
        """Whether its decode graphs are unrolled (a chain over several devices): then each
        graph runs a fixed number of steps (:meth:`decode_fn`'s ``steps``)."""
        return len({seg.device for seg in self.segments}) > 1

    def decode_fn(self, mode: str, window: int | None = None,
                  steps: int | None = None) -> OnDevice:
        """:func:`decode_function` over these caches (``"greedy"``, ``"sample"`` or
        ``"filter"``), attention reading the first ``window`` slots (None: all); when
        :attr:`unrolled`, exactly ``steps`` steps per call."""
        segs, fns, S, fused = self._segs, self.fns, self.max_len, self.fused
        if self.unrolled:
            return self._graph(("decode", mode, window, steps), lambda: unrolled_decode(
                segs, fns, mode, window, steps))
        return self._graph(("decode", mode, window, None), lambda: decode_function(
            segs, fns, mode, S, window, fused))

    def shift_fn(self) -> OnDevice:
        """:func:`shift_function` over these caches."""
        segs = self._segs
        return self._graph(("shift",), lambda: shift_function(segs))

    def logits_fn(self, P: int) -> OnDevice:
        segs, fns = self._segs, self.fns
        return self._graph(("logits",), lambda: logits_function(segs, fns))
