"""Llama forward math as pure TensorFlow functions (no variables, no devices).

Shape suffixes: ``B`` batch, ``T`` new tokens this call, ``S`` cache slots (static), ``D`` model
width, ``H`` query heads, ``K`` key/value heads, ``G = H // K`` query heads per KV head, ``E`` head
width, ``F`` MLP width, ``V`` vocabulary.

Sequences are **left-padded** into cache slots: row ``b`` holds ``pad_B[b]`` padding slots, then its
tokens. A token in slot ``s`` has rotary position ``s - pad_B[b]`` and may attend to slots
``pad_B[b] <= s' <= s``. The cache update is one ``dynamic_update_slice`` at the current slot, so
every function here compiles under XLA with static shapes.

Block parameters (``BlockParams``) use fused matrices: ``wqkv`` = ``[wq | wk | wv]`` (D, (H+2K)E)
and ``w_gate_up`` = ``[w_gate | w_up]`` (D, 2F), so one block step is four matmuls; ``H E`` may
differ from ``D`` (a model may set its head width: Qwen3). A matrix is a float32 (in, out)
tensor, or a ``Packed`` one (GGUF blocks, one row per output channel) that ``dense`` multiplies
with tfnb's packed-weight op (:mod:`tfnb.kernels`), which runs as an XLA custom call inside the
compiled segments like every other op here; a fused matrix whose parts are packed in types no
one of which holds the others is ``Stacked``, one matmul per part.

Layers may differ (Gemma 2/3): :class:`Layer` is one block's static spec (its sliding window
and rotary base and scale, from :func:`layer_of`); a call makes the rotary tables once per
distinct ``(theta, scale)`` and hands each block its own, so shapes stay static per segment.

Examples
--------
>>> x_BxTxD = tf.ones([1, 3, 8])
>>> rms_norm(x_BxTxD, tf.ones([8]), 1e-5).shape
TensorShape([1, 3, 8])
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

from tfnb import kernels
from tfnb.models.packed import fuse_rows
from tfnb.runtime import compact

__all__ = [
    "BlockParams", "Layer", "layer_of", "fuse_block", "rms_norm", "rope_tables", "rope_for",
    "ropes_for", "apply_rope", "positions", "prefill_mask", "decode_mask", "attention",
    "block_prefill", "block_decode", "embed", "embed_from_columns", "logits", "next_token",
    "dense", "Packed", "Stacked", "is_packed",
]

_MASKED = -1e9  # finite, so a row with every slot masked (padding queries) stays NaN-free


def _scoped(kind: str):
    """Run the function's ops under name scope ``kind``. XLA keeps name scopes in its ops'
    metadata, and the profiler reads a compiled op's kind from them (``tfnb.profiler.xplane``'s
    ``SCOPE_KINDS``: norm, rope, attention, kv_cache, sampling); matmuls are told by their
    op."""
    def wrap(fn):
        @functools.wraps(fn)
        def scoped(*args, **kwargs):
            with tf.name_scope(kind):
                return fn(*args, **kwargs)
        return scoped
    return wrap


class Packed(NamedTuple):
    """A packed matrix on a device: uint8 rows ``data`` (out, row bytes) of ggml type ``qtype``,
    ``cols`` inputs each. As a kernel it maps ``cols`` inputs to ``rows`` outputs; its
    ``activations`` route (``kernels.packed_matmul``) is the placement's choice."""
    data: object  # tf.Variable or tensor, uint8
    qtype: int
    cols: int
    activations: str = "float32"


class Stacked(NamedTuple):
    """Packed matrices side by side on a device (``PackedStack``): their outputs joined."""
    parts: tuple  # of Packed or compact.Compact


def is_packed(w) -> bool:
    """Whether ``w`` multiplies with tfnb's packed-weight kernel (so its device has tfnb's
    ops); a ``Compact`` matrix, or a ``Stacked`` of them, does not."""
    return isinstance(w, Packed) or (isinstance(w, Stacked) and isinstance(w.parts[0], Packed))


class BlockParams(NamedTuple):
    """One block's weights (tensors or variables), fused as described in the module docstring."""
    attn_norm: tf.Tensor  # (D,)
    wqkv: tf.Tensor       # (D, (H + 2K) E)
    wo: tf.Tensor         # (H E, D)
    mlp_norm: tf.Tensor   # (D,)
    w_gate_up: tf.Tensor  # (D, 2F)
    w_down: tf.Tensor     # (F, D)
    bqkv: tf.Tensor | None = None  # ((H + 2K) E,): Qwen2's q/k/v biases
    q_norm: tf.Tensor | None = None  # (E,): Qwen3's RMSNorm gain of each q head, before rotary
    k_norm: tf.Tensor | None = None  # (E,): the same for each k head
    post_attn_norm: tf.Tensor | None = None  # (D,): Gemma's RMSNorm of the attention output
    post_mlp_norm: tf.Tensor | None = None   # (D,): and of the MLP output, before each residual


class Layer(NamedTuple):
    """One block's static attention spec: its query sees the last ``window`` positions (0: all
    earlier ones), rotated with base ``theta`` and positions divided by ``scale``."""
    window: int
    theta: float
    scale: float


def layer_of(cfg, i: int) -> Layer:
    """Block ``i``'s :class:`Layer` (``LlamaConfig.window`` and ``rope_of``)."""
    return Layer(cfg.window(i), *cfg.rope_of(i))


def fuse_block(weights: dict, i: int) -> dict[str, np.ndarray]:
    """Numpy arrays of block ``i`` in ``BlockParams`` layout, from canonical weights.

    Examples
    --------
    >>> from tfnb.models.decoder import tiny_config, random_weights
    >>> fuse_block(random_weights(tiny_config()), 0)["wqkv"].shape
    (64, 128)
    """
    p = f"blocks.{i}."
    bias = {"bqkv": np.concatenate([weights[p + "bq"], weights[p + "bk"], weights[p + "bv"]])
            } if p + "bq" in weights else {}
    qk_norm = {"q_norm": weights[p + "q_norm"], "k_norm": weights[p + "k_norm"]
               } if p + "q_norm" in weights else {}
    post = {"post_attn_norm": weights[p + "post_attn_norm"],
            "post_mlp_norm": weights[p + "post_mlp_norm"]} if p + "post_attn_norm" in weights \
        else {}
    return {
        **bias,
        **qk_norm,
        **post,
        "attn_norm": weights[p + "attn_norm"],
        "wqkv": fuse_rows([weights[p + "wq"], weights[p + "wk"], weights[p + "wv"]]),
        "wo": weights[p + "wo"],
        "mlp_norm": weights[p + "mlp_norm"],
        "w_gate_up": fuse_rows([weights[p + "w_gate"], weights[p + "w_up"]]),
        "w_down": weights[p + "w_down"],
    }


# From this many rows of ``x`` on (a long prefill), a packed matrix is dequantized once and
# multiplied by XLA's dot: past roughly 800 rows that beats the packed kernel, which decodes the
# weights again for every few rows (crossover measured on SmolLM2's matrices: docs/runtime.md).
DEQUANTIZE_ROWS = 1024

# Rows nobody reads (a prompt's left padding, a lane's free rows) enter a packed model's
# matmuls as zeros, which the packed kernel skips (``kernels.packed_matmul``); the rows that
# are read compute exactly as before. Read when a step is traced.
SKIP_UNREAD_ROWS = True

# The op wrappers load (and may build) the op library: AutoGraph would try to convert that
# Python when a step is traced and warn that it cannot ("could not transform <function exists>").
_packed_matmul = tf.autograph.experimental.do_not_convert(kernels.packed_matmul)
_packed_dequantize = tf.autograph.experimental.do_not_convert(kernels.packed_dequantize)
_decode_attention = tf.autograph.experimental.do_not_convert(
    _scoped("attention")(kernels.decode_attention))


def matmul(x_NxD, w_DxC):
    """``x @ w`` for a 2-D ``x`` and a float32, ``Packed``, ``Compact`` (the XLA route:
    :mod:`tfnb.runtime.compact`) or ``Stacked`` kernel."""
    if isinstance(w_DxC, compact.Compact):
        return compact.matmul(x_NxD, w_DxC)
    if isinstance(w_DxC, Stacked):
        return tf.concat([matmul(x_NxD, part) for part in w_DxC.parts], axis=-1)
    if isinstance(w_DxC, Packed):
        if x_NxD.shape[0] >= DEQUANTIZE_ROWS:
            w_CxD = _packed_dequantize(w_DxC.data, w_DxC.qtype, w_DxC.cols)
            return tf.matmul(x_NxD, w_CxD, transpose_b=True)
        return _packed_matmul(x_NxD, w_DxC.data, w_DxC.qtype, w_DxC.cols, w_DxC.activations)
    return tf.matmul(x_NxD, w_DxC)


def dense(x_BxTxD, w_DxC):
    """``x @ w`` for a 3-D ``x``, as one 2-D matmul (a batched matmul would broadcast ``w``)."""
    B, T, D = x_BxTxD.shape
    y_NxC = matmul(tf.reshape(x_BxTxD, [B * T, D]), w_DxC)
    return tf.reshape(y_NxC, [B, T, y_NxC.shape[-1]])


@_scoped("norm")
def rms_norm(x_BxTxD, gain_D, eps):
    """``x / sqrt(mean(x^2) + eps) * gain``."""
    ms_BxTx1 = tf.reduce_mean(tf.square(x_BxTxD), axis=-1, keepdims=True)
    return gain_D * (x_BxTxD * tf.math.rsqrt(ms_BxTx1 + eps))


def positions(pad_B, first_slot, T):
    """Rotary position of the ``T`` slots from ``first_slot`` in each row: ``slot - pad``, >= 0."""
    slots_T = first_slot + tf.range(T, dtype=tf.int32)
    return tf.maximum(slots_T[None, :] - pad_B[:, None], 0)


@_scoped("rope")
def rope_tables(pos_BxT, head_dim, theta, scale=1.0, factors_E2=None):
    """cos and sin tables (B, T, E) for HF's rotate-half rotary layout (both halves of a head
    turn by the same angles, so each is computed once).

    Frequency ``i`` is ``theta ** (-2i / E) / factors_E2[i]``, and positions are divided by
    ``scale``: llama.cpp's ``freq_factors`` (Llama 3's ``rope_freqs``) and linear scaling
    (``freq_scale = 1 / scale``). ``factors_E2`` (E/2 floats, or None) becomes a constant."""
    inv_freq_E2 = 1.0 / (theta ** (tf.range(0, head_dim, 2, dtype=tf.float32) / head_dim))
    if factors_E2 is not None:
        inv_freq_E2 = inv_freq_E2 / tf.constant(factors_E2, tf.float32)
    if scale != 1.0:
        inv_freq_E2 = inv_freq_E2 * (1.0 / scale)
    angle_BxTxE2 = tf.cast(pos_BxT, tf.float32)[..., None] * inv_freq_E2
    cos_BxTxE2, sin_BxTxE2 = tf.cos(angle_BxTxE2), tf.sin(angle_BxTxE2)
    return (tf.concat([cos_BxTxE2, cos_BxTxE2], axis=-1),
            tf.concat([sin_BxTxE2, sin_BxTxE2], axis=-1))


def rope_for(pad_B, first_slot, T, cfg, layer: Layer | None = None):
    """The rotary tables of ``T`` slots from ``first_slot`` (:func:`positions`), which every
    block of a call with ``layer``'s base and scale shares (None: the model's). A call makes
    them once and hands them to each block: made inside each block, XLA would compute them
    again for every block (docs/runtime.md)."""
    theta, scale = (cfg.rope_theta, cfg.rope_scaling_factor) if layer is None \
        else (layer.theta, layer.scale)
    return rope_tables(positions(pad_B, first_slot, T), cfg.head_dim, theta, scale,
                       cfg.rope_freq_factors)


def ropes_for(pad_B, first_slot, T, cfg, layers) -> dict:
    """:func:`rope_for`'s tables per distinct ``(theta, scale)`` of ``layers``."""
    return {(ly.theta, ly.scale): rope_for(pad_B, first_slot, T, cfg, ly) for ly in layers}


@_scoped("rope")
def apply_rope(x_BxTxNxE, cos_BxTxE, sin_BxTxE):
    """Rotate each head: ``x cos + rotate_half(x) sin``, ``rotate_half([a, b]) = [-b, a]``."""
    a, b = tf.split(x_BxTxNxE, 2, axis=-1)
    rotated_BxTxNxE = tf.concat([-b, a], axis=-1)
    return x_BxTxNxE * cos_BxTxE[:, :, None] + rotated_BxTxNxE * sin_BxTxE[:, :, None]


def prefill_mask(pad_B, T, window: int = 0):
    """(B, T, T) bool: query slot q may see key slot s when ``pad <= s <= q`` (and, with a
    sliding ``window``, ``q - s < window``: llama.cpp's standard window)."""
    s_T = tf.range(T, dtype=tf.int32)
    causal_TxT = s_T[None, :] <= s_T[:, None]
    if window:
        causal_TxT &= s_T[:, None] - s_T[None, :] < window
    real_BxT = s_T[None, :] >= pad_B[:, None]
    return causal_TxT[None] & real_BxT[:, None, :]


def decode_mask(pad_B, slot, S, window: int = 0):
    """(B, 1, S) bool: the token in ``slot`` may see key slots ``pad <= s <= slot`` (and
    ``slot - s < window`` with a sliding ``window``)."""
    s_S = tf.range(S, dtype=tf.int32)
    first_B = _window_pad(pad_B, slot, window)
    return ((s_S[None, :] >= first_B[:, None]) & (s_S[None, :] <= slot))[:, None, :]


def _window_pad(pad_B, slot, window: int):
    """The first slot each row's token in ``slot`` sees: ``pad``, or with a sliding
    ``window`` the later of it and ``slot - window + 1`` (a slot's distance is its position's:
    a row's tokens fill consecutive slots). A free row (pad past the slot) stays past it."""
    return pad_B if not window else tf.maximum(pad_B, slot - window + 1)


@_scoped("attention")
def attention(q_BxTxHxE, k_BxKxSxE, v_BxKxSxE, mask_BxTxS, scale=None, softcap=0.0):
    """Grouped-query attention; query head ``h`` reads KV head ``h // G`` (as HF ``repeat_kv``).
    Scores are ``q.k * scale`` (None: ``E ** -0.5``), then ``softcap * tanh(s / softcap)``
    when ``softcap`` (Gemma 2)."""
    B, T, H, E = q_BxTxHxE.shape
    K = k_BxKxSxE.shape[1]
    q_BxKxGxTxE = tf.transpose(tf.reshape(q_BxTxHxE, [B, T, K, H // K, E]), [0, 2, 3, 1, 4])
    scale = E ** -0.5 if scale is None else scale
    scores_BxKxGxTxS = tf.einsum("bkgte,bkse->bkgts", q_BxKxGxTxE, k_BxKxSxE) * scale
    if softcap:
        scores_BxKxGxTxS = softcap * tf.tanh(scores_BxKxGxTxS * (1.0 / softcap))
    scores_BxKxGxTxS = tf.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS, _MASKED)
    probs_BxKxGxTxS = tf.nn.softmax(scores_BxKxGxTxS, axis=-1)
    out_BxKxGxTxE = tf.einsum("bkgts,bkse->bkgte", probs_BxKxGxTxS, v_BxKxSxE)
    return tf.reshape(tf.transpose(out_BxKxGxTxE, [0, 3, 1, 2, 4]), [B, T, H * E])


@_scoped("kv_cache")
def _write_cache(cache_BxKxSxE, new_BxKxTxE, first_slot, first_row=0) -> None:
    """Store ``new`` in cache slots ``[first_slot, first_slot + T)`` of rows ``[first_row,
    first_row + B)`` (in place under XLA)."""
    zero = tf.zeros([], tf.int32)
    at = tf.stack([tf.convert_to_tensor(first_row, tf.int32), zero,
                   tf.convert_to_tensor(first_slot, tf.int32), zero])
    cache_BxKxSxE.assign(xla.dynamic_update_slice(cache_BxKxSxE, new_BxKxTxE, at))


def _rope_qkv(qkv_BxTxC, p: BlockParams, pad_B, first_slot, cfg, rope=None, layer=None):
    """The fused projection (plus its bias) split into rotated q (B,T,H,E) and k, v as
    (B,K,T,E); with ``p.q_norm`` (Qwen3) each q and k head is RMS-normed first. ``rope`` is
    :func:`rope_for`'s tables of these slots, made here if None."""
    if p.bqkv is not None:
        qkv_BxTxC = qkv_BxTxC + p.bqkv
    B, T, _ = qkv_BxTxC.shape
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k, v = tf.split(qkv_BxTxC, [H * E, K * E, K * E], axis=-1)
    q_BxTxHxE, k_BxTxKxE = tf.reshape(q, [B, T, H, E]), tf.reshape(k, [B, T, K, E])
    if p.q_norm is not None:
        q_BxTxHxE = rms_norm(q_BxTxHxE, p.q_norm, cfg.norm_eps)
        k_BxTxKxE = rms_norm(k_BxTxKxE, p.k_norm, cfg.norm_eps)
    cos_BxTxE, sin_BxTxE = rope if rope is not None else rope_for(pad_B, first_slot, T, cfg,
                                                                  layer)
    q_BxTxHxE = apply_rope(q_BxTxHxE, cos_BxTxE, sin_BxTxE)
    k_BxTxKxE = apply_rope(k_BxTxKxE, cos_BxTxE, sin_BxTxE)
    k_BxKxTxE = tf.transpose(k_BxTxKxE, [0, 2, 1, 3])
    v_BxKxTxE = tf.transpose(tf.reshape(v, [B, T, K, E]), [0, 2, 1, 3])
    return q_BxTxHxE, k_BxKxTxE, v_BxKxTxE


def _add_norm(x_BxTxD, y_BxTxD, gain_D, eps):
    """``(x + y, rms_norm(x + y))``: a residual and the next norm."""
    x_BxTxD = x_BxTxD + y_BxTxD
    return x_BxTxD, rms_norm(x_BxTxD, gain_D, eps)


def _gated(gate_up_BxTx2F, act: str):
    """``act(gate) * up``: SwiGLU (``"silu"``) or Gemma's GELU with the tanh approximation
    (``"gelu_tanh"``, ggml's ``gelu``)."""
    gate_BxTxF, up_BxTxF = tf.split(gate_up_BxTx2F, 2, axis=-1)
    if act == "gelu_tanh":
        return tf.nn.gelu(gate_BxTxF, approximate=True) * up_BxTxF
    return tf.nn.silu(gate_BxTxF) * up_BxTxF


def _read_rows(p: BlockParams, read_BxT):
    """``(B, T, 1)`` float32: 1 for rows that are read, 0 for the others, when a packed block
    skips the others (:data:`SKIP_UNREAD_ROWS`); else None."""
    if not (SKIP_UNREAD_ROWS and is_packed(p.wqkv)):
        return None
    return tf.cast(read_BxT, tf.float32)[..., None]


def _zero_unread(x_BxTxC, read_BxTx1):
    """``x`` with the rows nobody reads zeroed (the packed matmul then skips them)."""
    return x_BxTxC if read_BxTx1 is None else x_BxTxC * read_BxTx1


def _mlp_residual(x_BxTxD, attn_BxTxHE, p: BlockParams, cfg, read_BxTx1=None):
    """The attention's output projection and residual, then the MLP's; with post-norms
    (Gemma) each output is RMS-normed before its residual add."""
    o_BxTxD = dense(_zero_unread(attn_BxTxHE, read_BxTx1), p.wo)
    if p.post_attn_norm is not None:
        o_BxTxD = rms_norm(o_BxTxD, p.post_attn_norm, cfg.norm_eps)
    x_BxTxD, h_BxTxD = _add_norm(x_BxTxD, o_BxTxD, p.mlp_norm, cfg.norm_eps)
    h_BxTxD = _zero_unread(h_BxTxD, read_BxTx1)
    y_BxTxD = dense(_gated(dense(h_BxTxD, p.w_gate_up), cfg.mlp_act), p.w_down)
    if p.post_mlp_norm is not None:
        y_BxTxD = rms_norm(y_BxTxD, p.post_mlp_norm, cfg.norm_eps)
    return x_BxTxD + y_BxTxD


def block_prefill(x_BxTxD, p: BlockParams, cache_k, cache_v, pad_B, cfg, first_slot=0,
                  first_row=0, rope=None, layer: Layer | None = None):
    """One block over a whole left-padded prompt (``pad_B`` counts its padding): returns its
    output and writes its keys and values to slots ``[first_slot, first_slot + T)`` of cache
    rows ``[first_row, first_row + B)`` (attention itself only reads the ``T`` new keys, so a
    prompt may join rows that are already decoding at a later slot). ``layer`` is the block's
    :class:`Layer` (None: global, the model's rotary); ``rope`` its tables."""
    window = layer.window if layer is not None else 0
    # the padding's queries see no key: their rows are read by no one, so they may be zeros
    read_BxTx1 = _read_rows(p, tf.range(x_BxTxD.shape[1])[None, :] >= pad_B[:, None])
    h_BxTxD = _zero_unread(rms_norm(x_BxTxD, p.attn_norm, cfg.norm_eps), read_BxTx1)
    q_BxTxHxE, k_BxKxTxE, v_BxKxTxE = _rope_qkv(dense(h_BxTxD, p.wqkv), p, pad_B, 0, cfg,
                                                rope, layer)
    _write_cache(cache_k, k_BxKxTxE, first_slot, first_row)
    _write_cache(cache_v, v_BxKxTxE, first_slot, first_row)
    attn_BxTxHE = attention(q_BxTxHxE, k_BxKxTxE, v_BxKxTxE,
                            prefill_mask(pad_B, x_BxTxD.shape[1], window), cfg.attn_scale,
                            cfg.attn_softcap)
    return _mlp_residual(x_BxTxD, attn_BxTxHE, p, cfg, read_BxTx1)


def block_decode(x_Bx1xD, p: BlockParams, cache_k, cache_v, pad_B, slot, cfg, window=None,
                 rope=None, layer: Layer | None = None):
    """One block for one new token per row: returns its output and writes the token's key and
    value into cache ``slot`` (an int32 scalar) of the cache variables.

    The ``B`` rows are the cache's first ``B`` (a cache may hold more rows than are busy), and
    attention reads only its first ``window`` slots (static; default all), which must cover
    ``slot``. ``layer`` is the block's :class:`Layer` (None: global, the model's rotary): a
    sliding-window layer sees only the last ``layer.window`` slots up to ``slot``."""
    sliding = layer.window if layer is not None else 0
    # a free row (pad past the slot: it sees nothing) is read by no one
    read_Bx1x1 = _read_rows(p, (pad_B <= slot)[:, None])
    h_Bx1xD = _zero_unread(rms_norm(x_Bx1xD, p.attn_norm, cfg.norm_eps), read_Bx1x1)
    q_Bx1xHxE, k_BxKx1xE, v_BxKx1xE = _rope_qkv(dense(h_Bx1xD, p.wqkv), p, pad_B, slot, cfg,
                                                    rope, layer)
    _write_cache(cache_k, k_BxKx1xE, slot)
    _write_cache(cache_v, v_BxKx1xE, slot)
    B, S = x_Bx1xD.shape[0], window or cache_k.shape[2]
    if is_packed(p.wqkv) and not cfg.attn_softcap:
        # tfnb's ops are on this device (its route is the kernel: weights.packed_routes): attention
        # reads the caches in place instead of gathering the window (tfnb/kernels/attention.cc;
        # docs/runtime.md); float32 models keep the plain TF ops below. The op scales by
        # E ** -0.5 and reads slots pad..slot: another scale is folded into q, and a sliding
        # window raises each row's first slot. It has no soft-capping (Gemma 2): those models
        # take the TF ops below.
        q_BxHxE = q_Bx1xHxE[:, 0]
        ratio = 1.0 if cfg.attn_scale is None else cfg.attn_scale * cfg.head_dim ** 0.5
        if ratio != 1.0:
            q_BxHxE = q_BxHxE * ratio
        attn_BxHE = _decode_attention(q_BxHxE, cache_k.read_value(), cache_v.read_value(),
                                      _window_pad(pad_B, slot, sliding), slot, S)
        return _mlp_residual(x_Bx1xD, attn_BxHE[:, None], p, cfg, read_Bx1x1)
    # The rows are gathered, not sliced: on TF 2.21's XLA:CPU, reading rows [:B] of the updated
    # cache makes XLA copy every cache in full each step for any 1 < B; a gather does not.
    with tf.name_scope("kv_cache"):
        rows_B = tf.range(B)
        k_BxKxSxE = tf.gather(cache_k.read_value()[:, :, :S], rows_B)
        v_BxKxSxE = tf.gather(cache_v.read_value()[:, :, :S], rows_B)
    attn_Bx1xHE = attention(q_Bx1xHxE, k_BxKxSxE, v_BxKxSxE,
                            decode_mask(pad_B, slot, k_BxKxSxE.shape[2], sliding),
                            cfg.attn_scale, cfg.attn_softcap)
    return _mlp_residual(x_Bx1xD, attn_Bx1xHE, p, cfg, read_Bx1x1)


def embed(ids_BxT, table_VxD):
    """Token embeddings (B, T, D); a ``Packed`` or ``Compact`` table has one row per token."""
    if isinstance(table_VxD, compact.Compact):
        x_NxD = compact.gather_rows(table_VxD, tf.reshape(ids_BxT, [-1]))
        return tf.reshape(x_NxD, [ids_BxT.shape[0], ids_BxT.shape[1], table_VxD.cols])
    if isinstance(table_VxD, Packed):
        # gather from the read value: gathering from the variable itself (ResourceGather) would
        # switch it to copy-on-read, and every later read (the head's matmul) would copy it
        rows_NxR = tf.gather(tf.convert_to_tensor(table_VxD.data), tf.reshape(ids_BxT, [-1]))
        x_NxD = _packed_dequantize(rows_NxR, table_VxD.qtype, table_VxD.cols)
        return tf.reshape(x_NxD, [ids_BxT.shape[0], ids_BxT.shape[1], table_VxD.cols])
    return tf.gather(table_VxD, ids_BxT)


def embed_from_columns(ids_BxT, table_DxV):
    """Token embeddings (B, T, D) from the tied head's matrix: a transposed float table, or the
    packed table itself (its rows are the tokens either way)."""
    if isinstance(table_DxV, (Packed, compact.Compact)):
        return embed(ids_BxT, table_DxV)
    return tf.transpose(tf.gather(table_DxV, ids_BxT, axis=1), [1, 2, 0])


def logits(h_BxD, final_norm_D, out_DxV, cfg):
    """Logits (B, V) (or (B, T, V)); ``out_DxV`` is ``lm_head``, or ``embed.T`` when tied.
    With ``cfg.final_softcap`` (Gemma 2) they are ``c * tanh(logits / c)``."""
    h_BxD = rms_norm(h_BxD, final_norm_D, cfg.norm_eps)
    out_BxV = dense(h_BxD, out_DxV) if len(h_BxD.shape) == 3 else matmul(h_BxD, out_DxV)
    if cfg.final_softcap:
        out_BxV = cfg.final_softcap * tf.tanh(out_BxV * (1.0 / cfg.final_softcap))
    return out_BxV


@_scoped("sampling")
def next_token(logits_BxV, mode, temperature_B, top_k_B, top_p_B, seeds_Bx2):
    """The next token (B,) int32: ``argmax`` when ``mode == "greedy"``, else a sample per row.

    ``mode`` is static: ``"greedy"``, ``"sample"`` (temperature only) or ``"filter"``
    (temperature, then top-k, then top-p over the renormalised top-k, as HF's warpers). The
    settings are per row: ``temperature_B``/``top_p_B`` float32, ``top_k_B`` int32 (0: off); a
    row with temperature 0 is greedy, so requests of any settings share one batch.
    ``seeds_Bx2`` is each row's stateless-random seed pair for this step (the request's seed
    and the token's position), so a row samples the same tokens in any batch and chunking.
    Sampling uses the Gumbel-max trick.
    """
    greedy_B = tf.argmax(logits_BxV, axis=-1, output_type=tf.int32)
    if mode == "greedy":
        return greedy_B
    x_BxV = logits_BxV / tf.maximum(temperature_B, 1e-6)[:, None]
    if mode == "filter":
        V = x_BxV.shape[-1]
        sorted_BxV = tf.sort(x_BxV, axis=-1, direction="DESCENDING")
        rank_V = tf.range(V, dtype=tf.int32)
        k_B = tf.where(top_k_B > 0, tf.minimum(top_k_B, V), V)
        in_top_k_BxV = rank_V[None, :] < k_B[:, None]
        probs_BxV = tf.nn.softmax(tf.where(in_top_k_BxV, sorted_BxV, -np.inf), axis=-1)
        before_BxV = tf.cumsum(probs_BxV, axis=-1, exclusive=True)
        keep_BxV = in_top_k_BxV & (before_BxV < top_p_B[:, None])
        threshold_Bx1 = tf.reduce_min(tf.where(keep_BxV, sorted_BxV, np.inf), -1, keepdims=True)
        x_BxV = tf.where(x_BxV >= threshold_Bx1, x_BxV, -np.inf)
    V = x_BxV.shape[-1]
    u_BxV = tf.stack([tf.random.stateless_uniform([V], seed=seeds_Bx2[b], minval=1e-20,
                                                  maxval=1.0)
                      for b in range(x_BxV.shape[0])])
    gumbel_BxV = -tf.math.log(-tf.math.log(u_BxV))
    sampled_B = tf.argmax(x_BxV + gumbel_BxV, axis=-1, output_type=tf.int32)
    return tf.where(temperature_B > 0, sampled_B, greedy_B)
