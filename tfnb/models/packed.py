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
"""

from __future__ import annotations

import numpy as np

from tfnb.kernels import QTYPES, row_bytes

__all__ = ["PackedTensor", "QTYPES", "QTYPE_NAMES", "fuse_rows", "weight_nbytes", "packed_like"]

QTYPE_NAMES = {v: k for k, v in QTYPES.items()}


class PackedTensor:
    """A weight in ggml blocks; see the module docstring.

    Parameters
    ----------
    data : np.ndarray
        uint8 ``(rows, row_bytes)``.
    qtype : int
        ggml type id (``QTYPES``).
    cols : int
        Values per row.
    transposed : bool
        True when the canonical array is ``(cols, rows)`` (every kernel matrix).
    """

    __array_priority__ = 10

    def __init__(self, data: np.ndarray, qtype: int, cols: int, transposed: bool = True):
        rows = data.shape[0]
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != row_bytes(qtype, cols):
            raise ValueError(f"packed data {data.dtype}{list(data.shape)} does not hold {rows} "
                             f"rows of {cols} {QTYPE_NAMES.get(qtype, qtype)} values: expected "
                             f"uint8[{rows}, {row_bytes(qtype, cols)}]")
        self.data, self.qtype, self.cols, self.transposed = data, int(qtype), int(cols), transposed

    @property
    def rows(self) -> int:
        return self.data.shape[0]

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
        return int(self.data.nbytes)

    @property
    def qtype_name(self) -> str:
        return QTYPE_NAMES[self.qtype]

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


def fuse_rows(parts: list) -> PackedTensor | np.ndarray:
    """Kernel matrices side by side (``[a | b | c]`` on the output axis): one ``PackedTensor``
    (their rows stacked) when all are packed in the same type, else a float32 array."""
    if all(isinstance(p, PackedTensor) and p.transposed for p in parts) \
            and len({(p.qtype, p.cols) for p in parts}) == 1:
        return PackedTensor(np.concatenate([p.data for p in parts], axis=0), parts[0].qtype,
                            parts[0].cols)
    return np.concatenate([np.asarray(p, np.float32) for p in parts], axis=1)


def weight_nbytes(w) -> int:
    """Bytes a weight takes on a device: packed bytes, or 4 per value for float32."""
    return w.nbytes if isinstance(w, PackedTensor) else int(np.prod(np.shape(w))) * 4


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
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    out = {}
    for name, w in weights.items():
        ref = like.get(name)
        if not isinstance(ref, PackedTensor) or ref.qtype == QTYPES["F32"]:
            out[name] = w
            continue
        rows = np.ascontiguousarray(w.T if ref.transposed else w, np.float32)
        data = np.ascontiguousarray(quantize(rows, GGMLQuantizationType[ref.qtype_name]))
        out[name] = PackedTensor(data.view(np.uint8).reshape(rows.shape[0], -1), ref.qtype,
                                 rows.shape[1], ref.transposed)
    return out
