"""tfnb's TensorFlow ops, compiled from this package's C++ files on first use.

``TfnbPackedMatMul`` computes ``x @ dequantize(w).T`` straight from a GGUF file's blocks,
``TfnbPackedDequantize`` turns packed rows into float32 (embedding lookups) and
``TfnbDecodeAttention`` attends one new token per row over the KV caches in place. The library is
built from every ``.cc`` file here (``packed_op.cc`` and its per-instruction-set kernels,
``attention.cc``) against the installed TensorFlow's headers (``tf.sysconfig``) with the
system's C++ compiler, in one command with one set of flags (the x86 kernels carry target
attributes instead), into a cache directory keyed by every ``.cc`` and ``.h`` file here, the
TensorFlow version and the flags (``$TFNB_KERNEL_DIR``, default ``~/.cache/tfnb/kernels``);
``scripts/setup`` builds it once. ``docs/kernels.md`` describes the kernels.
The client loads it to build graphs and every ``tfnb worker`` loads it to run them.

Examples
--------
>>> import numpy as np
>>> row_bytes(QTYPES["Q4_1"], 64)
40
>>> w = np.zeros((3, 64), np.float32)
>>> packed_matmul(np.ones((2, 64), np.float32), w.view(np.uint8).reshape(3, -1), 0, 64).shape
TensorShape([2, 3])
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

__all__ = ["QTYPES", "row_bytes", "library", "build", "packed_matmul", "packed_dequantize",
           "decode_attention", "isa", "OP_NAMES", "ACTIVATIONS", "KernelBuildError"]

# ggml type ids the kernels read, by GGUF name
QTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
          "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}
OP_NAMES = ("TfnbPackedMatMul", "TfnbPackedDequantize", "TfnbDecodeAttention")
_VALUE_BYTES = {0: 4, 1: 2, 30: 2}   # the float types: bytes per value
# the block types: (values, bytes) per block
_BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
           12: (256, 144), 13: (256, 176), 14: (256, 210)}
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = tuple(sorted(glob.glob(os.path.join(_HERE, "*.cc"))))
_HEADERS = tuple(sorted(glob.glob(os.path.join(_HERE, "*.h"))))
_lock = threading.Lock()
_loaded = None
_isa = None


class KernelBuildError(RuntimeError):
    """The packed-weight ops could not be compiled (no compiler, or it failed)."""


def row_bytes(qtype: int, cols: int) -> int:
    """Bytes of one packed row of ``cols`` values of ggml type ``qtype``."""
    if qtype in _VALUE_BYTES:
        return _VALUE_BYTES[qtype] * cols
    values, nbytes = _BLOCKS.get(qtype, (32, 0))
    if not nbytes or cols % values:
        names = {v: k for k, v in QTYPES.items()}
        raise ValueError(f"qtype={names.get(qtype, qtype)!r} with {cols} columns: expected one "
                         f"of {list(QTYPES)} and, for block types, a multiple of 32 columns "
                         "(256 for the K-quants Q4_K, Q5_K, Q6_K)")
    return cols // values * nbytes


def _flags() -> list[str]:
    import tensorflow as tf
    include = tf.sysconfig.get_include()
    # XLA's headers (for the custom calls inside compiled segments) include third-party
    # headers that the wheel ships under include/external, and XLA's symbols live in
    # libtensorflow_cc
    return ["-O3", "-fPIC", "-shared", "-w", *tf.sysconfig.get_compile_flags(),
            f"-I{include}/external/highwayhash", f"-I{include}/external/farmhash_archive/src",
            *tf.sysconfig.get_link_flags(), "-l:libtensorflow_cc.so.2"]


def _library_path() -> str:
    import tensorflow as tf
    digest = hashlib.sha256()
    for source in _SOURCES + _HEADERS:  # names too: a renamed file is a different build
        digest.update(os.path.basename(source).encode() + b"\0")
        with open(source, "rb") as f:
            digest.update(f.read())
    key = hashlib.sha256(digest.digest() + tf.__version__.encode()
                         + " ".join(_flags()).encode()).hexdigest()[:16]
    root = os.environ.get("TFNB_KERNEL_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tfnb", "kernels")
    return os.path.join(root, f"tfnb_packed_{key}.so")


def build(force: bool = False) -> str:
    """Compile the ops (unless a build of these sources for this TensorFlow exists); its path.

    Raises ``KernelBuildError`` naming the compiler's complaint.
    """
    path = _library_path()
    if os.path.exists(path) and not force:
        return path
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise KernelBuildError("no C++ compiler (g++ or $CXX) to build tfnb's packed-weight "
                               "ops: install g++, or load models with weights='float32'")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        done = subprocess.run([cxx, *_SOURCES, "-o", tmp, *_flags()], capture_output=True,
                              text=True, timeout=600)
        if done.returncode:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            names = ", ".join(os.path.basename(source) for source in _SOURCES)
            raise KernelBuildError(f"building {names} (in {_HERE}) with {cxx} failed: "
                                   + "\n".join(errors[:5] or done.stderr.splitlines()[-5:]))
        os.replace(tmp, path)  # atomic: a concurrent builder or loader sees all or nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def library():
    """The loaded op library (built first if needed), once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            import ctypes

            import tensorflow as tf
            global _isa
            path = build()
            library = tf.load_op_library(path)
            native = ctypes.CDLL(path)  # the same loaded copy; see packed_op.cc
            native.tfnb_register_xla_kernels()
            native.tfnb_packed_isa.restype = native.tfnb_int8_isa.restype = ctypes.c_char_p
            _isa = native.tfnb_packed_isa().decode(), native.tfnb_int8_isa().decode()
            _loaded = library
        return _loaded


def isa() -> str:
    """The code the float32 route's matmuls run on this CPU: ``"avx512"`` (AVX-512F/BW/VL, up
    to 8 activation rows in registers), ``"avx2"`` (AVX2, FMA, F16C) or ``"portable"`` C++.
    ``$TFNB_PACKED_ISA=avx2`` or ``portable``, set before the library loads, caps it.

    Examples
    --------
    >>> isa() in ("avx512", "avx2", "portable")
    True
    """
    library()
    return _isa[0]


def int8_isa() -> str:
    """The integer dot product the int8 route runs on this CPU: ``"vnni512"`` (AVX512-VNNI
    on 256-bit vectors), ``"avxvnni"`` (AVX-VNNI), ``"avx2"`` (maddubs) or ``"portable"``.
    ``$TFNB_PACKED_ISA=avx2`` caps it at ``avx2``, ``=avxvnni`` at ``avxvnni`` (and the
    float route at AVX2, as on a CPU with AVX-VNNI but no AVX-512).

    Examples
    --------
    >>> int8_isa() in ("vnni512", "avxvnni", "avx2", "portable")
    True
    """
    library()
    return _isa[1]


ACTIVATIONS = ("float32", "int8")


def packed_matmul(x_NxC, w_MxR, qtype: int, cols: int, activations: str = "float32"):
    """``x @ dequantize(w).T``: float32 ``(N, M)`` from ``x`` (N, cols) and packed rows.

    ``activations="int8"`` computes as llama.cpp does for Q4_0, Q4_1 and Q8_0 weights: each row
    of ``x`` rounded to blocks of 32 int8 values (scale ``max|x| / 127`` kept as float16, as
    llama.cpp's Q8_0/Q8_1 activations), integer dot products per block, exact for the rounded
    ``x`` (each value moves by at most half its block's scale), summed in block order. A row
    gets the same bits on every CPU and at any batch size (docs/kernels.md). The other types
    (F32, F16, BF16, Q5_0, Q5_1 and the K-quants) ignore it.
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r}: expected one of {list(ACTIVATIONS)}")
    return library().tfnb_packed_mat_mul(x_NxC, w_MxR, qtype=qtype, cols=cols,
                                         activations=activations)


def packed_dequantize(w_MxR, qtype: int, cols: int):
    """float32 ``(M, cols)`` values of packed rows."""
    return library().tfnb_packed_dequantize(w_MxR, qtype=qtype, cols=cols)


def decode_attention(q_BxHxE, k_cache, v_cache, pad_B, slot, window: int):
    """Attention of one new token per row over KV caches ``[>= B, K, slots, E]``, read where
    they lie (no copy of the window): row ``b``'s query head ``h`` attends KV head
    ``h // (H / K)`` over slots ``pad[b] <= s <= min(slot, window - 1)``, scaled by
    ``E ** -0.5``. float32 ``(B, H * E)``; a row that sees no slot gets zeros."""
    return library().tfnb_decode_attention(q_BxHxE, k_cache, v_cache, pad_B, slot,
                                           window=window)
