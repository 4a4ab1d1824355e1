"""GGUF architectures beyond llama: tiny files written with gguf's writer (real tensor names and
metadata), run on a real worker and compared with an independent numpy forward pass."""
import numpy as np
import pytest

import tfnb
from tfnb.errors import ModelError
from tfnb.models import decoder

from tests.test_models import add_tiny_metadata, write_llama_gguf

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize

IDS = [1, 7, 30, 5, 61, 12]


def reference_logits(cfg, w, ids):
    """Logits (T, V) of a llama-family decoder from canonical float weights, in plain numpy:
    rotate-half rotary embeddings, grouped-query causal attention, SwiGLU, RMSNorm, optional
    q/k/v biases."""
    T, H, K, E = len(ids), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, E, 2) / E)
    angle = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([angle] * 2, -1)), np.sin(np.concatenate([angle] * 2, -1))

    def rope(v):  # (T, N, E)
        a, b = v[..., :E // 2], v[..., E // 2:]
        return v * cos[:, None] + np.concatenate([-b, a], -1) * sin[:, None]

    def norm(v, g):
        return g * v / np.sqrt((v ** 2).mean(-1, keepdims=True) + cfg.norm_eps)

    x = w["embed"][ids].astype(np.float64)
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        h = norm(x, w[p + "attn_norm"])
        bias = {n: w.get(p + n, 0.0) for n in ("bq", "bk", "bv")}
        q = rope((h @ w[p + "wq"] + bias["bq"]).reshape(T, H, E))
        k = np.repeat(rope((h @ w[p + "wk"] + bias["bk"]).reshape(T, K, E)), H // K, axis=1)
        v = np.repeat((h @ w[p + "wv"] + bias["bv"]).reshape(T, K, E), H // K, axis=1)
        s = np.einsum("the,she->hts", q, k) / np.sqrt(E)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hts,she->the", a, v).reshape(T, H * E) @ w[p + "wo"]
        h = norm(x, w[p + "mlp_norm"])
        g, u = h @ w[p + "w_gate"], h @ w[p + "w_up"]
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "w_down"]
    x = norm(x, w["final_norm"])
    return x @ (w["embed"].T if cfg.tie_embeddings else w["lm_head"])


def write_qwen2_gguf(path, config, weights, qtype="F32"):
    """A qwen2 GGUF as llama.cpp's converter lays it out: (out, in) matrices, q/k rows in HF's
    order (qwen2 uses rotate-half rotary, so nothing is permuted), q/k/v biases."""
    writer = gguf.GGUFWriter(str(path), "qwen2")
    add_tiny_metadata(writer, config, "tiny-qwen2")
    qt = gguf.GGMLQuantizationType[qtype]

    def matrix(name, w_RxC):
        if qtype == "F32":
            writer.add_tensor(name, np.ascontiguousarray(w_RxC))
        else:
            writer.add_tensor(name, quantize(np.ascontiguousarray(w_RxC), qt), raw_dtype=qt)

    matrix("token_embd.weight", weights["embed"])
    names = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
             "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
    for i in range(config.n_layers):
        p = f"blocks.{i}."
        for short, gname in names.items():
            matrix(f"blk.{i}.{gname}.weight", weights[p + short].T)
        for short, gname in (("bq", "attn_q"), ("bk", "attn_k"), ("bv", "attn_v")):
            writer.add_tensor(f"blk.{i}.{gname}.bias", weights[p + short])
        writer.add_tensor(f"blk.{i}.attn_norm.weight", weights[p + "attn_norm"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", weights[p + "mlp_norm"])
    writer.add_tensor("output_norm.weight", weights["final_norm"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_reference_agrees_with_transformers_on_llama():
    """The numpy reference itself, checked against transformers' TFMistral."""
    cfg = decoder.tiny_config()
    w = decoder.random_weights(cfg, 4)
    want = decoder.to_hf(cfg, w)(np.asarray([IDS])).logits.numpy()[0]
    np.testing.assert_allclose(reference_logits(cfg, w, IDS), want, atol=2e-4)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_qwen2_gguf_matches_the_reference(tmp_path, cluster, qtype):
    cfg = decoder.tiny_config(qkv_bias=True, rope_theta=1e6)
    w = decoder.random_weights(cfg, 5)
    path = tmp_path / "tiny-qwen2.gguf"
    write_qwen2_gguf(path, cfg, w, qtype)
    model = tfnb.load_model(path, progress=False)
    assert model.config.qkv_bias and model.config.rope_theta == 1e6
    assert model.packed and model.weights["blocks.0.bq"].shape == (64,)
    # the reference reads the file's own values (quantized ones as gguf dequantizes them)
    floats = {n: np.asarray(v, np.float64) for n, v in model.weights.items()}
    want = reference_logits(cfg, floats, IDS)
    placed = tfnb.place(model, [cluster.devices[0]], cluster)
    got = placed.logits(IDS)
    assert np.abs(got - want).max() <= 1e-4 * np.ptp(want)
    assert placed.generate_ids(IDS, max_new_tokens=4)[0] == int(np.argmax(want[-1]))
    with pytest.raises(ModelError, match="no q/k/v biases"):
        model.to_hf()


def test_an_unsupported_architecture_keeps_its_one_clear_error(tmp_path):
    cfg = decoder.tiny_config()
    write_llama_gguf(tmp_path / "g.gguf", cfg, decoder.random_weights(cfg), arch="gemma")
    with pytest.raises(ModelError, match=r"'gemma'.*expected one of \['llama', 'qwen2', "
                                         r"'qwen3', 'phi3', 'gemma2', 'gemma3'\]"):
        tfnb.load_model(tmp_path / "g.gguf", progress=False)
