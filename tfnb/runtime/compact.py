"""The XLA route: packed weights held as plain tensors, multiplied in plain TensorFlow ops.

tfnb's packed-weight kernel (:mod:`tfnb.kernels`) is CPU code in a library that ``tfnb worker``
loads. A device without it (a plain ``tf.distribute.Server``, a GPU) holds each packed matrix as
a :class:`Compact` instead, in the bytes of the file's blocks (Q5_0's widened), with no custom
op:

- ``"q8"``: int8 values ``(out, cols)`` and one float16 scale per block of 32 (Q8_0; Q5_0 is
  widened to it value for value);
- ``"q4"``: the file's nibbles as uint8 ``(out, cols / 2)``, a float16 scale per block and, for
  Q4_1, a float16 minimum (Q4_0 subtracts 8);
- ``"float"``: F32, F16 and BF16 matrices as float32, float16 and bfloat16 ``(out, cols)``.

Any other type (Q5_1, the K-quants) is dequantized on the client and requantized to Q8_0
(:func:`requantized`), which costs accuracy and bytes; ``place`` says so in one warning.

The blocks reach the device as the kernel route's uint8 rows (read from the worker's file or
sent), and :func:`to_compact` rewrites them there in TF ops. A product of one or two rows (a
decode step of one or two sequences) runs as one XLA loop fusion that reads each weight byte once
and makes no float copy of the matrix; more rows (a batch, a prompt) dequantize the matrix once
per call and use XLA's dot. Norms, softmax, rotary and logits stay float32.

Examples
--------
>>> import numpy as np
>>> from tfnb.kernels import QTYPES
>>> rows = np.zeros((2, 34), np.uint8); rows[:, 1] = 0x3c; rows[:, 2:] = 3   # d = 1, q = 3
>>> w = to_compact(tf.constant(rows), QTYPES["Q8_0"])
>>> w.form, w.q.dtype.name, matmul(tf.ones([1, 32]), w).numpy().tolist()
('q8', 'int8', [[96.0, 96.0]])
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

from tfnb.kernels import QTYPES, row_bytes

__all__ = ["Compact", "EXACT", "FORMS", "requantized", "to_compact", "compact_on", "matmul",
           "dequantize", "gather_rows"]

# The ggml types held as they are on the XLA route: their values are the file's, exactly.
EXACT = tuple(QTYPES[t] for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"))
FORMS = ("q8", "q4", "float")
_REQUANTIZE_ROWS = 4096  # rows requantized at once: a 128k-token embedding in 32 steps
_FLOATS = {QTYPES["F32"]: tf.float32, QTYPES["F16"]: tf.float16, QTYPES["BF16"]: tf.bfloat16}


class Compact(NamedTuple):
    """A matrix on a device in plain tensors: ``cols`` inputs to ``q``'s rows of outputs.
    ``d`` is ``(out, cols / 32)`` float16 block scales (None for ``"float"``); ``m`` Q4_1's block
    minimums or None."""
    q: object
    d: object
    m: object
    cols: int
    form: str

    @property
    def rows(self) -> int:
        return int(self.q.shape[0])


def requantized(p):
    """``p`` (a ``PackedTensor`` in a type outside :data:`EXACT`) as Q8_0 blocks, on the client,
    and the largest error that costs relative to the row's largest value."""
    from tfnb.models.packed import PackedTensor, quantize_rows

    if p.parts is not None and len(p.parts) > 1:  # fused from several tensors: read them once
        p = PackedTensor(p.data, p.qtype, p.cols, p.transposed)
    blocks, error = [], 0.0
    for start in range(0, p.rows, _REQUANTIZE_ROWS):  # a chunk of rows in float32 at a time
        values = p.row_range(start, min(p.rows, start + _REQUANTIZE_ROWS)).rows_float32()
        q8 = quantize_rows(values, QTYPES["Q8_0"])
        back = PackedTensor(q8, QTYPES["Q8_0"], p.cols, transposed=False).rows_float32()
        scale = np.maximum(np.abs(values).max(axis=1, keepdims=True), 1e-30)
        error = max(error, float((np.abs(back - values) / scale).max()))
        blocks.append(q8)
    return PackedTensor(np.concatenate(blocks), QTYPES["Q8_0"], p.cols, p.transposed), error


def to_compact(rows, qtype: int, cols: int | None = None) -> Compact:
    """uint8 rows of ggml ``qtype`` blocks (one output each, a type of :data:`EXACT`) as a
    :class:`Compact` of tensors, in TF ops on the current device; ``cols`` defaults to what
    the rows' static width holds."""
    if qtype not in EXACT:
        raise ValueError(f"ggml type {qtype} has no exact compact form: expected one of {EXACT}")
    if cols is None and rows.shape[1] is not None:
        cols = rows.shape[1] // row_bytes(qtype, 32) * 32 if qtype not in _FLOATS \
            else rows.shape[1] // _FLOATS[qtype].size
    from tfnb.runtime.fileload import widen_blocks

    n_rows = tf.shape(rows)[0]
    if qtype in _FLOATS:
        dtype = _FLOATS[qtype]
        values = tf.bitcast(tf.reshape(rows, [n_rows, -1, dtype.size]), dtype)
        return Compact(values, None, None, cols, "float")
    if qtype == QTYPES["Q5_0"]:
        rows, qtype = widen_blocks(rows, qtype, QTYPES["Q8_0"]), QTYPES["Q8_0"]
    block = row_bytes(qtype, 32)
    blocks = tf.reshape(rows, [n_rows, -1, block])
    d = tf.bitcast(tf.reshape(blocks[..., :2], [n_rows, -1, 2]), tf.float16)
    if qtype == QTYPES["Q8_0"]:
        q = tf.reshape(tf.bitcast(blocks[..., 2:], tf.int8), [n_rows, -1])
        return Compact(q, d, None, cols, "q8")
    if qtype == QTYPES["Q4_1"]:
        m = tf.bitcast(tf.reshape(blocks[..., 2:4], [n_rows, -1, 2]), tf.float16)
        return Compact(tf.reshape(blocks[..., 4:], [n_rows, -1]), d, m, cols, "q4")
    return Compact(tf.reshape(blocks[..., 2:], [n_rows, -1]), d, None, cols, "q4")  # Q4_0


def _compact_fn(qtype: int):
    """:func:`to_compact` as a traced function (its constants travel inside it, and a Python
    value made a tensor under a remote device scope would hold the GIL: ``weights``), kept with
    the current cluster's other traces (``graphs.shared_entry``)."""
    from tfnb.runtime.graphs import shared_entry

    def convert(rows):
        c = to_compact(rows, qtype)
        return tuple(t for t in (c.q, c.d, c.m) if t is not None)
    return shared_entry(("compact", qtype), lambda: tf.function(
        convert, autograph=False, input_signature=[tf.TensorSpec([None, None], tf.uint8)]))


def compact_on(device: str, data, qtype: int, cols: int, name: str) -> Compact:
    """The uint8 blocks ``data`` (a variable or tensor on ``device``) as a :class:`Compact` of
    new variables there; ``data`` may be dropped afterwards. A GPU's blocks are rewritten on
    its task's CPU (``weights.host_cpu``) and the results copied to it."""
    from tfnb.runtime.weights import host_cpu

    with tf.device(host_cpu(device)):
        parts = list(_compact_fn(qtype)(tf.convert_to_tensor(data)))
    form = "float" if qtype in _FLOATS else "q8" if qtype in (QTYPES["Q8_0"],
                                                               QTYPES["Q5_0"]) else "q4"
    names = ("q", "d", "m")[:len(parts)]
    with tf.device(device):
        made = [tf.Variable(t, trainable=False, name=f"{name.replace('.', '_')}_{n}")
                for t, n in zip(parts, names)]
    made += [None] * (3 - len(made))
    return Compact(made[0], made[1], made[2], cols, form)


def _values(w: Compact, q):
    """float32 ``(rows, cols / 32, 32)`` block values of ``q`` (``w``'s int8 or nibble rows,
    or some of them), before their scales."""
    n = q.shape[0] if q.shape[0] is not None else tf.shape(q)[0]
    nb = w.cols // 32
    if w.form == "q4":
        nib = tf.reshape(q, [n, nb, 16])  # byte j: value j low, value j + 16 high
        values = tf.cast(tf.concat([tf.bitwise.bitwise_and(nib, 15),
                                    tf.bitwise.right_shift(nib, 4)], -1), tf.float32)
        return values if w.m is not None else values - 8.0
    # int8 values as (bits ^ 128) - 128 over two halves of 16: XLA:CPU vectorizes the fused
    # multiply-reduce only over this form, not over cast(int8) (docs/gpu.md)
    u = tf.reshape(tf.bitcast(q, tf.uint8), [n, nb, 2, 16])
    return tf.cast(tf.bitwise.bitwise_xor(tf.concat([u[:, :, 0], u[:, :, 1]], -1), 128),
                   tf.float32) - 128.0


def _dequantized(w: Compact, q, d, m):
    """float32 ``(rows, cols)`` of the given rows of ``w``."""
    if w.form == "float":
        return tf.cast(q, tf.float32)
    values = _values(w, q) * tf.cast(d, tf.float32)[..., None]
    if m is not None:
        values = values + tf.cast(m, tf.float32)[..., None]
    return tf.reshape(values, [-1, w.cols])


def dequantize(w: Compact):
    """The float32 ``(out, cols)`` matrix."""
    return _dequantized(w, w.q, w.d, w.m)


def gather_rows(w: Compact, ids):
    """float32 ``(len(ids), cols)``: rows ``ids`` (an embedding table's tokens)."""
    def take(t):
        return None if t is None else tf.gather(tf.convert_to_tensor(t), ids)
    return _dequantized(w, take(w.q), take(w.d), take(w.m))


# Up to this many rows a product is one fused multiply-reduce; past it the matrix is dequantized
# once and multiplied by XLA's dot. The reduce's time grows with the rows (its multiply-adds are
# not shared across them), the dot's barely: measured crossover in docs/gpu.md.
REDUCE_ROWS = 2


def matmul(x_NxC, w: Compact):
    """``x @ w`` (N, out). Up to :data:`REDUCE_ROWS` rows: a fused multiply-reduce over the
    blocks (no float matrix is made); more: the matrix dequantized once, then XLA's dot. Its
    ops carry the name scope ``matmul``, by which the profiler tells them."""
    with tf.name_scope("matmul"):
        return _matmul(x_NxC, w)


def _matmul(x_NxC, w: Compact):
    N = x_NxC.shape[0]
    # Tied to the input by a barrier: inside a decode loop compiled whole, XLA's loop-invariant
    # code motion would otherwise hoist each matrix's widening out of the loop and carry float32
    # copies of every weight through it (docs/gpu.md; tests/test_compact.py checks the HLO)
    x_NxC, q, d, m = _tied(x_NxC, w.q, w.d, w.m)
    if w.form == "float":  # XLA fuses the cast into its matrix-vector dot
        return tf.matmul(x_NxC, tf.cast(q, tf.float32), transpose_b=True)
    if N > REDUCE_ROWS:  # the matrix is made for this call only
        return tf.matmul(x_NxC, _dequantized(w, q, d, m), transpose_b=True)
    nb = w.cols // 32
    x_1xNxBx32 = tf.reshape(x_NxC, [1, N, nb, 32])
    # output rows outermost: each weight row is widened once and meets every input row
    sums_MxNxB = tf.reduce_sum(_values(w, q)[:, None] * x_1xNxBx32, -1)
    out_MxNxB = sums_MxNxB * tf.cast(d, tf.float32)[:, None]
    if m is not None:  # Q4_1: + m times the block's sum of inputs
        out_MxNxB = out_MxNxB + tf.cast(m, tf.float32)[:, None] * tf.reduce_sum(x_1xNxBx32, -1)
    return tf.transpose(tf.reduce_sum(out_MxNxB, -1))


def _tied(x, *weights):
    """``x`` and ``weights`` through one ``XlaOptimizationBarrier`` (the absent ones as None),
    so that nothing computed from the weights is independent of ``x``."""
    present = [tf.convert_to_tensor(t) for t in weights if t is not None]
    out = iter(xla.optimization_barrier(x, *present))
    x = next(out)
    return (x, *[None if t is None else next(out) for t in weights])
