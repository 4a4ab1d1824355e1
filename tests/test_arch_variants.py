"""GGUF architectures and variants (Llama 3 rope_freqs, linear rope scaling, a head width of its
own, Qwen3, Phi-3): tiny files written with gguf's writer in llama.cpp's layout, loaded and run
on the session's workers, against a numpy forward pass written here from llama.cpp's
definitions (src/models/llama.cpp, qwen3.cpp, phi3.cpp; ggml's rope), which reads the file's
tensors as llama.cpp does: (out, in) matrices, llama's q/k rows in interleaved rotary pairs
(NORM rotary), the others' in halves (NEOX rotary), Phi-3's fused q|k|v and gate|up rows."""
import warnings

import numpy as np
import pytest

import tfnb
from tfnb.errors import ModelError
from tfnb.models import decoder
from tfnb.models.gguf_io import DequantizedWeightsWarning
from tfnb.models.packed import QTYPES, PackedTensor

from tests.test_models import add_tiny_metadata

gguf = pytest.importorskip("gguf")

# long enough that rotary scaling moves every frequency by a visible angle
IDS = [1, 7, 30, 5, 61, 12, 44, 3, 19, 70, 8, 25, 52, 11, 90, 33, 6, 48, 27, 81, 14, 66, 9, 40]

# name -> (architecture, hyper-parameters, extra metadata, extra tensors)
VARIANTS = {
    # Llama 3: rope_freqs divides each rotary frequency; its own output matrix
    "llama3": ("llama", dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96,
                             theta=500000.0, tied=False, rope_freqs=True), {}),
    # linear rope scaling: positions divided by 4
    "llama-linear": ("llama", dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96,
                                   theta=10000.0, tied=True, rope_freqs=False),
                     {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}),
    # attention.key_length: 4 heads of 24 (96 wide) on a 64-wide model
    "llama-head-dim": ("llama", dict(hidden=64, heads=4, kv_heads=2, head_dim=24, ffn=96,
                                     theta=10000.0, tied=True, rope_freqs=False), {}),
    # q/k/v biases on llama (llama.cpp reads them if present): q/k's permuted like their rows
    "llama-bias": ("llama", dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96,
                                 theta=10000.0, tied=True, rope_freqs=False, bias=True), {}),
    # Qwen3: q/k RMSNorm per head, NEOX rotary, its own head width (as Qwen3-0.6B)
    "qwen3": ("qwen3", dict(hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=96,
                            theta=1000000.0, tied=True, rope_freqs=False), {}),
    # Phi-3: fused attn_qkv and ffn_up = [gate; up], NEOX rotary, all-ones LongRoPE factors
    "phi3": ("phi3", dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96,
                          theta=10000.0, tied=False, rope_freqs=False), {}),
}


# ---------------------------------------------------------------- the files


def make_tensors(arch: str, hp: dict, n_layers: int = 2, vocab: int = 96, seed: int = 0):
    """Random tensors by GGUF name, in the file's layout: matrices (out, in), N(0, 1/in)."""
    rng = np.random.default_rng(seed)
    d, H, K, E, F = hp["hidden"], hp["heads"], hp["kv_heads"], hp["head_dim"], hp["ffn"]

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def gain(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": (0.35 * rng.standard_normal((vocab, d))).astype(np.float32)}
    for i in range(n_layers):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = gain(d)
        if arch == "phi3":
            t[b + "attn_qkv.weight"] = matrix((H + 2 * K) * E, d)
        else:
            t[b + "attn_q.weight"] = matrix(H * E, d)
            t[b + "attn_k.weight"] = matrix(K * E, d)
            t[b + "attn_v.weight"] = matrix(K * E, d)
        if hp.get("bias"):
            for n, rows in (("q", H * E), ("k", K * E), ("v", K * E)):
                t[b + f"attn_{n}.bias"] = (0.3 * rng.standard_normal(rows)).astype(np.float32)
        if arch == "qwen3":
            t[b + "attn_q_norm.weight"] = gain(E)
            t[b + "attn_k_norm.weight"] = gain(E)
        t[b + "attn_output.weight"] = matrix(d, H * E)
        t[b + "ffn_norm.weight"] = gain(d)
        if arch == "phi3":
            t[b + "ffn_up.weight"] = matrix(2 * F, d)
        else:
            t[b + "ffn_gate.weight"] = matrix(F, d)
            t[b + "ffn_up.weight"] = matrix(F, d)
        t[b + "ffn_down.weight"] = matrix(d, F)
    t["output_norm.weight"] = gain(d)
    if not hp["tied"]:
        t["output.weight"] = (0.35 * rng.standard_normal((vocab, d))).astype(np.float32)
    if hp["rope_freqs"]:  # Llama 3's factors run from 1 (high frequencies) to 8 (low ones)
        t["rope_freqs.weight"] = np.geomspace(1.0, 8.0, E // 2).astype(np.float32)
    if arch == "phi3":
        t["rope_factors_long.weight"] = np.ones(E // 2, np.float32)
        t["rope_factors_short.weight"] = np.ones(E // 2, np.float32)
    return t


def write_gguf(path, arch: str, hp: dict, meta: dict, tensors: dict, n_layers: int = 2,
               qtypes: dict | None = None, eot: int | None = None):
    """A GGUF file as llama.cpp's converter writes one; ``meta`` adds ``{arch}.<key>``
    metadata, ``qtypes`` stores some tensors (by name) in a quantized type, ``eot`` is an
    end-of-turn token."""
    config = decoder.LlamaConfig(vocab_size=96, hidden_size=hp["hidden"], n_layers=n_layers,
                                 n_heads=hp["heads"], n_kv_heads=hp["kv_heads"],
                                 ffn_size=hp["ffn"], rope_theta=hp["theta"], norm_eps=1e-5,
                                 max_context=256, head_dim=hp["head_dim"])
    writer = gguf.GGUFWriter(str(path), arch)
    add_tiny_metadata(writer, config, f"tiny-{arch}")
    if eot is not None:
        writer.add_eot_token_id(eot)
    if hp["head_dim"] * hp["heads"] != hp["hidden"]:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    for key, value in meta.items():
        full = f"{arch}.{key}"
        if isinstance(value, str):
            writer.add_string(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)
    for name, value in tensors.items():
        qtype = (qtypes or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(value))
        elif qtype == "IQ4_NL":  # gguf cannot quantize it: blocks of a scale and 32 nibbles
            rows, cols = value.shape
            blocks = np.zeros((rows, cols // 32, 18), np.uint8)
            blocks[..., :2] = np.full((rows, cols // 32, 1), 0.002, np.float16).view(np.uint8)
            blocks[..., 2:] = np.random.default_rng(0).integers(0, 256, (rows, cols // 32, 16))
            writer.add_tensor(name, blocks.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType
                              .IQ4_NL)
        else:
            qt = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(value), qt),
                              raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------- the reference


def rms_norm(x, gain, eps=1e-5):
    return gain * x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)


def rope(x_TxNxE, pos_T, base, neox, freq_scale=1.0, factors=None):
    """ggml_rope_ext: pair j turns by ``pos * freq_scale * base^(-2j/E) / factors[j]``; NORM
    pairs are (x[2j], x[2j+1]), NEOX pairs (x[j], x[j + E/2])."""
    E = x_TxNxE.shape[-1]
    j = np.arange(E // 2)
    theta = pos_T[:, None] * base ** (-2.0 * j / E)
    if factors is not None:
        theta = theta / factors
    theta = (freq_scale * theta)[:, None, :]  # (T, 1, E/2)
    first, second = (j, j + E // 2) if neox else (2 * j, 2 * j + 1)
    x0, x1 = x_TxNxE[..., first], x_TxNxE[..., second]
    out = np.empty_like(x_TxNxE)
    out[..., first] = x0 * np.cos(theta) - x1 * np.sin(theta)
    out[..., second] = x0 * np.sin(theta) + x1 * np.cos(theta)
    return out


def reference_logits(arch, hp, meta, t, ids, n_layers=2, scaled=True):
    """Logits (T, V) as llama.cpp computes them from the file's tensors ``t`` (float64).
    ``scaled=False`` drops rope scaling and rope_freqs (to show that they matter here)."""
    T, H, K, E = len(ids), hp["heads"], hp["kv_heads"], hp["head_dim"]
    neox = arch != "llama"  # llama.cpp: LLAMA_ROPE_TYPE_NORM for llama, NEOX for the others
    freq_scale = 1.0 / meta.get("rope.scaling.factor", 1.0) if scaled else 1.0
    factors = t.get("rope_freqs.weight") if scaled else None
    pos = np.arange(T, dtype=np.float64)
    t = {n: np.asarray(v, np.float64) for n, v in t.items()}
    x = t["token_embd.weight"][ids]
    for i in range(n_layers):
        b = f"blk.{i}."
        h = rms_norm(x, t[b + "attn_norm.weight"])
        if b + "attn_qkv.weight" in t:
            q, k, v = np.split(h @ t[b + "attn_qkv.weight"].T, [H * E, (H + K) * E], axis=-1)
        else:
            q, k, v = (h @ t[b + f"attn_{n}.weight"].T + t.get(b + f"attn_{n}.bias", 0.0)
                       for n in "qkv")
        q, k, v = q.reshape(T, H, E), k.reshape(T, K, E), v.reshape(T, K, E)
        if b + "attn_q_norm.weight" in t:  # Qwen3: each head normed before rotary
            q = rms_norm(q, t[b + "attn_q_norm.weight"])
            k = rms_norm(k, t[b + "attn_k_norm.weight"])
        q = rope(q, pos, hp["theta"], neox, freq_scale, factors)
        k = rope(k, pos, hp["theta"], neox, freq_scale, factors)
        # GQA: query head h reads KV head h // (H / K) (ggml's broadcast in mul_mat)
        k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
        s = np.einsum("the,she->hts", q, k) / np.sqrt(E)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hts,she->the", a, v).reshape(T, H * E) @ t[b + "attn_output.weight"].T
        h = rms_norm(x, t[b + "ffn_norm.weight"])
        if b + "ffn_gate.weight" in t:
            g, u = h @ t[b + "ffn_gate.weight"].T, h @ t[b + "ffn_up.weight"].T
        else:  # Phi-3: ggml_swiglu on [gate; up], silu on the first half
            g, u = np.split(h @ t[b + "ffn_up.weight"].T, 2, axis=-1)
        x = x + (g / (1 + np.exp(-g)) * u) @ t[b + "ffn_down.weight"].T
    x = rms_norm(x, t["output_norm.weight"])
    return x @ t.get("output.weight", t["token_embd.weight"]).T


def assert_close(got, want):
    """float32 rounding: every logit within 1e-4 of the logits' range."""
    assert got.shape == want.shape
    err = np.abs(got - want).max()
    assert err <= 1e-4 * np.ptp(want), f"max |error| {err:.3g} vs range {np.ptp(want):.3g}"


# ---------------------------------------------------------------- the variants


@pytest.mark.parametrize("variant, weights", [
    ("llama3", "float32"), ("llama-linear", "float32"), ("llama-head-dim", "float32"),
    ("llama-bias", "float32"),
    ("qwen3", "float32"), ("qwen3", "packed"), ("phi3", "float32"), ("phi3", "packed"),
])
def test_variant_matches_llama_cpp_definitions(tmp_path, cluster, variant, weights):
    arch, hp, meta = VARIANTS[variant]
    t = make_tensors(arch, hp)
    path = write_gguf(tmp_path / f"{variant}.gguf", arch, hp, meta, t)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DequantizedWeightsWarning)  # F32 files: all packed
        model = tfnb.load_model(path, weights=weights, progress=False)
    cfg = model.config
    assert (cfg.head_dim, cfg.hidden_size) == (hp["head_dim"], hp["hidden"])
    assert cfg.tie_embeddings == hp["tied"] and cfg.qk_norm == (arch == "qwen3")
    assert model.packed == (weights == "packed")
    want = reference_logits(arch, hp, meta, t, IDS)
    if meta or hp["rope_freqs"]:  # the prompt is long enough for the scaling to matter
        unscaled = reference_logits(arch, hp, meta, t, IDS, scaled=False)
        assert np.abs(unscaled - want).max() > 1e-2 * np.ptp(want)
    placed = tfnb.place(model, [cluster.devices[0]], cluster)
    assert_close(placed.logits(IDS), want)
    # decoding (cache reads at later positions) follows the reference's greedy choices
    new = placed.generate_ids(IDS, max_new_tokens=3)  # fewer only after an end token
    ids = list(IDS)
    for token in new:
        assert token == int(np.argmax(reference_logits(arch, hp, meta, t, ids)[-1]))
        ids.append(token)


def test_qwen3_split_over_two_workers(tmp_path, cluster):
    """A head width other than hidden / heads across a device boundary (only the 64-wide hidden
    state crosses)."""
    arch, hp, meta = VARIANTS["qwen3"]
    t = make_tensors(arch, hp, n_layers=3, seed=1)
    path = write_gguf(tmp_path / "q3.gguf", arch, hp, meta, t, n_layers=3)
    model = tfnb.load_model(path, weights="float32", progress=False)
    assert model.chain["block.0"].kv_bytes_per_token == 2 * 2 * 32 * 4
    assert model.chain["block.0"].attn_flops_per_context == 4 * 4 * 32
    placed = tfnb.place(model, cluster.devices[:2], cluster)
    assert len({seg.device for seg in placed.segments}) == 2
    assert_close(placed.logits(IDS), reference_logits(arch, hp, meta, t, IDS, n_layers=3))


def test_the_config_and_canonical_weights_of_each_variant(tmp_path):
    for variant, (arch, hp, meta) in VARIANTS.items():
        t = make_tensors(arch, hp)
        model = tfnb.load_model(write_gguf(tmp_path / f"{variant}.gguf", arch, hp, meta, t,
                                           eot=5 if variant == "llama3" else None),
                                weights="float32", progress=False)
        cfg, w = model.config, model.weights
        assert cfg.eos_ids == ((2, 5) if variant == "llama3" else (2,))  # llama.cpp's end tokens
        H, K, E, d, F = hp["heads"], hp["kv_heads"], hp["head_dim"], hp["hidden"], hp["ffn"]
        assert w["blocks.0.wq"].shape == (d, H * E) and w["blocks.0.wo"].shape == (H * E, d)
        assert w["blocks.0.wk"].shape == w["blocks.0.wv"].shape == (d, K * E)
        assert w["blocks.0.w_gate"].shape == w["blocks.0.w_up"].shape == (d, F)
        assert cfg.rope_scaling_factor == meta.get("rope.scaling.factor", 1.0)
        if hp["rope_freqs"]:
            np.testing.assert_allclose(cfg.rope_freq_factors, t["rope_freqs.weight"])
        else:
            assert cfg.rope_freq_factors is None
        if arch == "phi3":  # the fused rows, split: q|k|v and gate|up
            qkv = t["blk.1.attn_qkv.weight"]
            np.testing.assert_array_equal(w["blocks.1.wk"].T, qkv[H * E:(H + K) * E])
            np.testing.assert_array_equal(w["blocks.1.w_gate"].T, t["blk.1.ffn_up.weight"][:F])
            np.testing.assert_array_equal(w["blocks.1.w_up"].T, t["blk.1.ffn_up.weight"][F:])
        if arch == "qwen3":  # NEOX: q rows as they are
            np.testing.assert_array_equal(w["blocks.0.wq"].T, t["blk.0.attn_q.weight"])
            np.testing.assert_array_equal(w["blocks.0.k_norm"], t["blk.0.attn_k_norm.weight"])
        if arch == "phi3":  # nothing TFMistral lacks: transformers agrees with the reference
            got = model.to_hf()(np.asarray([IDS])).logits.numpy()[0]
            assert_close(got, reference_logits(arch, hp, meta, t, IDS))
        else:
            with pytest.raises(ModelError, match="runs in tfnb only"):
                model.to_hf()
    # packed phi3: the fused blocks are cut by rows, still packed
    model = tfnb.load_model(tmp_path / "phi3.gguf", progress=False)
    assert isinstance(model.weights["blocks.0.wv"], PackedTensor)
    assert model.weights["blocks.0.wv"].shape == (64, 2 * 16)


# ---------------------------------------------------------------- dequantized types


def _unpacked_type():
    """A type written here that tfnb's kernels do not keep packed (the kernels grow)."""
    for name in ("BF16", "Q5_0", "Q5_1", "IQ4_NL"):
        if name not in QTYPES:
            return name
    pytest.skip("every type gguf can write here is packed by tfnb's kernels")


def test_dequantized_types_warn_once_with_their_cost(tmp_path):
    arch, hp, meta = VARIANTS["llama3"]
    t = make_tensors(arch, hp)
    qtype = _unpacked_type()
    names = ["blk.0.ffn_up.weight", "blk.1.ffn_up.weight", "blk.1.attn_v.weight"]
    path = write_gguf(tmp_path / "mixed.gguf", arch, hp, meta, t, qtypes=dict.fromkeys(names,
                                                                                         qtype))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = tfnb.load_model(path, progress=False)
    ours = [w for w in seen if issubclass(w.category, DequantizedWeightsWarning)]
    assert len(ours) == 1, [str(w.message) for w in seen]
    text = str(ours[0].message)
    assert "mixed.gguf" in text and f"3 tensors of type {qtype}" in text and "more than" in text
    assert not isinstance(model.weights["blocks.1.wv"], PackedTensor)
    assert isinstance(model.weights["blocks.1.wq"], PackedTensor)
    with warnings.catch_warnings():  # asked for float32: nothing to warn about
        warnings.simplefilter("error", DequantizedWeightsWarning)
        tfnb.load_model(path, weights="float32", progress=False)


# ---------------------------------------------------------------- bad files


def _bad(tmp_path, variant, *, meta=None, add=None, drop=(), arch=None, hp=None):
    arch0, hp0, meta0 = VARIANTS[variant]
    hp = {**hp0, **(hp or {})}
    t = make_tensors(arch0, hp)
    t = {n: v for n, v in {**t, **(add or {})}.items() if n not in drop}
    return write_gguf(tmp_path / "bad.gguf", arch or arch0, hp, {**meta0, **(meta or {})}, t)


@pytest.mark.parametrize("case, kwargs, message", [
    ("architecture", dict(arch="gemma"),
     r"architecture 'gemma' in '.*bad\.gguf' is not supported: expected one of \['llama', "
     r"'qwen2', 'qwen3', 'phi3', 'gemma2', 'gemma3'\]"),
    ("yarn", dict(variant="qwen3", meta={"rope.scaling.type": "yarn"}),
     r"'qwen3\.rope\.scaling\.type'='yarn' in '.*bad\.gguf' is not supported: expected one of "
     r"\['none', 'linear'\]"),
    ("longrope type", dict(variant="phi3", meta={"rope.scaling.type": "longrope"}),
     r"'phi3\.rope\.scaling\.type'='longrope'.*\['none', 'linear'\]"),
    ("attn factor", dict(variant="phi3", meta={"rope.scaling.attn_factor": 1.19}),
     r"'phi3\.rope\.scaling\.attn_factor'=1\.19.* in '.*bad\.gguf'"),
    ("longrope factors", dict(variant="phi3", add={
        "rope_factors_long.weight": np.linspace(1, 5, 8).astype(np.float32)}),
     r"rope_factors_long\.weight in '.*bad\.gguf' holds LongRoPE factors other than 1"),
    ("rope_freqs length", dict(variant="llama3", add={
        "rope_freqs.weight": np.ones(5, np.float32)}),
     r"rope_freqs\.weight in '.*bad\.gguf' has shape \[5\].*head_dim / 2 = 8"),
    ("value_length", dict(variant="qwen3", meta={"attention.value_length": 16}),
     r"'qwen3\.attention\.value_length'=16 in '.*bad\.gguf' differs from the key width 32"),
    ("unknown tensor", dict(variant="qwen3", add={
        "blk.0.attn_q.bias": np.zeros(128, np.float32)}),
     r"'.*bad\.gguf' has tensors \['blk\.0\.attn_q\.bias'\] that tfnb does not support for "
     r"architecture 'qwen3': expected only .*attn_q_norm"),
    ("rope_freqs elsewhere", dict(variant="qwen3", add={
        "rope_freqs.weight": np.ones(16, np.float32)}),
     r"\['rope_freqs\.weight'\] that tfnb does not support for architecture 'qwen3'"),
    ("missing q norm", dict(variant="qwen3", drop={"blk.1.attn_k_norm.weight"}),
     r"'.*bad\.gguf' lacks tensors for \['blocks\.1\.k_norm'\] "
     r"\(\['blk\.1\.attn_k_norm\.weight'\]\): expected a complete qwen3 model"),
    ("missing fused", dict(variant="phi3", drop={"blk.0.attn_qkv.weight"}),
     r"lacks tensors for \['blocks\.0\.wq', 'blocks\.0\.wk', 'blocks\.0\.wv'\] "
     r"\(\['blk\.0\.attn_q\.weight'"),
    ("fused twice", dict(variant="phi3", add={
        "blk.0.attn_k.weight": np.zeros((32, 64), np.float32)}),
     r"'.*bad\.gguf' has both blk\.0\.attn_qkv\.weight and blk\.0\.attn_k\.weight"),
])
def test_a_bad_file_is_one_clear_error(tmp_path, case, kwargs, message):
    kwargs = {"variant": "llama3", **kwargs}
    with pytest.raises(ModelError, match=message) as err:
        tfnb.load_model(_bad(tmp_path, **kwargs), weights="float32", progress=False)
    assert "\n" not in str(err.value)
