"""A model described, not loaded: its stages and their bytes with no weight in memory.

``describe_model(path)`` reads a GGUF file's header and tensor table only
(:func:`tfnb.models.gguf_io.read_gguf_header`: the file is memory-mapped, no tensor data is
read). ``describe_model(layers=..., hidden=..., ..., weights="Q4_K_M")`` needs no file: each
tensor gets the ggml type llama.cpp's ``llama-quantize`` gives it in a file of that type
(:func:`file_types`). Either way the result is the ``LayerChain`` the loaded model would have,
its bytes as tfnb would hold them (:func:`tfnb.models.packed.held_nbytes`), which
``tfnb.plan`` takes.

``file_types`` follows llama.cpp's ``llama_tensor_get_type`` (``src/llama-quant.cpp``) for a
dense llama-architecture decoder, without an importance matrix, for the file types whose
tensors tfnb's kernels read (``FILE_TYPES``):

- every matrix takes the file type's base type (``Q4_K`` for ``Q4_K_M`` and ``Q4_K_S``,
  ``Q5_K`` for ``Q5_K_M`` and ``Q5_K_S``, else the type of that name); vectors stay ``F32``;
- in a quantized file the output matrix (and the embedding too when they are tied) is
  ``Q6_K``, or ``Q8_0`` when the base type is ``Q8_0`` or its rows are not whole blocks of it;
- ``Q4_K_M`` and ``Q5_K_M``: ``attn_v`` and ``ffn_down`` are ``Q6_K`` in the layers llama.cpp
  gives more bits (the first and last eighth, and every third layer between);
  ``Q4_K_S``: ``attn_v`` of the first 4 layers and ``ffn_down`` of the first eighth ``Q5_K``;
- a Llama 70B (80 layers, grouped KV heads): an ``attn_v`` left at ``Q4_K`` becomes ``Q5_K``;
- rows that are not whole blocks of the chosen type fall back: ``Q4_K`` to ``Q5_0``, ``Q5_K`` to
  ``Q5_1``, ``Q6_K`` to ``Q8_0``, and ``F16`` when not whole blocks of that either.

Examples
--------
>>> chain = describe_model(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
...                        vocab=128256, weights="Q4_K_M")      # Llama 3.1 70B's shape
>>> len(chain), round(chain.total_param_bytes / 1e9, 1)
(82, 42.5)
"""

from __future__ import annotations

import os

import numpy as np

from tfnb.errors import ModelError
from tfnb.kernels import QTYPES, row_bytes
from tfnb.models.chain import LayerChain, llama_chain
from tfnb.models.decoder import LlamaConfig, weight_shapes
from tfnb.models.packed import held_nbytes

__all__ = ["describe_model", "file_types", "FILE_TYPES"]

FILE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0",
              "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0")
_BASE = {"Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K", "Q5_K_M": "Q5_K", "Q5_K_S": "Q5_K"}
_FLOATS = ("F32", "F16", "BF16")
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_SHAPE_ARGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "head_dim")


def _whole_blocks(type_name: str, cols: int) -> bool:
    """Whether rows of ``cols`` values are whole blocks of ``type_name``."""
    try:
        row_bytes(QTYPES[type_name], cols)
    except ValueError:
        return False
    return True


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers of ``n`` that a ``_M`` mix gives more bits."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def file_types(config: LlamaConfig, file_type: str) -> dict[str, str]:
    """The ggml type of each canonical weight of ``config`` in a llama.cpp file of
    ``file_type`` (one of ``FILE_TYPES``; see the module docstring).

    Examples
    --------
    >>> from tfnb.models.decoder import tiny_config
    >>> types = file_types(tiny_config(hidden_size=256, ffn_size=512, n_layers=8), "Q4_K_M")
    >>> types["blocks.0.wq"], types["blocks.0.wv"], types["blocks.1.wv"], types["embed"]
    ('Q4_K', 'Q6_K', 'Q4_K', 'Q6_K')
    >>> types["blocks.0.w_down"], types["blocks.0.attn_norm"]   # 512-value rows; a vector
    ('Q6_K', 'F32')
    """
    if file_type not in FILE_TYPES:
        raise ModelError(f"weights={file_type!r}: expected a GGUF file type whose tensors "
                         f"tfnb's kernels read, one of {list(FILE_TYPES)}")
    base = _BASE.get(file_type, file_type)
    n = config.n_layers
    big = n == 80 and config.n_heads != config.n_kv_heads  # llama.cpp's LLM_TYPE_70B
    out = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            out[name] = "F32"
            continue
        cols = shape[1] if name == "embed" else shape[0]  # values in a stored row
        kind = name.rsplit(".", 1)[-1]
        i = int(name.split(".")[1]) if name.startswith("blocks.") else -1  # the layer
        t = base
        if base in _FLOATS:
            out[name] = t
            continue
        if name == "lm_head" or (name == "embed" and config.tie_embeddings):
            t = "Q8_0" if base == "Q8_0" or not _whole_blocks(base, cols) else "Q6_K"
        elif kind == "wv":
            if file_type in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n):
                t = "Q6_K"
            elif file_type == "Q4_K_S" and i < 4:
                t = "Q5_K"
            if big and t == "Q4_K":
                t = "Q5_K"
        elif kind == "w_down":
            if file_type in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n):
                t = "Q6_K"
            elif file_type == "Q4_K_S" and i < n // 8:
                t = "Q5_K"
        if not _whole_blocks(t, cols):
            t = _FALLBACK.get(t, t)
            t = t if _whole_blocks(t, cols) else "F16"
        out[name] = t
    return out


def describe_model(path=None, *, weights: str | None = None, layers: int | None = None,
                   hidden: int | None = None, heads: int | None = None,
                   kv_heads: int | None = None, ffn: int | None = None,
                   vocab: int | None = None, head_dim: int | None = None,
                   tie_embeddings: bool = False) -> LayerChain:
    """The stages of a model that is described, not loaded: what ``tfnb.plan`` needs to say
    whether it fits and how fast it would run, with none of its weights in memory.

    Parameters
    ----------
    path : str or os.PathLike, optional
        A GGUF file: its header and tensor table are read, none of its tensor data, so a
        40 GB file costs about what its metadata does. Its bytes are those ``load_model``
        would give (``weights``: ``"packed"``, the default, or ``"float32"``).
    weights : str
        Without a file: the GGUF file type the weights would come in, one of ``FILE_TYPES``
        (``"Q4_K_M"``, ``"Q8_0"``, ``"F16"`` ...), each tensor typed as llama.cpp's quantizer
        types it (:func:`file_types`).
    layers, hidden, heads, kv_heads, ffn, vocab, head_dim, tie_embeddings
        Without a file: a llama-architecture decoder's shape (``kv_heads`` defaults to
        ``heads``, ``head_dim`` to ``hidden // heads``).

    Returns
    -------
    LayerChain
        ``embed``, ``block.0`` ... ``head``, with the bytes, FLOPs and KV cache the loaded
        model's chain would have.

    Examples
    --------
    >>> chain = describe_model(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
    ...                        vocab=128256, weights="Q4_K_M")
    >>> round(chain["block.0"].param_bytes / 1e6, 1), chain["block.0"].kv_bytes_per_token
    (544.1, 8192)
    >>> chain = describe_model("Llama-3.1-70B-Instruct-Q4_K_M.gguf")   # doctest: +SKIP
    """
    shape = dict(zip(_SHAPE_ARGS, (layers, hidden, heads, kv_heads, ffn, vocab, head_dim)))
    given = [k for k, v in shape.items() if v is not None]
    if path is not None:
        from tfnb.models.gguf_io import read_gguf_header

        if given or tie_embeddings:
            raise ModelError(f"describe_model({os.fspath(path)!r}, {', '.join(given)}=...): a "
                             "file gives its own shape: expected a path or a shape, not both")
        if weights not in (None, "packed", "float32"):
            raise ModelError(f"weights={weights!r} with a file: expected 'packed' (the default) "
                             "or 'float32', as load_model takes")
        config, nbytes, _ = read_gguf_header(path, packed=weights != "float32")
        return llama_chain(config, nbytes=nbytes)
    missing = [k for k in ("layers", "hidden", "heads", "ffn", "vocab") if shape[k] is None]
    if missing or weights is None:
        raise ModelError(f"describe_model: no path and no {', '.join(missing or ['weights'])}: "
                         "expected a GGUF file, or a shape (layers, hidden, heads, ffn, vocab; "
                         f"kv_heads, head_dim optional) and weights, one of {list(FILE_TYPES)}")
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, n_layers=layers, n_heads=heads,
                         n_kv_heads=heads if kv_heads is None else kv_heads, ffn_size=ffn,
                         head_dim=head_dim, tie_embeddings=bool(tie_embeddings))
    types = file_types(config, "F32" if weights == "float32" else weights)
    shapes = weight_shapes(config)
    nbytes = {name: held_nbytes(t, shapes[name][1 if name == "embed" else 0],
                                int(np.prod(shapes[name])), len(shapes[name]) == 2)
              for name, t in types.items()}
    return llama_chain(config, nbytes=nbytes)
