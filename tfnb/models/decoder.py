"""Llama-family decoder: config, canonical numpy weights, and conversion to/from HF TFMistral.

Canonical weights are float32 numpy arrays in Keras orientation, ``(in, out)``, with the q/k
projection columns already in Hugging Face's rotary layout (halves, not interleaved pairs)::

    embed                      (vocab, d)
    blocks.{i}.attn_norm       (d,)
    blocks.{i}.wq              (d, n_heads * hd)
    blocks.{i}.wk              (d, n_kv_heads * hd)
    blocks.{i}.wv              (d, n_kv_heads * hd)
    blocks.{i}.wo              (n_heads * hd, d)
    blocks.{i}.mlp_norm        (d,)
    blocks.{i}.w_gate          (d, ffn)
    blocks.{i}.w_up            (d, ffn)
    blocks.{i}.w_down          (ffn, d)
    final_norm                 (d,)
    lm_head                    (d, vocab)   only when ``tie_embeddings`` is False
    blocks.{i}.bq, bk, bv      (n_heads * hd,), (n_kv_heads * hd,) x 2   only with ``qkv_bias``
                               (Qwen2)
    blocks.{i}.q_norm, k_norm  (hd,) each: RMSNorm gains of every q and k head before rotary;
                               only with ``qk_norm`` (Qwen3, Gemma 3)
    blocks.{i}.post_attn_norm, post_mlp_norm  (d,) each: RMSNorm gains of the attention's and
                               the MLP's outputs before their residual adds; only with
                               ``post_norms`` (Gemma 2 and 3)

``hd`` is ``head_dim``: ``hidden_size // n_heads`` unless the model sets it (Qwen3-0.6B: hidden
1024, 16 heads of 128), so the attention's width ``n_heads * hd`` may differ from ``d``.
Rotary embeddings turn frequency ``i`` (of ``hd / 2``) by ``pos / rope_scaling_factor *
rope_theta ** (-2i / hd) / rope_freq_factors[i]``: Llama 3's ``rope_freqs`` and linear scaling.

Transformers has no TF Llama class; ``TFMistralForCausalLM`` with ``sliding_window=None`` computes
the same function, so it is the reference implementation here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tfnb.errors import ModelError

__all__ = [
    "LlamaConfig",
    "tiny_config",
    "random_weights",
    "weight_shapes",
    "to_hf",
    "from_hf",
    "hf_config",
    "config_from_hf",
    "weights_from_hf_variables",
]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and hyper-parameters of a llama-family decoder.

    Examples
    --------
    >>> cfg = LlamaConfig(vocab_size=96, hidden_size=64, n_layers=2, n_heads=4,
    ...                   n_kv_heads=2, ffn_size=128)
    >>> cfg.head_dim
    16
    """

    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_context: int = 2048
    tie_embeddings: bool = True
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    qkv_bias: bool = False  # Qwen2: the q, k and v projections add a bias
    # Width of one attention head; None: hidden_size // n_heads (set to that on creation)
    head_dim: int | None = None
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before rotary
    rope_scaling_factor: float = 1.0  # linear rope scaling: positions divided by it
    # Llama 3's rope_freqs: rotary frequency i divided by factor i (head_dim / 2 of them)
    rope_freq_factors: tuple[float, ...] | None = field(default=None, repr=False)
    # Gemma 2 / 3 (all off by default): token embeddings times ``embed_scale``; the MLP's gate
    # through ``mlp_act`` ("silu" or "gelu_tanh"); RMSNorms of the attention and MLP outputs
    # (``post_norms``); scores ``q.k * attn_scale`` (None: head_dim ** -0.5), soft-capped as
    # ``c * tanh(s / c)`` with ``c = attn_softcap`` (0: off), and the logits likewise with
    # ``final_softcap``.
    embed_scale: float = 1.0
    mlp_act: str = "silu"
    post_norms: bool = False
    attn_scale: float | None = None
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # Sliding-window layers (llama.cpp's set_swa_pattern): with ``sliding_window`` W > 0, layer
    # i slides when ``sliding_pattern`` is 0 or i % pattern < pattern - 1 (Gemma 2: 2, every
    # other layer; Gemma 3: 6, five in six): its query at position p sees keys at p - W < p' <=
    # p. They rotate with ``local_rope_theta`` and no rope scaling when it is set (Gemma 3),
    # else as the others. A pattern, not a list, so a config with fewer layers stays valid.
    sliding_window: int = 0
    sliding_pattern: int = 0
    local_rope_theta: float | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads",
                     "ffn_size", "max_context"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ModelError(f"LlamaConfig.{name}={value!r}: expected a positive integer")
        if self.head_dim is None:
            if self.hidden_size % self.n_heads:
                raise ModelError(f"LlamaConfig.hidden_size={self.hidden_size} is not divisible "
                                 f"by n_heads={self.n_heads}: expected a multiple, or head_dim "
                                 "given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)
        value = self.head_dim
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ModelError(f"LlamaConfig.head_dim={value!r}: expected a positive integer")
        object.__setattr__(self, "head_dim", int(value))
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"LlamaConfig.n_kv_heads={self.n_kv_heads} does not divide "
                             f"n_heads={self.n_heads}: expected a divisor")
        if self.head_dim % 2:
            raise ModelError(f"LlamaConfig head_dim={self.head_dim} is odd: "
                             "rotary embeddings need an even head_dim")
        if isinstance(self.rope_scaling_factor, bool) or not (
                isinstance(self.rope_scaling_factor, (int, float, np.number))
                and self.rope_scaling_factor > 0):
            raise ModelError(f"LlamaConfig.rope_scaling_factor={self.rope_scaling_factor!r}: "
                             "expected a positive number")
        object.__setattr__(self, "rope_scaling_factor", float(self.rope_scaling_factor))
        if self.rope_freq_factors is not None:
            factors = tuple(float(f) for f in np.asarray(self.rope_freq_factors).reshape(-1))
            if len(factors) != self.head_dim // 2 or not all(f > 0 for f in factors):
                raise ModelError(f"LlamaConfig.rope_freq_factors has {len(factors)} values "
                                 f"(min {min(factors, default=0):g}): expected head_dim / 2 = "
                                 f"{self.head_dim // 2} positive numbers")
            object.__setattr__(self, "rope_freq_factors", factors)
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
        if self.mlp_act not in MLP_ACTIVATIONS:
            raise ModelError(f"LlamaConfig.mlp_act={self.mlp_act!r}: expected one of "
                             f"{list(MLP_ACTIVATIONS)}")
        for name in ("embed_scale", "attn_scale", "attn_softcap", "final_softcap",
                     "local_rope_theta"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or \
                    value < 0 or (value == 0 and name in ("embed_scale", "attn_scale",
                                                          "local_rope_theta")):
                raise ModelError(f"LlamaConfig.{name}={value!r}: expected a positive number"
                                 + (" (or 0: off)" if "softcap" in name else ""))
            object.__setattr__(self, name, float(value))
        for name in ("sliding_window", "sliding_pattern"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise ModelError(f"LlamaConfig.{name}={value!r}: expected an integer >= 0")
            object.__setattr__(self, name, int(value))

    def window(self, i: int) -> int:
        """Layer ``i``'s sliding window in tokens (0: it sees every earlier token).

        Examples
        --------
        >>> cfg = tiny_config(n_layers=3, sliding_window=8, sliding_pattern=2)
        >>> [cfg.window(i) for i in range(3)]
        [8, 0, 8]
        """
        n = self.sliding_pattern
        return self.sliding_window if n == 0 or i % n < n - 1 else 0

    def rope_of(self, i: int) -> tuple[float, float]:
        """Layer ``i``'s rotary ``(theta, scaling factor)``: a sliding-window layer's own base
        and no scaling when ``local_rope_theta`` is set (Gemma 3), else the model's."""
        if self.local_rope_theta is not None and self.window(i):
            return self.local_rope_theta, 1.0
        return self.rope_theta, self.rope_scaling_factor


MLP_ACTIVATIONS = ("silu", "gelu_tanh")


def tiny_config(**overrides) -> LlamaConfig:
    """A small config for fast tests: vocab 96, hidden 64, 2 layers, 4 heads, 2 KV heads.

    Parameters
    ----------
    **overrides
        Any ``LlamaConfig`` field to change.

    Examples
    --------
    >>> tiny_config().n_layers
    2
    >>> tiny_config(n_layers=3).n_layers
    3
    """
    fields = dict(vocab_size=96, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  ffn_size=128, rope_theta=10000.0, norm_eps=1e-5, max_context=256,
                  tie_embeddings=True, bos_id=1, eos_ids=(2,), qkv_bias=False, head_dim=None,
                  qk_norm=False, rope_scaling_factor=1.0, rope_freq_factors=None,
                  embed_scale=1.0, mlp_act="silu", post_norms=False, attn_scale=None,
                  attn_softcap=0.0, final_softcap=0.0, sliding_window=0, sliding_pattern=0,
                  local_rope_theta=None)
    unknown = set(overrides) - set(fields)
    if unknown:
        raise ModelError(f"tiny_config got unknown field(s) {sorted(unknown)}: "
                         f"accepted are {sorted(fields)}")
    fields.update(overrides)
    return LlamaConfig(**fields)


def weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Canonical weight name -> shape, in block order.

    Examples
    --------
    >>> weight_shapes(tiny_config())["blocks.0.wk"]
    (64, 32)
    """
    d, hd, ffn = config.hidden_size, config.head_dim, config.ffn_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (config.vocab_size, d)}
    for i in range(config.n_layers):
        p = f"blocks.{i}."
        shapes.update({
            p + "attn_norm": (d,),
            p + "wq": (d, config.n_heads * hd),
            p + "wk": (d, config.n_kv_heads * hd),
            p + "wv": (d, config.n_kv_heads * hd),
            **({p + "bq": (config.n_heads * hd,), p + "bk": (config.n_kv_heads * hd,),
                p + "bv": (config.n_kv_heads * hd,)} if config.qkv_bias else {}),
            **({p + "q_norm": (hd,), p + "k_norm": (hd,)} if config.qk_norm else {}),
            p + "wo": (config.n_heads * hd, d),
            p + "mlp_norm": (d,),
            p + "w_gate": (d, ffn),
            p + "w_up": (d, ffn),
            p + "w_down": (ffn, d),
            **({p + "post_attn_norm": (d,), p + "post_mlp_norm": (d,)} if config.post_norms
               else {}),
        })
    shapes["final_norm"] = (d,)
    if not config.tie_embeddings:
        shapes["lm_head"] = (d, config.vocab_size)
    return shapes


def random_weights(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights whose logits are well spread (no ties among the top tokens).

    Matrices are drawn N(0, 1/fan_in) so activations keep unit scale through the blocks. The
    embedding (and an untied ``lm_head``) is N(0, 0.35^2): after the final RMSNorm the hidden
    state has norm ~sqrt(d), so logits have standard deviation ~0.35 sqrt(d) (~2.8 for d=64),
    spread enough that greedy decoding has no ties and sampling still varies. Norm gains are
    1 + N(0, 0.1^2).

    Examples
    --------
    >>> w = random_weights(tiny_config(), seed=0)
    >>> w["embed"].shape, w["embed"].dtype
    ((96, 64), dtype('float32'))
    """
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith((".bq", ".bk", ".bv")):
            w = 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name in ("embed", "lm_head"):
            w = 0.35 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[0])
        weights[name] = w.astype(np.float32)
    return weights


def hf_config(config: LlamaConfig):
    """The ``transformers.MistralConfig`` equivalent of ``config`` (``sliding_window=None``).

    Examples
    --------
    >>> hf_config(tiny_config()).num_key_value_heads
    2
    """
    from transformers import MistralConfig

    eos = list(config.eos_ids)
    return MistralConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_size,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_context,
        rms_norm_eps=config.norm_eps,
        rope_theta=float(config.rope_theta),
        tie_word_embeddings=config.tie_embeddings,
        sliding_window=None,
        bos_token_id=config.bos_id,
        eos_token_id=(eos[0] if len(eos) == 1 else eos) if eos else None,
        pad_token_id=eos[0] if eos else None,
    )


def config_from_hf(hf_cfg) -> LlamaConfig:
    """The ``LlamaConfig`` of a transformers Mistral/Llama config object.

    Examples
    --------
    >>> config_from_hf(hf_config(tiny_config())) == tiny_config()
    True
    """
    eos = hf_cfg.eos_token_id
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    hidden, heads = hf_cfg.hidden_size, hf_cfg.num_attention_heads
    head_dim = getattr(hf_cfg, "head_dim", None) or hidden // heads
    if head_dim != hidden // heads:
        raise ModelError(f"config head_dim={head_dim} differs from hidden_size // num_heads = "
                         f"{hidden // heads}: only head_dim == hidden_size // num_heads is "
                         "supported")
    return LlamaConfig(
        vocab_size=hf_cfg.vocab_size,
        hidden_size=hidden,
        n_layers=hf_cfg.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=getattr(hf_cfg, "num_key_value_heads", None) or heads,
        ffn_size=hf_cfg.intermediate_size,
        rope_theta=float(getattr(hf_cfg, "rope_theta", 10000.0)),
        norm_eps=float(hf_cfg.rms_norm_eps),
        max_context=hf_cfg.max_position_embeddings,
        tie_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
        bos_id=hf_cfg.bos_token_id,
        eos_ids=eos_ids,
    )


# HF variable path (after the model's own top-level scope) -> canonical name; {i} is the block.
_HF_BLOCK_NAMES = {
    "self_attn/q_proj/kernel:0": "wq",
    "self_attn/k_proj/kernel:0": "wk",
    "self_attn/v_proj/kernel:0": "wv",
    "self_attn/o_proj/kernel:0": "wo",
    "mlp/gate_proj/kernel:0": "w_gate",
    "mlp/up_proj/kernel:0": "w_up",
    "mlp/down_proj/kernel:0": "w_down",
    "input_layernorm/weight:0": "attn_norm",
    "post_attention_layernorm/weight:0": "mlp_norm",
}


def _canonical_name(hf_name: str) -> str | None:
    """Map a TFMistral variable name to a canonical name (``"lm_head"`` for the head kernel)."""
    if hf_name.endswith("lm_head/kernel:0"):
        return "lm_head"
    if "/model/" not in "/" + hf_name:
        return None
    tail = ("/" + hf_name).split("/model/", 1)[1]
    if tail == "embed_tokens/embeddings:0":
        return "embed"
    if tail == "norm/weight:0":
        return "final_norm"
    if tail.startswith("layers."):
        index, rest = tail[len("layers."):].split("/", 1)
        if rest in _HF_BLOCK_NAMES and index.isdigit():
            return f"blocks.{int(index)}.{_HF_BLOCK_NAMES[rest]}"
    return None


def weights_from_hf_variables(config: LlamaConfig, variables) -> dict[str, np.ndarray]:
    """Canonical float32 weights from TFMistral variables (anything with ``.name``/``.numpy()``).

    Examples
    --------
    >>> cfg = tiny_config()
    >>> w = weights_from_hf_variables(cfg, to_hf(cfg, random_weights(cfg)).weights)
    >>> sorted(w) == sorted(weight_shapes(cfg))
    True
    """
    expected = weight_shapes(config)
    weights: dict[str, np.ndarray] = {}
    for var in variables:
        name = _canonical_name(var.name)
        if name is None or (name == "lm_head" and config.tie_embeddings):
            continue  # a tied model's lm_head kernel is just embed.T
        weights[name] = np.asarray(var.numpy(), dtype=np.float32)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelError(f"HF model lacks weights {missing[:4]}{'...' if len(missing) > 4 else ''}:"
                         " expected a TFMistral-style causal LM")
    for name, shape in expected.items():
        if weights[name].shape != shape:
            raise ModelError(f"weight {name!r} has shape {weights[name].shape}: expected {shape}")
    return {name: weights[name] for name in expected}


def to_hf(config: LlamaConfig, weights: dict[str, np.ndarray]):
    """A built ``transformers.TFMistralForCausalLM`` holding ``weights``.

    When embeddings are tied, TF Mistral still owns an ``lm_head`` kernel; it is set to
    ``embed.T`` (a second copy of the embedding, in the HF model only).

    Examples
    --------
    >>> cfg = tiny_config()
    >>> model = to_hf(cfg, random_weights(cfg))
    >>> model(np.array([[1, 5, 7]])).logits.shape
    TensorShape([1, 3, 96])
    """
    from transformers import TFMistralForCausalLM

    if config.qkv_bias:
        raise ModelError("to_hf() builds a TFMistral, which has no q/k/v biases: a qkv_bias "
                         "(Qwen2) model runs in tfnb only")
    unlike = [what for what, differs in (
        ("per-head q/k norms (qk_norm)", config.qk_norm),
        ("rope scaling", config.rope_scaling_factor != 1.0),
        ("rope frequency factors", config.rope_freq_factors is not None),
        ("Gemma's embedding scale, GELU MLP, post-norms, attention scale or soft-capping",
         (config.embed_scale, config.mlp_act, config.post_norms, config.attn_scale,
          config.attn_softcap, config.final_softcap) != (1.0, "silu", False, None, 0.0, 0.0)),
        ("sliding-window layers", config.sliding_window > 0),
        ("head width other than hidden_size / n_heads",
         config.head_dim * config.n_heads != config.hidden_size)) if differs]
    if unlike:
        raise ModelError(f"to_hf() builds a TFMistral, which has no {', '.join(unlike)}: this "
                         "model runs in tfnb only")
    expected = weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelError(f"weights lack {missing[:4]}: expected every name of "
                         "weight_shapes(config)")
    model = TFMistralForCausalLM(hf_config(config))
    model(np.zeros((1, 1), dtype=np.int32))  # build every variable
    assigned = set()
    for var in model.weights:
        name = _canonical_name(var.name)
        if name is None:
            raise ModelError(f"unexpected TFMistral variable {var.name!r}: cannot map it")
        if name == "lm_head" and config.tie_embeddings:
            value = np.asarray(weights["embed"], np.float32).T
        else:
            value = np.asarray(weights[name], np.float32)  # packed weights dequantize here
        if tuple(var.shape) != value.shape:
            raise ModelError(f"weight {name!r} has shape {value.shape}: expected "
                             f"{tuple(var.shape)}")
        var.assign(value)
        assigned.add(name)
    assert assigned >= set(expected), sorted(set(expected) - assigned)
    return model


def from_hf(tf_model) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Config and canonical weights of a built TFMistral-style causal LM.

    Examples
    --------
    >>> cfg = tiny_config()
    >>> cfg2, w2 = from_hf(to_hf(cfg, random_weights(cfg)))
    >>> cfg2 == cfg
    True
    """
    config = config_from_hf(tf_model.config)
    if not tf_model.built or not tf_model.weights:
        tf_model(np.zeros((1, 1), dtype=np.int32))
    return config, weights_from_hf_variables(config, tf_model.weights)

