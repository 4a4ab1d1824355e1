"""How long each stage of a llama model takes on a device, timed with the runtime's own code.

The planners need seconds per decode step of every stage on every device. FLOP counts mislead:
decoding one token reads every weight once for two FLOPs per weight, so memory bandwidth bounds
it, not FLOP/s. So ``time_stages`` runs the runtime's compiled decode functions
(:func:`tfnb.runtime.graphs.segment_functions`, XLA, as ``generate`` runs them) on the device:

- weights of the model's shapes and kinds with random values, made once on the client and
  copied to each device: float32, or for a packed model (``like``) the same ggml types, so the
  packed-weight kernel is what gets timed (float32 timings mispredict a packed model);
- the embedding, ``k`` consecutive blocks and the head as three segments. The ``k`` blocks hold
  at least ``stream_bytes``, more than a CPU's last-level cache: one block timed alone would
  stay in cache and run faster than in a real step;
- each segment called ``steps`` times in a ``tf.while_loop`` on the device. A step costs
  ``(t(1 + steps) - t(1)) / steps``, which removes the client's round trip; the three segments'
  calls alternate ``repeats`` times and the median of each counts. The median, not the best:
  the least disturbed of a few short calls is faster than a long generate call runs.

The caches have ``slots`` slots and each timed step attends ``attend`` of them (default all): a
packed model's attention reads only the slots up to a row's current one
(``tfnb/kernels/attention.cc``), so a loop counting up from slot 0 would time too little
attention. A float32 model's attention reads its whole window, here the whole cache.

With ``prompt=P`` the loops time each segment's prefill of ``batch`` prompts of ``P`` tokens
instead (seconds per call): what a request costs before its first token. ``pad`` of those tokens
are left padding, as the runtime pads a prompt to its bucket; a packed model skips their rows.

How well calibration predicts ``generate``: see docs/placement.md.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import tensorflow as tf

from tfnb.models.chain import Segment, llama_chain, stage_names
from tfnb.models.decoder import random_weights
from tfnb.models.packed import PackedTensor, packed_like
from tfnb.runtime.faults import call_with_deadline
from tfnb.runtime.graphs import HeadIn, client_cpu, pack_ctl, pack_prefill_ctl, segment_functions
from tfnb.runtime.weights import (
    compact_weight,
    kv_caches,
    packed_routes,
    segment_params,
    variable_on,
)

__all__ = ["time_stages", "stage_timer", "CALIBRATION_TIMEOUT_S"]

CALIBRATION_TIMEOUT_S = 600.0  # the longest a calibration may take (it compiles per device)


def _loops(small, weights, device: str, batch: int, slots: int, prompt: int = 0,
           pad: int = 0, attend: int | None = None, route: str = "kernel") -> dict:
    """``{kind: loop}`` for the embedding, ``small``'s blocks and the head, on ``device``
    (their decode steps, or with ``prompt`` their prefills of that many tokens), its packed
    matrices on ``route`` (``weights.packed_routes``)."""
    names = stage_names(small.n_layers)
    put = (lambda d, v, n: compact_weight(variable_on, d, v, n)) if route == "xla" else None
    whole = segment_params(small, weights, Segment(device, tuple(names)), head_device=device,
                           put=put)
    blocks = Segment(device, tuple(names[1:-1]))
    caches = kv_caches(blocks, [batch, small.n_kv_heads, slots, small.head_dim])
    eos = small.eos_ids or (0,)
    embeds = {key: v for key, v in whole.items() if key.startswith("embed_")}
    parts = {
        "embed": (Segment(device, ("embed",)), {"blocks": [], **embeds}, []),
        "block": (blocks, {"blocks": whole["blocks"]}, caches),
        "head": (Segment(device, ("head",)),
                 {"blocks": [], "final_norm": whole["final_norm"], "out_DxV": whole["out_DxV"]},
                 []),
    }
    out = {}
    for kind, (seg, p, c) in parts.items():
        fns = segment_functions(seg, p, c, small, eos, 0)
        out[kind] = timed_loop(fns.prefill if prompt else fns.decode, device, kind, small, batch,
                               prompt, pad, slots if attend is None else attend)
    return out


def _per_step(loops: dict, steps: int, repeats: int) -> dict:
    """Seconds per iteration of each ``loops[name](n)``: ``(t(1 + steps) - t(1)) / steps`` with
    the median ``t`` of ``repeats`` calls, all alternated (a burst of other work hits each
    alike). Where the machine's noise hides the iterations (the difference is not positive:
    a tiny stage timed with few repeats), ``t(1 + steps) / (1 + steps)``, which counts the
    call's overhead too: an upper bound, never a free stage."""
    took: dict = {}
    for name, loop in loops.items():
        loop(1).numpy()  # trace + compile
        took[name] = {1: [], 1 + steps: []}
    for _ in range(repeats):
        for name, loop in loops.items():
            for n in (1, 1 + steps):
                t0 = time.perf_counter()
                loop(n).numpy()
                took[name][n].append(time.perf_counter() - t0)
    per = {}
    for name, t in took.items():
        many, one = float(np.median(t[1 + steps])), float(np.median(t[1]))
        per[name] = (many - one) / steps if many > one else many / (1 + steps)
    return per


def timed_loop(fn, device: str, kind: str, config, batch: int, prompt: int = 0, pad: int = 0,
               attend: int = 1):
    """``f(n)``: ``fn`` (a segment's decode function attending ``attend`` slots, or with
    ``prompt`` its prefill of that many tokens, ``pad`` of them padding) run ``n`` times on
    ``device`` in a graph loop."""
    D = config.hidden_size

    @tf.function
    def loop(n):
        with tf.device(device):
            # ones, not zeros: packed matmuls skip rows of zeros (rows nobody reads), and a
            # block's zero input stays zero through every block of the loop
            x = tf.ones([batch, max(1, prompt), D])
            tok = tf.zeros([batch], tf.int32)
            pad_B = tf.fill([batch], pad)
            head_in = tuple(HeadIn.greedy(batch))

            def body(i, x, tok):
                with tf.device(device):
                    if prompt:  # the same slots every time: a prefill's cost does not move
                        ctl = pack_prefill_ctl(0, 0, pad_B)
                        seg_x = tf.zeros([batch, prompt], tf.int32) + tok[:, None] \
                            if kind == "embed" else x
                    else:
                        # every step writes and attends slot attend - 1: the same cost
                        ctl = pack_ctl(attend - 1, pad_B, tok if kind == "embed" else None)
                        seg_x = None if kind == "embed" else x
                    if kind == "head":
                        tok, _ = fn(x, ctl, "greedy", head_in)
                        return i + 1, x, tok
                    return i + 1, fn(seg_x, ctl, None, None), tok

            _, x, tok = tf.while_loop(lambda i, x, tok: i < n, body, (tf.constant(0), x, tok))
            return tf.reduce_sum(x) + tf.cast(tf.reduce_sum(tok), tf.float32)

    def on_device(n):  # called from the device, so the loop does not wait on the client
        with tf.device(client_cpu()):  # the count is made here: see graphs.OnDevice
            n = tf.constant(n)
        with tf.device(device):
            return loop(n)

    return on_device


def stage_timer(config, devices, *, batch: int = 1, slots: int = 128,
                stream_bytes: float = 128e6, seed: int = 0, like: dict | None = None,
                prompt: int = 0, pad: int = 0, attend: int | None = None, route=None):
    """Build the timed loops once; ``timer(steps, repeats)`` then gives what
    :func:`time_stages` gives, as often as needed (a benchmark times the stages between its
    own calls with it, so both see the machine in the same state). ``like``: the model's
    weights, whose packed tensors' types the random weights take; ``prompt``: time prefills
    of that many tokens (``pad`` of them padding); ``attend``: the slots a decode step reads;
    ``route``: ``tfnb.place``'s, which decides the route each device's packed stages run on."""
    packed = bool(like) and any(isinstance(w, PackedTensor) for w in like.values())
    block_bytes = llama_chain(config, like if packed else None)["block.0"].param_bytes
    k = max(1, min(config.n_layers, math.ceil(stream_bytes / block_bytes)))
    small = dataclasses.replace(config, n_layers=k)
    weights = random_weights(small, seed)  # the time does not depend on the values
    routes = {}
    if packed:
        weights = packed_like(weights, like)
        routes = packed_routes(devices, route)  # timed as placing would run them
    # bounded like every call on the cluster: a silent worker fails calibration in seconds
    loops = call_with_deadline(
        lambda: {(dev, kind): loop for dev in devices
                 for kind, loop in _loops(small, weights, dev, batch, slots, prompt, pad,
                                          attend, routes.get(dev, "kernel")).items()},
        (), timeout=CALIBRATION_TIMEOUT_S, devices=devices, what="calibration (weights)")

    def timer(steps: int = 32, repeats: int = 9) -> dict:
        per = call_with_deadline(_per_step, (loops, steps, repeats), timeout=CALIBRATION_TIMEOUT_S,
                                 devices=devices, what="calibration")
        return {dev: {kind: per[(dev, kind)] / (k if kind == "block" else 1)
                      for kind in ("embed", "block", "head")} for dev in devices}

    return timer


def time_stages(config, devices, *, batch: int = 1, slots: int = 128, steps: int = 32,
                repeats: int = 9, stream_bytes: float = 128e6, seed: int = 0,
                like: dict | None = None, prompt: int = 0, pad: int = 0,
                attend: int | None = None) -> dict:
    """``{device: {"embed": s, "block": s, "head": s}}``: seconds per decode step of the
    embedding, one block and the head on each of ``devices`` (with ``prompt``: seconds per
    prefill of ``batch`` prompts of ``prompt`` tokens).

    The devices' timed calls alternate, so their samples spread over the whole calibration
    and a slow spell of the machine falls on a few samples of each, which the median skips.
    Each device is timed alone: timing all at once, as a pipeline runs them, gave the same
    figures within calibration's run-to-run spread (docs/placement.md).

    Parameters
    ----------
    config : the model's ``LlamaConfig``
    devices : TF device strings of a connected cluster (or this process)
    batch, slots : sequences per step and KV-cache slots
    steps, repeats : decode steps per timed call, and timed calls (the median counts)
    stream_bytes : the consecutive blocks timed together hold at least this many weight bytes
    like : the model's weights: its packed tensors' ggml types are timed (default: float32)
    prompt : time prefills of prompts this long instead of decode steps (``slots`` >= it)
    pad : of the prompt's tokens, how many are left padding (0 to ``prompt - 1``)
    attend : the slots each decode step reads (1 to ``slots``; default all of them)

    Examples
    --------
    >>> from tfnb.models.decoder import tiny_config
    >>> t = time_stages(tiny_config(), ["/device:CPU:0"], slots=16, steps=2, repeats=1)
    >>> sorted(t["/device:CPU:0"]), all(v >= 0 for v in t["/device:CPU:0"].values())
    (['block', 'embed', 'head'], True)
    """
    if prompt and not 0 < prompt <= slots:
        raise ValueError(f"prompt={prompt!r}: expected 1 to slots ({slots}) tokens")
    if not 0 <= pad < max(1, prompt):
        raise ValueError(f"pad={pad!r}: expected 0 to prompt - 1 ({max(1, prompt) - 1}) tokens")
    if attend is not None and not 0 < attend <= slots:
        raise ValueError(f"attend={attend!r}: expected 1 to slots ({slots}) slots")
    return stage_timer(config, devices, batch=batch, slots=slots, stream_bytes=stream_bytes,
                       seed=seed, like=like, prompt=prompt, pad=pad,
                       attend=attend)(steps, repeats)
