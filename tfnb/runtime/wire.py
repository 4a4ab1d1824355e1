"""One tensor each way per call: a function's arguments travel to its worker as one byte
vector, and its results come back as one.

TF 2.21's eager runtime copies each argument of a call on a remote device to that device in a
round trip of its own before the call starts, and fetches each result in another once it ends,
each also costing the worker's CPU; a scheduler lane's decode chunk has 7 arguments and 5
results, so packing them saves most of a call's overhead (docs/runtime.md).

After its first call a packed function is called through its one concrete function
(:meth:`Packed.run`), not through ``tf.function``'s lookup, which hashes the types of the
arguments and of every captured variable on each call: client CPU matters, since the client
shares the cores with the workers (docs/runtime.md).

:class:`Packed` wraps a ``tf.function`` for one argument signature (:func:`signature`): its
graph slices the arguments out of the bytes :func:`pack` made, calls the function, and returns
every result's bytes after a header of their shapes (results may have dynamic shapes, such as
a loop's stacked tokens); :meth:`Packed.unpack` rebuilds them as numpy arrays, nested as the
function returned them. Bytes are read in the machine's order on both ends, little-endian on
every platform TF's CPU runtime ships for.

Examples
--------
>>> import numpy as np
>>> args = (np.int32(3), np.arange(4, dtype=np.float32), np.array([True, False]))
>>> call = Packed(tf.function(lambda s, x, b: (s + 1, {"sum": tf.reduce_sum(x), "b": b})),
...               signature(args))
>>> out = call.unpack(call.fn(tf.constant(pack(args))).numpy())
>>> int(out[0]), float(out[1]["sum"]), out[1]["b"].tolist()
(4, 6.0, [True, False])
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.eager.polymorphic_function import function_type_utils

__all__ = ["signature", "pack", "Packed"]

_BYTES = tf.uint8


def signature(args) -> tuple | None:
    """``((dtype, shape), ...)`` of ``args`` as numpy sees them, or None when one of them is
    not plain data (a tensor, None, a string): such calls go as they are."""
    out = []
    for a in args:
        if a is None or isinstance(a, (tf.Tensor, tf.Variable, str, bytes)):
            return None
        a = np.asarray(a)
        if a.dtype.kind not in "biuf":
            return None
        out.append((a.dtype, a.shape))
    return tuple(out)


def pack(args) -> np.ndarray:
    """``args`` (of :func:`signature`) as one uint8 vector, each in C order."""
    parts = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in map(np.asarray, args)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint8)


def _to_bytes(t: tf.Tensor) -> tf.Tensor:
    if t.dtype == tf.bool:
        t = tf.cast(t, _BYTES)
    elif t.dtype != _BYTES:
        t = tf.bitcast(t, _BYTES)  # one more axis of dtype.size bytes, but for 1-byte types
    return tf.reshape(t, [-1])


def _from_bytes(b: tf.Tensor, dtype: np.dtype, shape: tuple) -> tf.Tensor:
    if dtype == np.bool_:
        return tf.cast(tf.reshape(b, shape), tf.bool)
    if dtype.itemsize == 1:
        return tf.bitcast(tf.reshape(b, shape), tf.as_dtype(dtype))
    return tf.bitcast(tf.reshape(b, (*shape, dtype.itemsize)), tf.as_dtype(dtype))


def _leaf(_):
    return 0


class Packed:
    """``fn`` (a ``tf.function`` or a Python function) for arguments of one ``signature``,
    called with their bytes (:func:`pack`) and returning its results' bytes (:meth:`unpack`).

    A ``tf.function``'s own Python function is traced in place, so the graph a worker runs is
    ``fn``'s own between the unpacking and the packing, with the node names it always had (what
    the profiler reads), not a call of ``fn`` nested in another function.

    ``weighted``: ``fn`` takes a last argument of variables (a model's weights and caches),
    passed to :meth:`run` as :meth:`weight_inputs`; its graph may capture no variable, so that
    it serves every set of variables of the same shapes.

    Attributes
    ----------
    fn : tf.function
        ``fn(bytes_uint8) -> bytes_uint8``, named after the function it wraps.
    """

    def __init__(self, fn, sig: tuple, weighted: bool = False):
        self.sig, self.weighted = sig, weighted
        self._out: tuple | None = None  # (structure, dtypes, ranks), known once traced
        body = getattr(fn, "python_function", fn)

        def call(blob, *weights):
            args, at = [], 0
            for dtype, shape in sig:
                n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                args.append(_from_bytes(blob[at:at + n], dtype, shape))
                at += n
            out = body(*args, *weights)
            flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(out)]
            self._out = (tf.nest.map_structure(_leaf, out),
                         [t.dtype.as_numpy_dtype for t in flat], [t.shape.rank for t in flat])
            shapes = [tf.shape(t) for t in flat if t.shape.rank]
            header = tf.concat(shapes, 0) if shapes else tf.zeros([0], tf.int32)
            return tf.concat([_to_bytes(header)] + [_to_bytes(t) for t in flat], 0)

        call.__name__ = getattr(body, "__name__", "call")
        self.fn = tf.function(call)
        self._concrete = None

    def concrete(self, blob: tf.Tensor, *weights):
        """The one graph of ``self.fn`` for ``blob``'s signature (and the variables' shapes),
        traced on the first request."""
        if self._concrete is None:
            concrete = self.fn.get_concrete_function(blob, *weights)
            if self.weighted and any(t.dtype == tf.resource for t in concrete.captured_inputs):
                raise RuntimeError(f"{self.fn.__name__} captures a variable: a graph shared by "
                                   "several placements must take them all as its argument")
            self._concrete = concrete
        return self._concrete

    def weight_inputs(self, blob: tf.Tensor, weights) -> list:
        """``weights`` as the graph's inputs after ``blob`` (each variable's handle), for
        :meth:`run`; traces the graph if it was not."""
        concrete = self.concrete(blob, weights)
        bound = function_type_utils.canonicalize_function_inputs(
            (blob, weights), {}, concrete.function_type)
        return concrete.function_type.unpack_inputs(bound)[1:]

    def run(self, blob: tf.Tensor, weight_inputs=None) -> tf.Tensor:
        """``self.fn(blob)`` (or with the variables of :meth:`weight_inputs`): the first call
        traces the graph, later calls run it directly.

        A ``tf.function`` call looks its graph up by the types of its arguments and of every
        variable it captures, hashing each of them on every call; a placed model's function
        takes a few hundred (weights and caches). The signature here never changes, so there
        is one graph to run (what the lookup cost: docs/runtime.md), and the variables'
        handles, flattened once per set, go straight in rather than being bound from their
        nested structure on each call (docs/runtime.md)."""
        if weight_inputs is None:
            return self.concrete(blob)(blob)
        concrete = self._concrete
        return concrete._call_flat([blob, *weight_inputs], concrete.captured_inputs)

    def unpack(self, buf: np.ndarray):
        """The results, as numpy arrays (numpy scalars for 0-d ones) nested as ``fn``
        returned them, from the bytes ``self.fn`` returned."""
        structure, dtypes, ranks = self._out
        dims = np.frombuffer(buf, np.int32, count=sum(ranks)).tolist()
        at, flat = 4 * len(dims), []
        for dtype, rank in zip(dtypes, ranks):
            shape, dims = tuple(dims[:rank]), dims[rank:]
            dt = np.dtype(np.uint8 if dtype == np.bool_ else dtype)
            n = int(np.prod(shape, dtype=np.int64))
            a = np.frombuffer(buf, dt, count=n, offset=at).reshape(shape)
            at += n * dt.itemsize
            a = a.astype(np.bool_) if dtype == np.bool_ else a.copy()
            flat.append(a[()] if rank == 0 else a)
        return tf.nest.pack_sequence_as(structure, flat)
