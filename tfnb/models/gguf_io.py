"""Read a llama-architecture GGUF file into canonical weights and a tokenizer.

Weights come packed (``PackedTensor``: the file's blocks, for F32, F16, Q4_0, Q4_1 and Q8_0) or
as float32 arrays (``packed=False``, and any other type, which is dequantized).

Two layout traps, both handled here:

- GGUF matrices are stored ``(out, in)``; canonical (Keras) kernels are ``(in, out)``.
- llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` within each head from HF's
  rotary layout (first half, second half) to interleaved pairs. ``unpermute_rows`` undoes it:
  rows ``(n_heads, head_dim/2, 2)`` -> ``(n_heads, 2, head_dim/2)``. With the opposite direction
  SmolLM2 babbles; with this one it answers "The capital of France is Paris."
"""

from __future__ import annotations

import os

import numpy as np

from tfnb.errors import ModelError
from tfnb.models.decoder import LlamaConfig, weight_shapes
from tfnb.models.packed import QTYPES, PackedTensor
from tfnb.models.progress import Reporter, silent
from tfnb.models.tokenizer import Tokenizer, tokenizer_from_gguf_fields

__all__ = ["read_gguf", "unpermute_rows", "permute_rows", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# llama.cpp's converter permutes q/k rows for its llama rotary layout only; Qwen2 keeps HF's
# halves (NEOX rotary), and adds q/k/v biases. Mistral models convert as "llama".
_PERMUTED_ROPE = ("llama",)
_BLOCK_BIASES = {"attn_q": "bq", "attn_k": "bk", "attn_v": "bv"}

_BLOCK_TENSORS = {
    "attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv",
    "attn_output": "wo", "ffn_norm": "mlp_norm", "ffn_gate": "w_gate", "ffn_up": "w_up",
    "ffn_down": "w_down",
}


def unpermute_rows(w_RxC: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head rotary row permutation of an ``(out, in)`` q/k matrix.

    Examples
    --------
    >>> w = np.arange(8.0)[:, None]           # one head, head_dim 8
    >>> unpermute_rows(permute_rows(w, 1), 1)[:, 0].tolist() == w[:, 0].tolist()
    True
    >>> permute_rows(w, 1)[:, 0].tolist()     # HF halves -> llama.cpp pairs
    [0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]
    """
    rows, cols = w_RxC.shape
    w_HxPx2xC = w_RxC.reshape(n_heads, rows // n_heads // 2, 2, cols)
    return w_HxPx2xC.swapaxes(1, 2).reshape(rows, cols)


def permute_rows(w_RxC: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (HF rotary halves -> interleaved pairs); inverse of
    ``unpermute_rows``.

    Examples
    --------
    >>> permute_rows(np.arange(4.0)[:, None], 1)[:, 0].tolist()
    [0.0, 2.0, 1.0, 3.0]
    """
    rows, cols = w_RxC.shape
    w_Hx2xPxC = w_RxC.reshape(n_heads, 2, rows // n_heads // 2, cols)
    return w_Hx2xPxC.swapaxes(1, 2).reshape(rows, cols)


def _reader_class():
    """``gguf.GGUFReader`` parsing through a plain ndarray view of its memory map.

    Slicing an ``np.memmap`` runs Python-level ``__array_finalize__`` for each of the ~250k
    metadata items of a tokenizer; a plain view of the same buffer makes opening SmolLM2's file
    about 2x faster. Tensor data still points into the map (nothing is read eagerly).
    """
    import gguf

    class _PlainViewReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return _PlainViewReader


def _field_value(field):
    return field.contents()


def _metadata(reader) -> dict:
    return {key: _field_value(field) for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}


def _short_float(value) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF's 1e-5 reads as
    9.99999975e-06)."""
    return float(str(np.float32(value)))


def _config(meta: dict, path: str) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(f"GGUF architecture {arch!r} in {path!r} is not supported: "
                         f"expected one of {list(SUPPORTED_ARCHITECTURES)}")

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelError(f"GGUF file {path!r} lacks metadata '{arch}.{key}': "
                             "expected a complete llama GGUF")
        return value

    def count(key, default=None) -> int:
        value = get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ModelError(f"GGUF metadata '{arch}.{key}'={value!r} in {path!r}: "
                             "expected a positive integer")
        return int(value)

    def number(key, default) -> float:
        value = get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
                or not value > 0:
            raise ModelError(f"GGUF metadata '{arch}.{key}'={value!r} in {path!r}: "
                             "expected a positive number")
        return _short_float(value)

    n_heads = count("attention.head_count")
    hidden = count("embedding_length")
    if hidden % n_heads:
        raise ModelError(f"GGUF metadata '{arch}.embedding_length'={hidden} in {path!r} is not "
                         f"divisible by '{arch}.attention.head_count'={n_heads}: expected a "
                         "multiple")
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and rope_dims != hidden // n_heads:
        raise ModelError(f"GGUF rope.dimension_count={rope_dims!r} differs from head_dim="
                         f"{hidden // n_heads}: only full-head rotary embeddings are supported")
    if meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ModelError(f"GGUF rope scaling {meta[f'{arch}.rope.scaling.type']!r} is not "
                         "supported: expected none")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    if vocab == 0:
        raise ModelError(f"GGUF file {path!r} has neither '{arch}.vocab_size' nor "
                         "'tokenizer.ggml.tokens': expected a vocabulary")
    meta = {**meta, f"{arch}.vocab_size": vocab}
    eos = meta.get("tokenizer.ggml.eos_token_id")
    try:
        return LlamaConfig(
            vocab_size=count("vocab_size"),
            hidden_size=hidden,
            n_layers=count("block_count"),
            n_heads=n_heads,
            n_kv_heads=count("attention.head_count_kv", n_heads),
            ffn_size=count("feed_forward_length"),
            rope_theta=number("rope.freq_base", 10000.0),
            norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5),
            max_context=count("context_length", 2048),
            tie_embeddings=True,  # fixed below from the tensor list
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_ids=() if eos is None else (int(eos),),
        )
    except ModelError as e:  # a relation between fields (e.g. KV heads that do not divide heads)
        raise ModelError(f"GGUF file {path!r}: {e}") from None


def _canonical(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "embed"
    if gguf_name == "output_norm.weight":
        return "final_norm"
    if gguf_name == "output.weight":
        return "lm_head"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        if parts[3] == "weight" and parts[2] in _BLOCK_TENSORS:
            return f"blocks.{int(parts[1])}.{_BLOCK_TENSORS[parts[2]]}"
        if parts[3] == "bias" and parts[2] in _BLOCK_BIASES:
            return f"blocks.{int(parts[1])}.{_BLOCK_BIASES[parts[2]]}"
    return None


def _block_order(gguf_name: str) -> tuple:
    parts = gguf_name.split(".")
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1, gguf_name)


def _dequantize(tensor, config: LlamaConfig, name: str, permuted: bool) -> np.ndarray:
    """float32 canonical array of one GGUF tensor (transposed and un-permuted as needed)."""
    from gguf.quants import dequantize

    w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if np.may_share_memory(w, tensor.data):
        w = w.copy()  # F32 tensors come back as views of the read-only file map
    if w.ndim == 1 or name == "embed":
        return np.ascontiguousarray(w)   # norms (d,); embed is already (vocab, d)
    if permuted:
        w = _unpermuted(w, config, name)
    return np.ascontiguousarray(w.T)  # (out, in) -> (in, out)


def _unpermuted(rows, config: LlamaConfig, name: str):
    """The q/k rows in HF's rotary order; permuting whole rows also works on packed bytes."""
    if name.endswith(".wq"):
        return unpermute_rows(rows, config.n_heads)
    if name.endswith(".wk"):
        return unpermute_rows(rows, config.n_kv_heads)
    return rows


def _packed(tensor, config: LlamaConfig, name: str, permuted: bool):
    """A ``PackedTensor`` of one 2-D GGUF tensor in a type the kernels read, else None."""
    qtype = QTYPES.get(tensor.tensor_type.name)
    if qtype is None or len(tensor.shape) != 2:
        return None
    cols, rows = (int(n) for n in tensor.shape)  # GGUF lists the fastest-varying axis first
    data = np.array(np.asarray(tensor.data).view(np.uint8).reshape(rows, -1))  # out of the map
    return PackedTensor(_unpermuted(data, config, name) if permuted else data, qtype, cols,
                        transposed=name != "embed")


def read_gguf(path, report: Reporter = silent, packed: bool = True
              ) -> tuple[LlamaConfig, dict, Tokenizer, str]:
    """Config, canonical weights, tokenizer and name of a llama GGUF file.

    With ``packed`` every matrix in F32, F16, Q4_0, Q4_1 or Q8_0 stays a ``PackedTensor``;
    vectors (norms) and other types become float32 arrays.

    Raises ``ModelError`` for a missing, truncated or corrupt file, an unsupported architecture,
    quantization or tokenizer.

    Examples
    --------
    >>> config, weights, tok, name = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
    >>> config.n_layers  # doctest: +SKIP
    30
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelError(f"GGUF file {path!r} does not exist: expected a path to a .gguf file")
    report(0, 1, "reading")
    try:
        reader = _reader_class()(path)
        meta = _metadata(reader)
        size = os.path.getsize(path)
        for tensor in reader.tensors:
            if tensor.data_offset + tensor.n_bytes > size:
                raise ValueError(f"tensor {tensor.name} ends past the end of the file")
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - gguf/numpy raise many types for a bad file
        raise ModelError(f"{path!r} is truncated or not a GGUF file ({type(exc).__name__}: "
                         f"{str(exc)[:120]}): expected a complete .gguf file") from None
    report(1, 1, "reading")

    config = _config(meta, path)
    names = {t.name: _canonical(t.name) for t in reader.tensors}
    unknown = sorted(n for n, c in names.items() if c is None)
    if unknown:
        raise ModelError(f"GGUF file {path!r} has tensors {unknown[:3]} that tfnb does not "
                         "support: expected only llama/qwen2 tensors (token_embd, blk.N.*, "
                         "output*)")
    import dataclasses

    arch = meta["general.architecture"]
    permuted = arch in _PERMUTED_ROPE
    config = dataclasses.replace(config, tie_embeddings="output.weight" not in names,
                                 qkv_bias=any(n.endswith(".bias") for n in names))
    expected = weight_shapes(config)
    extra = sorted((n for n, c in names.items() if c not in expected), key=_block_order)
    if extra:
        raise ModelError(f"GGUF file {path!r} has tensors {extra[:3]} beyond its "
                         f"'{meta['general.architecture']}.block_count'={config.n_layers}: "
                         f"expected blocks blk.0 to blk.{config.n_layers - 1} only")
    missing = sorted(set(expected) - set(names.values()))
    if missing:
        raise ModelError(f"GGUF file {path!r} lacks tensors for {missing[:3]}: "
                         "expected a complete llama model")
    weights: dict = {}
    total = len(reader.tensors)
    stage = "reading weights" if packed else "dequantizing"
    report(0, total, stage)
    for i, tensor in enumerate(reader.tensors):
        name = names[tensor.name]
        try:
            w = ((packed and _packed(tensor, config, name, permuted))
                 or _dequantize(tensor, config, name, permuted))
        except NotImplementedError as exc:
            raise ModelError(f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, "
                             f"which gguf cannot dequantize ({exc}): expected a common "
                             "quantization (F32, F16, Q8_0, Q4_0, Q4_1, K-quants)") from None
        except ValueError as exc:  # bytes that do not make whole rows of the declared shape
            raise ModelError(f"GGUF tensor {tensor.name} ({tensor.tensor_type.name}, shape "
                             f"{list(tensor.shape)}) is malformed ({exc}): expected a complete "
                             ".gguf file") from None
        if w.shape != expected[name]:
            raise ModelError(f"GGUF tensor {tensor.name} has shape {w.shape} after conversion: "
                             f"expected {expected[name]}")
        weights[name] = w
        report(i + 1, total, stage)
    try:
        tokenizer = tokenizer_from_gguf_fields(meta)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - tokenizers raises bare Exception
        raise ModelError(f"GGUF tokenizer metadata in {path!r} is unusable ({type(exc).__name__}: "
                         f"{str(exc)[:120]}): expected GPT-2 style tokens and merges") from None
    model_name = meta.get("general.name") or os.path.basename(path)
    del reader  # drops the file's memory map
    return config, {n: weights[n] for n in expected}, tokenizer, str(model_name)
