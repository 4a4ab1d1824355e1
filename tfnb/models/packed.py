"""``PackedTensor``: one weight kept as its GGUF file holds it (ggml blocks), dequantized only on
demand.

A packed matrix is ``rows`` x ``row_bytes`` uint8 where each row is one output channel of
``cols`` values (the file's ``(out, in)`` layout). Its canonical shape is what the float32 path
uses: ``(cols, rows)`` for a kernel (``(in, out)``), or ``(rows, cols)`` for the embedding table
(``transposed=False``). ``np.asarray(packed)`` gives that float32 array, so code that wants
floats (``to_hf``, the float32 path, checks) reads a packed weight like any array; the runtime
reads the blocks themselves (``tfnb.kernels``).

Examples
--------
>>> import numpy as np
>>> p = PackedTensor(np.zeros((4, 128), np.uint8), QTYPES["F32"], 32)   # 4 rows x 32 floats
>>> p.shape, p.nbytes, p.size, np.asarray(p).shape
((32, 4), 512, 128, (32, 4))

A weight read from a GGUF file is held as ``FileRows``: where its rows lie in the file, not the
rows themselves. The client reads them (from its memory map of the file) only when it sends
them to a device; a worker that sees the same file reads them there instead
(``tfnb.runtime.fileload``), so loading and placing a model costs the client its header.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tfnb.kernels import QTYPES, row_bytes

__all__ = ["PackedTensor", "PackedStack", "FileRows", "QTYPES", "QTYPE_NAMES", "fuse_rows",
           "widened", "weight_nbytes", "held_nbytes", "packed_like", "quantize_rows"]

QTYPE_NAMES = {v: k for k, v in QTYPES.items()}


@dataclasses.dataclass(frozen=True, eq=False)
class FileRows:
    """Rows of a packed matrix where a file holds them: ``span`` rows of ``row_bytes`` bytes
    from byte ``offset`` of ``path``, in ggml type ``qtype``, taken in ``order`` (indices into
    the span; None: all of them as stored). ``buffer`` is this process's read-only map of the
    whole file; nothing is read from it until :meth:`read`.

    Examples
    --------
    >>> buf = np.arange(12, dtype=np.uint8)
    >>> rows = FileRows("f.gguf", 4, 2, 3, QTYPES["F32"], None, buf)
    >>> rows.read().tolist(), rows.sliced(1, 2).read().tolist()
    ([[4, 5, 6], [7, 8, 9]], [[7, 8, 9]])
    >>> rows.reordered(np.array([1, 0])).read()[:, 0].tolist()
    [7, 4]
    """

    path: str
    offset: int
    span: int
    row_bytes: int
    qtype: int
    order: np.ndarray | None
    buffer: np.ndarray = dataclasses.field(repr=False)

    @property
    def rows(self) -> int:
        return self.span if self.order is None else len(self.order)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def read(self) -> np.ndarray:
        """uint8 ``(rows, row_bytes)``: a view of the map, or a copy when reordered."""
        block = self.buffer[self.offset:self.offset + self.span * self.row_bytes]
        block = block.reshape(self.span, self.row_bytes)
        return block if self.order is None else block[self.order]

    def sliced(self, start: int, stop: int) -> FileRows:
        """Rows ``start:stop`` of these rows."""
        if self.order is not None:
            return dataclasses.replace(self, order=self.order[start:stop])
        return dataclasses.replace(self, offset=self.offset + start * self.row_bytes,
                                   span=stop - start)

    def reordered(self, order: np.ndarray) -> FileRows:
        """These rows taken in ``order`` (indices into them)."""
        order = np.asarray(order, np.int64)
        base = np.arange(self.span) if self.order is None else self.order
        return dataclasses.replace(self, order=base[order])


class PackedTensor:
    """A weight in ggml blocks; see the module docstring.

    Parameters
    ----------
    data : np.ndarray or tuple of FileRows
        uint8 ``(rows, row_bytes)``; or the file rows that make it, stacked in turn, each
        rewritten in ``qtype`` when its own type is another one that ``qtype`` holds exactly
        (``widened``).
    qtype : int
        ggml type id (``QTYPES``).
    cols : int
        Values per row.
    transposed : bool
        True when the canonical array is ``(cols, rows)`` (every kernel matrix).
    """

    __array_priority__ = 10

    def __init__(self, data, qtype: int, cols: int, transposed: bool = True):
        self.qtype, self.cols, self.transposed = int(qtype), int(cols), transposed
        if isinstance(data, tuple):
            self.parts, self._data = data, None
            if not data or any(p.row_bytes != row_bytes(p.qtype, self.cols) or not (
                    p.qtype == self.qtype or (p.qtype, self.qtype) in _WIDEN) for p in data):
                raise ValueError(f"file rows of {[QTYPE_NAMES.get(p.qtype) for p in data]} "
                                 f"do not hold {cols} {QTYPE_NAMES.get(qtype, qtype)} values "
                                 "per row")
            return
        rows = data.shape[0]
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != row_bytes(qtype, cols):
            raise ValueError(f"packed data {data.dtype}{list(data.shape)} does not hold {rows} "
                             f"rows of {cols} {QTYPE_NAMES.get(qtype, qtype)} values: expected "
                             f"uint8[{rows}, {row_bytes(qtype, cols)}]")
        self.parts, self._data = None, data

    @property
    def data(self) -> np.ndarray:
        """The uint8 ``(rows, row_bytes)`` blocks (read from the file's map each time for a
        file-backed tensor, so the client holds them only while it uses them)."""
        if self._data is not None:
            return self._data
        blocks = [_widen_rows(p.read(), p.qtype, self.qtype) for p in self.parts]
        return blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=0)

    @property
    def rows(self) -> int:
        return self._data.shape[0] if self._data is not None else sum(p.rows for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.cols, self.rows) if self.transposed else (self.rows, self.cols)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def size(self) -> int:
        return self.rows * self.cols

    @property
    def nbytes(self) -> int:
        return self.rows * row_bytes(self.qtype, self.cols)

    @property
    def qtype_name(self) -> str:
        return QTYPE_NAMES[self.qtype]

    def row_range(self, start: int, stop: int) -> PackedTensor:
        """Rows ``start:stop`` (output channels of a kernel), file-backed where this is."""
        if self.parts is not None and len(self.parts) == 1:
            return PackedTensor((self.parts[0].sliced(start, stop),), self.qtype, self.cols,
                                self.transposed)
        return PackedTensor(self.data[start:stop], self.qtype, self.cols, self.transposed)

    def rows_float32(self) -> np.ndarray:
        """The ``(rows, cols)`` float32 values, as ``gguf.quants.dequantize`` gives them."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if self.qtype == QTYPES["F32"]:
            return self.data.view(np.float32).copy()
        qt = GGMLQuantizationType[self.qtype_name]
        return np.asarray(dequantize(self.data, qt), np.float32).reshape(self.rows, self.cols)

    def __array__(self, dtype=None, copy=None):
        w = self.rows_float32()
        w = np.ascontiguousarray(w.T) if self.transposed else w
        return w if dtype is None else w.astype(dtype)

    def __repr__(self) -> str:
        return f"PackedTensor({self.qtype_name}, shape={self.shape}, {self.nbytes} bytes)"


class PackedStack:
    """Kernel matrices side by side (``[a | b | c]`` on the output axis), each in its own
    blocks: packed types no one of which holds the others (a Q4_K_M file's Q4_K q and k beside
    a Q6_K v). The runtime multiplies each and joins the outputs.

    Examples
    --------
    >>> a = PackedTensor(np.zeros((2, 144), np.uint8), QTYPES["Q4_K"], 256)
    >>> b = PackedTensor(np.zeros((1, 210), np.uint8), QTYPES["Q6_K"], 256)
    >>> stack = PackedStack((a, b))
    >>> stack, stack.shape, np.asarray(stack).shape
    (PackedStack(Q4_K, Q6_K, shape=(256, 3), 498 bytes), (256, 3), (256, 3))
    """

    __array_priority__ = 10

    def __init__(self, parts):
        self.parts = tuple(parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.parts[0].cols, sum(p.rows for p in self.parts))

    @property
    def ndim(self) -> int:
        return 2

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __array__(self, dtype=None, copy=None):
        w = np.concatenate([np.asarray(p, np.float32) for p in self.parts], axis=1)
        return w if dtype is None else w.astype(dtype)

    def __repr__(self) -> str:
        return (f"PackedStack({', '.join(p.qtype_name for p in self.parts)}, "
                f"shape={self.shape}, {self.nbytes} bytes)")


def fuse_rows(parts: list) -> PackedTensor | PackedStack | np.ndarray:
    """Kernel matrices side by side (``[a | b | c]`` on the output axis): one ``PackedTensor``
    (their rows stacked) when all are packed in one type, or in types that one of them holds
    exactly (``widened``: Q4_0 and Q5_0 in Q8_0, Q4_1 in Q5_1, as llama-quantize's mixes pair
    them); a ``PackedStack`` when they are packed in other types; else a float32 array.

    Examples
    --------
    >>> q8 = PackedTensor(np.zeros((2, 34), np.uint8), QTYPES["Q8_0"], 32)
    >>> q5 = PackedTensor(np.zeros((3, 22), np.uint8), QTYPES["Q5_0"], 32)
    >>> fuse_rows([q5, q8])
    PackedTensor(Q8_0, shape=(32, 5), 170 bytes)
    >>> q51 = PackedTensor(np.zeros((1, 24), np.uint8), QTYPES["Q5_1"], 32)
    >>> fuse_rows([q51, q8])
    PackedStack(Q5_1, Q8_0, shape=(32, 3), 92 bytes)
    """
    if all(isinstance(p, PackedTensor) and p.transposed for p in parts) \
            and len({p.cols for p in parts}) == 1:
        qtypes = {p.qtype for p in parts}
        common = next((t for t in (parts[0].qtype, *qtypes)
                       if all(q == t or (q, t) in _WIDEN for q in qtypes)), None)
        if common is not None and all(p.parts is not None for p in parts):
            return PackedTensor(tuple(f for p in parts for f in p.parts), common, parts[0].cols)
        if common is not None:
            return PackedTensor(np.concatenate([widened(p, common) for p in parts], axis=0),
                                common, parts[0].cols)
        return PackedStack(parts)
    return np.concatenate([np.asarray(p, np.float32) for p in parts], axis=1)


_Q = QTYPES
_WIDEN = {(_Q["Q4_0"], _Q["Q8_0"]), (_Q["Q5_0"], _Q["Q8_0"]), (_Q["Q4_1"], _Q["Q5_1"])}


def widened(p: PackedTensor, qtype: int) -> np.ndarray:
    """``p``'s blocks rewritten in ``qtype``, value for value (a pair of ``_WIDEN``): the same
    float16 scale (and min), the codes re-centred or given a zero fifth bit.

    Examples
    --------
    >>> q4 = np.zeros((1, 18), np.uint8); q4[0, 1] = 0x3c; q4[0, 2] = 0x9f   # d = 1, q0 = 15
    >>> widened(PackedTensor(q4, QTYPES["Q4_0"], 32), QTYPES["Q8_0"])[0, 2:5].view(np.int8)
    array([ 7, -8, -8], dtype=int8)
    """
    return _widen_rows(p.data, p.qtype, qtype)


def _widen_rows(data: np.ndarray, from_qtype: int, qtype: int) -> np.ndarray:
    """uint8 rows of ``from_qtype`` blocks rewritten in ``qtype`` (see ``widened``)."""
    if from_qtype == qtype:
        return data
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, row_bytes(from_qtype, 32))
    n = blocks.shape[:2]
    if from_qtype == _Q["Q4_1"]:  # d, m, then a zero fifth bit for every value, then nibbles
        out = np.concatenate([blocks[..., :4], np.zeros((*n, 4), np.uint8), blocks[..., 4:]], -1)
        return out.reshape(rows, -1)
    codes = blocks[..., -16:]
    q_Nx32 = np.concatenate([codes & 0x0F, codes >> 4], -1).astype(np.int16)  # value j, j + 16
    if from_qtype == _Q["Q5_0"]:
        high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # bit j of value j
        q_Nx32 = q_Nx32 | (high.astype(np.int16) << 4)
        q_Nx32 -= 16
    else:  # Q4_0
        q_Nx32 -= 8
    out = np.concatenate([blocks[..., :2], q_Nx32.astype(np.int8).view(np.uint8)], -1)
    return out.reshape(rows, -1)


def weight_nbytes(w) -> int:
    """Bytes a weight takes on a device: packed bytes, or 4 per value for float32."""
    return w.nbytes if isinstance(w, (PackedTensor, PackedStack)) \
        else int(np.prod(np.shape(w))) * 4


def held_nbytes(type_name: str, cols: int, values: int, packed: bool = True) -> int:
    """Bytes a weight of ``values`` values, stored in a GGUF file as ggml type ``type_name`` in
    rows of ``cols``, takes on a device once loaded, without its data at hand: what
    :func:`weight_nbytes` gives for it. A matrix loaded ``packed`` in a type of ``QTYPES``
    keeps the file's rows; anything else is dequantized to float32 (4 bytes a value).

    Examples
    --------
    >>> held_nbytes("Q4_K", 8192, 8192 * 1024)        # 1024 rows of 32 blocks of 144 bytes
    4718592
    >>> held_nbytes("Q4_K", 8192, 8192 * 1024, packed=False), held_nbytes("IQ4_XS", 256, 256)
    (33554432, 1024)
    """
    if packed and type_name in QTYPES:
        return values // cols * row_bytes(QTYPES[type_name], cols)
    return 4 * values


def packed_like(weights: dict, like: dict) -> dict:
    """``weights`` (float32 arrays by name) packed as ``like``'s tensors of the same name are:
    their ggml type and layout (``gguf.quants.quantize``); the others as they are. What times a
    packed model's stages with random values of its own kinds (``tfnb.runtime.calibrate``).

    Examples
    --------
    >>> w = {"a": np.ones((64, 3), np.float32), "b": np.ones(3, np.float32)}
    >>> like = {"a": PackedTensor(np.zeros((3, 36), np.uint8), QTYPES["Q4_0"], 64)}
    >>> out = packed_like(w, like)
    >>> out["a"], out["b"] is w["b"]
    (PackedTensor(Q4_0, shape=(64, 3), 108 bytes), True)
    """
    out = {}
    for name, w in weights.items():
        ref = like.get(name)
        if not isinstance(ref, PackedTensor) or ref.qtype == QTYPES["F32"]:
            out[name] = w
            continue
        rows = np.ascontiguousarray(w.T if ref.transposed else w, np.float32)
        out[name] = PackedTensor(quantize_rows(rows, ref.qtype), ref.qtype, rows.shape[1],
                                 ref.transposed)
    return out


def quantize_rows(rows_MxC: np.ndarray, qtype: int) -> np.ndarray:
    """float32 rows in ggml type ``qtype``: uint8 ``(M, row_bytes)``. ``gguf.quants.quantize``
    where gguf has a quantizer; the K-quants (which it lacks) by a plain round to nearest over
    each group's range (from its minimum or 0, whichever is lower), with no search for the best
    scales: what stands in for a file's weights in timings and tests.

    Examples
    --------
    >>> w = np.linspace(-1, 1, 512, dtype=np.float32).reshape(2, 256)
    >>> q = quantize_rows(w, QTYPES["Q4_K"])
    >>> back = PackedTensor(q, QTYPES["Q4_K"], 256, transposed=False).rows_float32()
    >>> q.shape, bool(np.abs(back - w).max() < 1 / 30)   # half a step of 16 over [0, 1]
    ((2, 144), True)
    """
    rows = np.ascontiguousarray(rows_MxC, np.float32)
    name = QTYPE_NAMES[qtype]
    if name in _K_QUANTIZERS:
        blocks = _K_QUANTIZERS[name](rows.reshape(-1, 256))
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        blocks = np.ascontiguousarray(quantize(rows, GGMLQuantizationType[name]))
    return blocks.view(np.uint8).reshape(rows.shape[0], row_bytes(qtype, rows.shape[1]))


def _f16_up(x) -> np.ndarray:
    """The least float16 at or above ``x`` (float32 again): a block's stored scale, which then
    covers its groups."""
    x = np.asarray(x, np.float32)
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)),
                    h).astype(np.float32)


def _divide(x, d):
    return np.divide(x, d, out=np.zeros(np.broadcast_shapes(x.shape, d.shape), np.float32),
                     where=d != 0)


def _k_scales(x_Bx8x32, levels: int):
    """Q4_K/Q5_K: each group's ``q`` in ``[0, levels]``, and the block's ``d, dmin`` (float16
    bytes) and 12 scale bytes: 6-bit scales and mins per group (``value = q d sc - dmin m``).
    Mins and scales round up, so every value lies within its group's codes, half a step from
    the nearest."""
    mins = -np.minimum(x_Bx8x32.min(-1), 0)
    dmin = _f16_up(mins.max(-1, keepdims=True) / 63)
    m = np.ceil(_divide(mins, dmin)).astype(np.uint8)
    off = (dmin * m)[..., None]
    scale = (x_Bx8x32.max(-1) + off[..., 0]) / levels
    d = _f16_up(scale.max(-1, keepdims=True) / 63)
    sc = np.ceil(_divide(scale, d)).astype(np.uint8)
    q = np.clip(np.rint(_divide(x_Bx8x32 + off, (d * sc)[..., None])), 0, levels)
    packed = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1)
    head = np.concatenate([d.astype(np.float16).view(np.uint8),
                           dmin.astype(np.float16).view(np.uint8), packed], axis=1)
    return q.astype(np.uint8), head


def _nibbles(q_Bx8x32):
    """Bytes 32 c + j of groups 2c (low nibble) and 2c + 1 (high)."""
    q = q_Bx8x32 & 15
    return (q[:, 0::2] | q[:, 1::2] << 4).reshape(len(q), 128)


def _quantize_q4_k(x_Bx256):
    q, head = _k_scales(x_Bx256.reshape(-1, 8, 32), 15)
    return np.concatenate([head, _nibbles(q)], axis=1)


def _quantize_q5_k(x_Bx256):
    q, head = _k_scales(x_Bx256.reshape(-1, 8, 32), 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8)  # bit g
    return np.concatenate([head, qh, _nibbles(q)], axis=1)


def _quantize_q6_k(x_Bx256):
    x = x_Bx256.reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = _f16_up(scale.max(-1, keepdims=True) / 127)
    sc = np.ceil(_divide(scale, d)).astype(np.int8)
    q = np.clip(np.rint(_divide(x, (d * sc)[..., None])), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # half, quarter of 128 values, 32 values
    ql = (q[:, :, 0:2] & 15) | (q[:, :, 2:4] & 15) << 4  # bytes 32 k + j, k = 0, 1
    qh = (q >> 4 << np.array([0, 2, 4, 6], np.uint8)[:, None]).sum(2, dtype=np.uint8)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                           d.astype(np.float16).view(np.uint8)], axis=1)


_K_QUANTIZERS = {"Q4_K": _quantize_q4_k, "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}
