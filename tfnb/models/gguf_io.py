"""Read a GGUF decoder (``llama``, ``qwen2``, ``qwen3``, ``phi3``, ``gemma2``, ``gemma3``) into
canonical weights and a tokenizer.

Weights come packed (``PackedTensor``: the file's blocks, for the types in ``QTYPES``) or as
float32 arrays (``packed=False``, and any other type, which is dequantized: one
``DequantizedWeightsWarning`` per load says which types, how many tensors and the bytes it
costs).

The architectures, as llama.cpp defines them, on one canonical layout (``models/decoder.py``):

- ``llama`` (Llama, Mistral, SmolLM): optional q/k/v biases; Llama 3's ``rope_freqs.weight``
  (rotary frequency i divided by factor i) becomes ``LlamaConfig.rope_freq_factors``.
- ``qwen2``: q/k/v biases; ``qwen3``: per-head RMSNorm of q and k (``attn_q_norm``,
  ``attn_k_norm``) before rotary, and its own head width (``attention.key_length``).
- ``phi3``: ``attn_qkv`` holds the q, k and v rows in turn and ``ffn_up`` the gate's rows then
  the up projection's; both are split here (the runtime fuses them again). LongRoPE factors
  (``rope_factors_long``/``short``) other than all ones are refused.
- ``gemma2`` (text): embeddings times ``sqrt(embedding_length)``, a GELU(tanh)-gated MLP,
  RMSNorms of the attention's and the MLP's outputs (``post_attention_norm``,
  ``post_ffw_norm``), NEOX rotary, tied embeddings; attention scores and logits soft-capped
  (``attn_logit_softcapping``, default 50; ``final_logit_softcapping``, default 30); every other
  layer (0, 2, ...) sees only the last ``attention.sliding_window`` tokens (default 4096).
  Attention scale ``key_length ** -0.5``, except for llama.cpp's 27B (46 layers):
  ``(embedding_length / head_count) ** -0.5``, its ``query_pre_attn_scalar``.
- ``gemma3`` (text): as ``gemma2`` plus ``attn_q_norm``/``attn_k_norm``, without soft-capping;
  five sliding-window layers to one global (layer i is global when ``i % 6 == 5``); the
  sliding layers rotate with base 10000 and no scaling, the global ones with ``rope.freq_base``
  and the file's linear scaling. The 27B (62 layers) takes the scale as above. The window is
  required (llama.cpp's Gemma 3 without one is not read).
  (The converter stores Gemma's norm gains with their ``1 +`` already added.)

Rope scaling: ``{arch}.rope.scaling.type`` ``none`` or ``linear`` (llama.cpp's default when the
key is absent); ``rope.scaling.factor`` divides the positions, as llama.cpp applies it whatever
the type. ``yarn`` and ``longrope`` are refused with one ``ModelError``.

Two layout traps, both handled here:

- GGUF matrices are stored ``(out, in)``; canonical (Keras) kernels are ``(in, out)``.
- llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` (and their biases) within
  each head from HF's rotary layout (first half, second half) to interleaved pairs, for
  ``llama`` only (the others use NEOX rotary, which is HF's halves). ``unpermute_rows`` undoes
  it: rows ``(n_heads, head_dim/2, 2)`` -> ``(n_heads, 2, head_dim/2)``. With the opposite
  direction SmolLM2 babbles; with this one it answers "The capital of France is Paris."
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np

from tfnb.errors import ModelError
from tfnb.models.decoder import LlamaConfig, weight_shapes
from tfnb.models.packed import QTYPES, FileRows, PackedTensor, held_nbytes
from tfnb.models.progress import Reporter, silent
from tfnb.models.tokenizer import Tokenizer, end_token_ids, tokenizer_from_gguf_fields
from tfnb.names import format_bytes

__all__ = ["read_gguf", "read_gguf_header", "unpermute_rows", "permute_rows",
           "SUPPORTED_ARCHITECTURES", "ROPE_SCALING_TYPES", "DequantizedWeightsWarning"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
ROPE_SCALING_TYPES = ("none", "linear")
# llama.cpp's converter permutes q/k rows for its llama rotary layout only; the others keep
# HF's halves (NEOX rotary). Mistral models convert as "llama".
_PERMUTED_ROPE = ("llama",)

_MODEL_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm",
                  "output.weight": "lm_head"}
# blk.N.<key> -> blocks.N.<canonical>, per architecture
_COMMON = {"attn_norm.weight": "attn_norm", "attn_output.weight": "wo",
           "ffn_norm.weight": "mlp_norm", "ffn_down.weight": "w_down"}
_QKV = {"attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv"}
_QKV_BIAS = {"attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv"}
_GATE_UP = {"ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up"}
_BLOCK_TENSORS = {
    "llama": {**_COMMON, **_QKV, **_QKV_BIAS, **_GATE_UP},
    "qwen2": {**_COMMON, **_QKV, **_QKV_BIAS, **_GATE_UP},
    "qwen3": {**_COMMON, **_QKV, **_GATE_UP, "attn_q_norm.weight": "q_norm",
              "attn_k_norm.weight": "k_norm"},
    # llama.cpp's phi3 reads attn_qkv, or else attn_q/k/v; its ffn_up is [gate; up]
    "phi3": {**_COMMON, **_QKV, "attn_qkv.weight": "wqkv", "ffn_up.weight": "w_gate_up"},
}
_POST_NORMS = {"post_attention_norm.weight": "post_attn_norm",
               "post_ffw_norm.weight": "post_mlp_norm"}
_BLOCK_TENSORS["gemma2"] = {**_COMMON, **_QKV, **_GATE_UP, **_POST_NORMS}
_BLOCK_TENSORS["gemma3"] = {**_BLOCK_TENSORS["gemma2"], "attn_q_norm.weight": "q_norm",
                            "attn_k_norm.weight": "k_norm"}
_QK_NORM = ("qwen3", "gemma3")
# llama.cpp's Gemma: (layer pattern, layer count of the 27B, whose attention scale is
# (hidden / heads) ** -0.5). Layer i slides unless i % pattern == pattern - 1.
_GEMMA = {"gemma2": (2, 46), "gemma3": (6, 62)}
# model-level rotary tensors: Llama 3's frequency factors, Phi-3's LongRoPE factors
_ROPE_TENSORS = {"llama": ("rope_freqs.weight",),
                 "phi3": ("rope_factors_long.weight", "rope_factors_short.weight")}
# a fused source tensor and the canonical matrices it holds, in row order
_FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


class DequantizedWeightsWarning(UserWarning):
    """Tensors of a type tfnb's packed kernels do not read were dequantized to float32 (more
    bytes on the devices than in the file)."""


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
                             f"expected a complete {arch} GGUF")
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
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is None:
        if hidden % n_heads:
            raise ModelError(f"GGUF metadata '{arch}.embedding_length'={hidden} in {path!r} is "
                             f"not divisible by '{arch}.attention.head_count'={n_heads} and "
                             f"'{arch}.attention.key_length' is absent: expected a multiple, or "
                             "the head width given")
        head_dim = hidden // n_heads
    head_dim = count("attention.key_length", head_dim)
    value_dim = count("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ModelError(f"GGUF metadata '{arch}.attention.value_length'={value_dim} in {path!r} "
                         f"differs from the key width {head_dim}: expected equal key and value "
                         "heads")
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise ModelError(f"GGUF metadata '{arch}.rope.dimension_count'={rope_dims!r} in {path!r} "
                         f"differs from head_dim={head_dim}: only full-head rotary embeddings "
                         "are supported")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling not in ROPE_SCALING_TYPES:
        raise ModelError(f"GGUF metadata '{arch}.rope.scaling.type'={scaling!r} in {path!r} is "
                         f"not supported: expected one of {list(ROPE_SCALING_TYPES)} (or none "
                         "given)")
    # llama.cpp divides positions by the factor whatever the type (0 or absent: 1)
    factor_key = next((k for k in ("rope.scaling.factor", "rope.scale_linear")
                       if f"{arch}.{k}" in meta), None)
    factor = 1.0
    if factor_key is not None and meta[f"{arch}.{factor_key}"] != 0:
        factor = number(factor_key, None)
    attn_factor = meta.get(f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None and attn_factor != 1:
        raise ModelError(f"GGUF metadata '{arch}.rope.scaling.attn_factor'={attn_factor!r} in "
                         f"{path!r} is not supported (LongRoPE/YaRN magnitude scaling): expected "
                         "1 or none given")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    if vocab == 0:
        raise ModelError(f"GGUF file {path!r} has neither '{arch}.vocab_size' nor "
                         "'tokenizer.ggml.tokens': expected a vocabulary")
    meta = {**meta, f"{arch}.vocab_size": vocab}
    # generation ends at any of llama.cpp's end tokens: by id (eos, eot, eom) and by name
    # (<end_of_turn>, <|end|>, ...), which files of Gemma and Phi-3 need
    eos = end_token_ids(meta)
    gemma = _gemma_fields(arch, hidden, n_heads, head_dim, count("block_count"), count,
                          number) if arch in _GEMMA else {}
    try:
        return LlamaConfig(
            vocab_size=count("vocab_size"),
            hidden_size=hidden,
            n_layers=count("block_count"),
            n_heads=n_heads,
            n_kv_heads=count("attention.head_count_kv", n_heads),
            ffn_size=count("feed_forward_length"),
            head_dim=head_dim,
            rope_theta=number("rope.freq_base", 10000.0),
            rope_scaling_factor=factor,
            norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5),
            max_context=count("context_length", 2048),
            tie_embeddings=True,  # fixed below from the tensor list
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_ids=eos,
            **gemma,
        )
    except ModelError as e:  # a relation between fields (e.g. KV heads that do not divide heads)
        raise ModelError(f"GGUF file {path!r}: {e}") from None


def _gemma_fields(arch: str, hidden: int, n_heads: int, head_dim: int, n_layers: int, count,
                  number) -> dict:
    """The ``LlamaConfig`` fields of a ``gemma2``/``gemma3`` file, as llama.cpp sets them
    (``count``/``number`` read ``{arch}.<key>`` metadata, with a default or required)."""
    pattern, n_layers_27b = _GEMMA[arch]
    window = count("attention.sliding_window", 4096 if arch == "gemma2" else None)
    # llama.cpp: n_embd / n_head in integers for the 27B, else the head width
    scale_dim = hidden // n_heads if n_layers == n_layers_27b else head_dim
    fields = dict(
        embed_scale=float(np.sqrt(np.float32(hidden))), mlp_act="gelu_tanh", post_norms=True,
        attn_scale=float(np.float32(1.0) / np.sqrt(np.float32(scale_dim))),
        sliding_window=window, sliding_pattern=pattern)
    if arch == "gemma2":
        fields.update(attn_softcap=number("attn_logit_softcapping", 50.0),
                      final_softcap=number("final_logit_softcapping", 30.0))
    else:
        fields.update(local_rope_theta=10000.0)
    return fields


def _canonical(gguf_name: str, arch: str) -> str | None:
    """The canonical name a tensor of ``arch`` becomes (a fused ``blocks.N.wqkv`` or
    ``w_gate_up`` is split later; a rotary tensor keeps its GGUF name), or None."""
    if gguf_name in _MODEL_TENSORS:
        return _MODEL_TENSORS[gguf_name]
    if gguf_name in _ROPE_TENSORS.get(arch, ()):
        return gguf_name
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() \
            and parts[2] in _BLOCK_TENSORS[arch]:
        return f"blocks.{int(parts[1])}.{_BLOCK_TENSORS[arch][parts[2]]}"
    return None


def _accepted(arch: str) -> str:
    """The tensor names ``arch`` accepts, for error messages."""
    block = ", ".join(k.removesuffix(".weight") for k in _BLOCK_TENSORS[arch])
    rope = "".join(f", {n}" for n in _ROPE_TENSORS.get(arch, ()))
    return f"token_embd, output_norm, output{rope} and blk.N.{{{block}}}"


def _gguf_name(name: str, arch: str) -> str:
    """A canonical block weight's GGUF name (the separate one where a fused one exists)."""
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "blocks":
        for key, short in _BLOCK_TENSORS[arch].items():
            if short == parts[2]:
                return f"blk.{parts[1]}.{key}"
        fused = next(f for f, members in _FUSED.items() if parts[2] in members)
        return _gguf_name(f"blocks.{parts[1]}.{fused}", arch)
    return next((k for k, v in _MODEL_TENSORS.items() if v == name), name)


def _parts(name: str) -> tuple[str, ...]:
    """The canonical weights a loaded tensor holds: itself, or a fused tensor's members."""
    prefix, _, short = name.rpartition(".")
    return tuple(f"{prefix}.{m}" for m in _FUSED[short]) if short in _FUSED else (name,)


def _split_columns(w, widths: list[int]) -> list:
    """A fused (in, out) kernel cut into kernels of ``widths`` outputs; a packed one by rows."""
    ends = np.cumsum(widths)
    if isinstance(w, PackedTensor):
        return [w.row_range(end - n, end) for n, end in zip(widths, ends)]
    return [np.ascontiguousarray(part) for part in np.split(w, ends[:-1], axis=1)]


def _rope_factors(reader, names: dict, config: LlamaConfig, path: str):
    """Llama 3's ``rope_freqs`` as a tuple (None when absent); ModelError for Phi-3's LongRoPE
    factors unless all ones (then they change nothing)."""
    from gguf.quants import dequantize

    factors = None
    for tensor in reader.tensors:
        if names[tensor.name] != tensor.name:  # not a rotary tensor
            continue
        try:
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float64)
        except (NotImplementedError, ValueError) as exc:
            raise ModelError(f"GGUF tensor {tensor.name} in {path!r} ({tensor.tensor_type.name}"
                             f") is unreadable ({exc}): expected F32 factors") from None
        if values.shape != (config.head_dim // 2,) or not np.all(values > 0):
            raise ModelError(f"GGUF tensor {tensor.name} in {path!r} has shape "
                             f"{list(values.shape)} (min {values.min(initial=0):g}): expected "
                             f"head_dim / 2 = {config.head_dim // 2} positive factors")
        if tensor.name == "rope_freqs.weight":
            factors = tuple(values.tolist())
        elif not np.all(values == 1.0):
            raise ModelError(f"GGUF tensor {tensor.name} in {path!r} holds LongRoPE factors "
                             "other than 1, which tfnb does not support yet: expected no "
                             "rope_factors_long/short tensors, or all ones")
    return factors


def _block_order(gguf_name: str) -> tuple:
    parts = gguf_name.split(".")
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1, gguf_name)


def _dequantize(tensor, config: LlamaConfig, name: str, permuted: bool) -> np.ndarray:
    """float32 canonical array of one GGUF tensor (transposed and un-permuted as needed)."""
    from gguf.quants import dequantize

    w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if np.may_share_memory(w, tensor.data):
        w = w.copy()  # F32 tensors come back as views of the read-only file map
    if permuted:
        w = _unpermuted(w[:, None], config, name)[:, 0] if w.ndim == 1 \
            else _unpermuted(w, config, name)
    if w.ndim == 1 or name == "embed":
        return np.ascontiguousarray(w)   # norms, biases (n,); embed is already (vocab, d)
    return np.ascontiguousarray(w.T)  # (out, in) -> (in, out)


def _unpermuted(rows, config: LlamaConfig, name: str):
    """The q/k rows (and biases) in HF's rotary order; permuting whole rows also works on
    packed bytes."""
    if name.endswith((".wq", ".bq")):
        return unpermute_rows(rows, config.n_heads)
    if name.endswith((".wk", ".bk")):
        return unpermute_rows(rows, config.n_kv_heads)
    return rows


def _packed(tensor, config: LlamaConfig, name: str, permuted: bool, reader, path: str):
    """A file-backed ``PackedTensor`` of one 2-D GGUF tensor in a type the kernels read (where
    its rows lie in the file, q/k rows taken in HF's rotary order), else None. Nothing is
    read."""
    qtype = QTYPES.get(tensor.tensor_type.name)
    if qtype is None or len(tensor.shape) != 2:
        return None
    cols, rows = (int(n) for n in tensor.shape)  # GGUF lists the fastest-varying axis first
    order = _unpermuted(np.arange(rows)[:, None], config, name)[:, 0] if permuted else None
    if order is not None and np.array_equal(order, np.arange(rows)):
        order = None
    part = FileRows(path, int(tensor.data_offset), rows, int(tensor.n_bytes) // rows, qtype,
                    order, reader.data)
    return PackedTensor((part,), qtype, cols, transposed=name != "embed")


def _open(path: str, report: Reporter = silent):
    """``(reader, metadata)`` of a GGUF file, its tensors checked to lie inside it; the file is
    memory-mapped and no tensor data is read."""
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
    return reader, meta


def _layout(reader, meta: dict, path: str, rope: bool = True):
    """``(config, expected, sources, permuted)`` of an opened file: its config, the canonical
    weights' shapes, GGUF tensor -> canonical name (a fused one split later) and whether q/k
    rows are permuted. ModelError for unsupported, missing or surplus tensors. ``rope=False``
    leaves Llama 3's rotary factors out of the config (reading them reads tensor data)."""
    config = _config(meta, path)
    arch = meta["general.architecture"]
    names = {t.name: _canonical(t.name, arch) for t in reader.tensors}
    unknown = sorted(n for n, c in names.items() if c is None)
    if unknown:
        raise ModelError(f"GGUF file {path!r} has tensors {unknown[:3]} that tfnb does not "
                         f"support for architecture {arch!r}: expected only {_accepted(arch)}")
    config = dataclasses.replace(
        config, tie_embeddings="output.weight" not in names,
        qkv_bias=any(c.endswith((".bq", ".bk", ".bv")) for c in names.values()),
        qk_norm=arch in _QK_NORM,
        rope_freq_factors=_rope_factors(reader, names, config, path) if rope else None)
    expected = weight_shapes(config)
    sources = {n: c for n, c in names.items() if c != n}  # the rotary tensors are read above
    extra = sorted((n for n, c in sources.items() if not set(_parts(c)) <= set(expected)),
                   key=_block_order)
    if extra:
        raise ModelError(f"GGUF file {path!r} has tensors {extra[:3]} beyond its "
                         f"'{arch}.block_count'={config.n_layers}: "
                         f"expected blocks blk.0 to blk.{config.n_layers - 1} only")
    held: dict[str, str] = {}  # canonical name -> the GGUF tensor holding it
    for gguf_name, c in sources.items():
        for part in _parts(c):
            if part in held:
                raise ModelError(f"GGUF file {path!r} has both {held[part]} and {gguf_name}, "
                                 f"which both hold {part!r}: expected one of them")
            held[part] = gguf_name
    missing = [n for n in expected if n not in held]
    if missing:
        raise ModelError(f"GGUF file {path!r} lacks tensors for {missing[:3]} "
                         f"({[_gguf_name(n, arch) for n in missing[:3]]}): expected a complete "
                         f"{arch} model: {_accepted(arch)}")
    return config, expected, sources, arch in _PERMUTED_ROPE


def read_gguf_header(path, packed: bool = True) -> tuple[LlamaConfig, dict, str]:
    """Config, bytes per canonical weight as tfnb would hold it, and name of a GGUF file, from
    its header and tensor table alone.

    The file is memory-mapped and none of its tensor data is read, so a 40 GB file costs
    about what its metadata does. Bytes are those :func:`read_gguf` would give the weights
    (:func:`tfnb.models.packed.held_nbytes`): with ``packed``, matrices in a type of
    ``QTYPES`` at their size in the file, everything else float32. The same checks of the
    architecture and tensors as :func:`read_gguf`, except the tokenizer and the rotary factors
    (``config.rope_freq_factors`` is None).

    Examples
    --------
    >>> config, nbytes, name = read_gguf_header("Llama-3.1-70B.Q4_K_M.gguf")  # doctest: +SKIP
    >>> config.n_layers, nbytes["blocks.0.wq"]  # doctest: +SKIP
    (80, 37748736)
    """
    path = os.fspath(path)
    reader, meta = _open(path)
    config, expected, sources, _ = _layout(reader, meta, path, rope=False)
    nbytes = {}
    for tensor in reader.tensors:
        if tensor.name not in sources:
            continue
        matrix = packed and len(tensor.shape) == 2
        for part in _parts(sources[tensor.name]):
            nbytes[part] = held_nbytes(tensor.tensor_type.name, int(tensor.shape[0]),
                                       int(np.prod(expected[part])), matrix)
    name = str(meta.get("general.name") or os.path.basename(path))
    del reader  # drops the file's memory map
    return config, {n: nbytes[n] for n in expected}, name


def read_gguf(path, report: Reporter = silent, packed: bool = True
              ) -> tuple[LlamaConfig, dict, Tokenizer, str]:
    """Config, canonical weights, tokenizer and name of a GGUF file of one of
    ``SUPPORTED_ARCHITECTURES``.

    With ``packed`` every matrix in a type of ``QTYPES`` stays a ``PackedTensor`` backed by the
    file (``FileRows``: nothing of it is read here, and a worker that sees the file reads its
    rows itself when the model is placed); vectors
    (norms) and other types become float32 arrays (the latter with one
    ``DequantizedWeightsWarning``).

    Raises one ``ModelError`` for a missing, truncated or corrupt file, an unsupported
    architecture, rope scaling, tensor, quantization or tokenizer, or a missing tensor, before
    any weight is read where it can.

    Examples
    --------
    >>> config, weights, tok, name = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
    >>> config.n_layers  # doctest: +SKIP
    30
    """
    path = os.path.abspath(os.fspath(path))
    reader, meta = _open(path, report)
    report(1, 1, "reading")
    config, expected, sources, permuted = _layout(reader, meta, path)
    try:  # before the weights: a file that cannot load fails in seconds
        tokenizer = tokenizer_from_gguf_fields(meta)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - tokenizers raises bare Exception
        raise ModelError(f"GGUF tokenizer metadata in {path!r} is unusable ({type(exc).__name__}: "
                         f"{str(exc)[:120]}): expected GPT-2 style tokens and merges") from None
    weights: dict = {}
    dequantized: dict[str, list[int]] = {}  # type -> [tensors, extra bytes] (packed loads)
    tensors = [t for t in reader.tensors if t.name in sources]
    stage = "reading weights" if packed else "dequantizing"
    report(0, len(tensors), stage)
    for i, tensor in enumerate(tensors):
        name = sources[tensor.name]
        try:
            w = ((packed and _packed(tensor, config, name, permuted, reader, path))
                 or _dequantize(tensor, config, name, permuted))
        except NotImplementedError as exc:
            raise ModelError(f"GGUF tensor {tensor.name} in {path!r} has type "
                             f"{tensor.tensor_type.name}, which gguf cannot dequantize ({exc}): "
                             "expected a common quantization (F32, F16, Q8_0, Q4_0, Q4_1, "
                             "K-quants)") from None
        except ValueError as exc:  # bytes that do not make whole rows of the declared shape
            raise ModelError(f"GGUF tensor {tensor.name} in {path!r} ({tensor.tensor_type.name}, "
                             f"shape {list(tensor.shape)}) is malformed ({exc}): expected a "
                             "complete .gguf file") from None
        parts = _parts(name)
        want = expected[name] if len(parts) == 1 else (
            expected[parts[0]][0], sum(expected[p][1] for p in parts))
        if w.shape != want:
            raise ModelError(f"GGUF tensor {tensor.name} in {path!r} has shape {w.shape} after "
                             f"conversion: expected {want}")
        if packed and tensor.tensor_type.name not in QTYPES:
            seen = dequantized.setdefault(tensor.tensor_type.name, [0, 0])
            seen[0] += 1
            seen[1] += max(0, int(np.prod(w.shape)) * 4 - int(tensor.n_bytes))
        pieces = [w] if len(parts) == 1 else _split_columns(w, [expected[p][1] for p in parts])
        weights.update(zip(parts, pieces))
        report(i + 1, len(tensors), stage)
    if dequantized:
        count = sum(n for n, _ in dequantized.values())
        extra_bytes = sum(b for _, b in dequantized.values())
        warnings.warn(DequantizedWeightsWarning(
            f"GGUF file {path!r}: {count} tensors of type{'s' * (len(dequantized) > 1)} "
            f"{', '.join(sorted(dequantized))} are not kept packed by tfnb's kernels (those "
            f"read {', '.join(QTYPES)}), so they were dequantized to float32: "
            f"{format_bytes(extra_bytes)} more than in the file"), stacklevel=3)
    model_name = meta.get("general.name") or os.path.basename(path)
    del reader  # packed weights keep the file's map (they read from it on demand)
    return config, {n: weights[n] for n in expected}, tokenizer, str(model_name)
