"""How long each stage of a llama model takes on a device, timed with the runtime's own code.

The planners need seconds per decode step of every stage on every device. FLOP counts alone
mislead: decoding one token multiplies vectors by matrices, so it reads every weight once and
does two FLOPs per weight read. Memory bandwidth bounds it, not FLOP/s. On the 2-core test machine,
a SmolLM2 block runs at about 5 GFLOP/s, against 30 GFLOP/s or more for the square matmuls that
measure a device's speed. So ``time_stages`` runs the runtime's compiled decode functions
(:func:`tfnb.runtime.placed._segment_functions`, XLA, as ``generate`` runs them) on the device:

- weights of the model's shapes with random values (what the time depends on), created on the
  device, so nothing large crosses the network;
- the embedding, ``k`` consecutive blocks and the head as three segments. ``k`` blocks hold at
  least ``stream_bytes`` (128 MB by default), more than the caches of the CPUs we know. A block
  timed alone stays in the last-level cache: probed, one SmolLM2 block (14 MB, 32 MB L3) ran at
  1.55 ms, eight in a row at 2.12 ms each;
- each segment called ``steps`` times in a ``tf.while_loop`` on the device. A step costs
  ``(t(1 + steps) - t(1)) / steps``, which removes the client's round trip; the calls of all
  three segments alternate ``repeats`` times and the median of each counts. The median, not the
  best: a timed call lasts 0.2-0.3 s, a generate call seconds, and the least disturbed of 7
  short calls is faster than a long call runs. Probed on the 2-core machine, workers pinned
  to one core each, SmolLM2 over 1 or 2 workers: the sum of the best times predicted 5-16%
  less than generate measured; the median's sum came within -12% to +1%, with and without
  a busy process sharing a worker's core.

The caches have ``slots`` slots (decode attends over all of them, masked), as in a generate
call whose prompt and new tokens fit ``slots``.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import tensorflow as tf

from tfnb.models.chain import llama_chain
from tfnb.models.llama import random_weights
from tfnb.runtime.placed import PlacedModel, Segment, _segment_functions

__all__ = ["time_stages"]


def _random_blocks(config, device: str, batch: int, slots: int, stream_bytes: float, seed: int):
    """``(config of k blocks, k, params, KV caches)``: a model of ``k`` blocks holding at least
    ``stream_bytes`` of weights (random values of the real shapes), created on ``device``."""
    block_bytes = llama_chain(config)["block.0"].param_bytes
    k = max(1, min(config.n_layers, math.ceil(stream_bytes / block_bytes)))
    small = dataclasses.replace(config, n_layers=k)
    names = ["embed"] + [f"block.{i}" for i in range(k)] + ["head"]
    # random values of the real shapes: the time does not depend on them
    pm = PlacedModel(small, random_weights(small, seed), None, dict.fromkeys(names, device),
                     timeout=None)
    shape = [batch, small.n_kv_heads, slots, small.head_dim]
    with tf.device(device):
        caches = [(tf.Variable(tf.zeros(shape), trainable=False),
                   tf.Variable(tf.zeros(shape), trainable=False)) for _ in range(k)]
    return small, k, pm.params[0], caches


def _per_step(loops: dict, device: str, steps: int, repeats: int) -> dict[str, float]:
    """Seconds per iteration of each ``loops[name](n)``: ``(t(1 + steps) - t(1)) / steps`` with
    the median ``t`` of ``repeats`` calls, all alternated (a burst of other work hits each
    alike)."""
    took: dict = {}
    with tf.device(device):
        for name, loop in loops.items():
            loop(tf.constant(1)).numpy()  # trace + compile
            took[name] = {1: [], 1 + steps: []}
        for _ in range(repeats):
            for name, loop in loops.items():
                for n in (1, 1 + steps):
                    t0 = time.perf_counter()
                    loop(tf.constant(n)).numpy()
                    took[name][n].append(time.perf_counter() - t0)
    return {name: max(0.0, float(np.median(t[1 + steps]) - np.median(t[1]))) / steps
            for name, t in took.items()}


def _timed_loop(decode, device: str, kind: str, config, batch: int):
    """A function running ``decode`` ``n`` times on ``device`` in a graph loop."""
    D = config.hidden_size
    head_in = (tf.zeros([batch], tf.bool), tf.constant([1.0, 1.0]), tf.constant([0, 0]))

    @tf.function
    def loop(n):
        with tf.device(device):
            x = tf.zeros([batch, 1, D])
            tok = tf.zeros([batch], tf.int32)
            pad = tf.zeros([batch], tf.int32)

            def body(i, x, tok):
                with tf.device(device):
                    ctl = tf.concat([[1 + i], pad], axis=0)
                    if kind == "embed":
                        return i + 1, decode(None, tf.concat([ctl, tok], 0), None, None), tok
                    if kind == "head":
                        tok, _ = decode(x, ctl, "greedy", head_in)
                        return i + 1, x, tok
                    return i + 1, decode(x, ctl, None, None), tok

            _, x, tok = tf.while_loop(lambda i, x, tok: i < n, body, (tf.constant(0), x, tok))
            return tf.reduce_sum(x) + tf.cast(tf.reduce_sum(tok), tf.float32)

    return loop


def time_stages(config, device: str, *, batch: int = 1, slots: int = 128, steps: int = 32,
                repeats: int = 9, stream_bytes: float = 128e6, seed: int = 0) -> dict[str, float]:
    """Seconds per decode step of ``"embed"``, one ``"block"`` and ``"head"`` on ``device``.

    Parameters
    ----------
    config : the model's ``LlamaConfig``
    device : a TF device string of a connected cluster (or this process)
    batch, slots : sequences per step and KV-cache slots
    steps, repeats : decode steps per timed call, and timed calls (the median counts)
    stream_bytes : the consecutive blocks timed together hold at least this many weight bytes

    Examples
    --------
    >>> from tfnb.models.llama import tiny_config
    >>> t = time_stages(tiny_config(), "/device:CPU:0", slots=16, steps=2, repeats=1)
    >>> sorted(t), all(v >= 0 for v in t.values())
    (['block', 'embed', 'head'], True)
    """
    small, k, params, caches = _random_blocks(config, device, batch, slots, stream_bytes, seed)
    eos = small.eos_ids or (0,)
    embed = Segment(device, ("embed",), (), True, False)
    head = Segment(device, ("head",), (), False, True)
    decode = {
        "embed": _segment_functions(embed, {"blocks": [], **{
            key: v for key, v in params.items() if key.startswith("embed_")}}, [], small, eos, 0),
        "block": _segment_functions(Segment(device, tuple(f"block.{i}" for i in range(k)),
                                            tuple(range(k)), False, False),
                                    {"blocks": params["blocks"]}, caches, small, eos, 0),
        "head": _segment_functions(head, {"blocks": [], "final_norm": params["final_norm"],
                                          "out_DxV": params["out_DxV"]}, [], small, eos, 0),
    }
    loops = {kind: _timed_loop(fns[1], device, kind, small, batch)
             for kind, fns in decode.items()}
    out = _per_step(loops, device, steps, repeats)
    out["block"] /= k
    return out
