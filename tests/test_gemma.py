"""GGUF ``gemma2`` and ``gemma3`` (text): tiny files written with gguf's writer in llama.cpp's
layout, loaded float32 and packed and run on the session's workers, against a numpy forward pass
written here from llama.cpp's definitions (src/models/gemma2-iswa.cpp, gemma3.cpp; the hparams
of llama-model.cpp; llama_hparams::set_swa_pattern and is_masked_swa; build_attn's soft-cap).

The window (8) is shorter than the prompt (24 tokens), and the soft-caps are small enough that
capping moves the scores and logits: each piece of the math changes the reference by far more
than the tolerance (``test_each_piece_of_the_reference_matters``)."""
import numpy as np
import pytest

import tfnb
from tfnb.errors import ModelError

from tests.test_arch_variants import IDS, assert_close, rms_norm, rope, write_gguf

gguf = pytest.importorskip("gguf")

WINDOW = 8
# name -> (architecture, hyper-parameters, metadata, layers)
GEMMAS = {
    # every other layer slides (0, 2); both soft-caps
    "gemma2": ("gemma2", dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96,
                              theta=10000.0, tied=True, rope_freqs=False),
               {"attention.sliding_window": WINDOW, "attn_logit_softcapping": 1.5,
                "final_logit_softcapping": 3.0}, 4),
    # five sliding layers (base 10000, unscaled) to one global (base 1e6, linear scaling 4),
    # q/k norms, a head width of its own (4 x 32 on a 64-wide model)
    "gemma3": ("gemma3", dict(hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=96,
                              theta=1000000.0, tied=True, rope_freqs=False),
               {"attention.sliding_window": WINDOW, "rope.scaling.type": "linear",
                "rope.scaling.factor": 4.0}, 7),
}


def make_tensors(arch: str, hp: dict, n_layers: int, vocab: int = 96, seed: int = 0):
    """Random tensors by GGUF name in the file's layout: matrices (out, in) N(0, 1/in), norm
    gains 1 + N(0, 0.1^2) (the converter has added Gemma's 1 already)."""
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
        t[b + "attn_q.weight"] = matrix(H * E, d)
        t[b + "attn_k.weight"] = matrix(K * E, d)
        t[b + "attn_v.weight"] = matrix(K * E, d)
        if arch == "gemma3":
            t[b + "attn_q_norm.weight"] = gain(E)
            t[b + "attn_k_norm.weight"] = gain(E)
        t[b + "attn_output.weight"] = matrix(d, H * E)
        t[b + "post_attention_norm.weight"] = gain(d)
        t[b + "ffn_norm.weight"] = gain(d)
        t[b + "ffn_gate.weight"] = matrix(F, d)
        t[b + "ffn_up.weight"] = matrix(F, d)
        t[b + "ffn_down.weight"] = matrix(d, F)
        t[b + "post_ffw_norm.weight"] = gain(d)
    t["output_norm.weight"] = gain(d)
    return t


def gelu_tanh(x):
    """ggml_gelu: the tanh approximation."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def reference_logits(arch, hp, meta, t, ids, n_layers, without=()):
    """Logits (T, V) as llama.cpp computes them from the file's tensors ``t`` (float64).
    ``without`` drops pieces of the math (to show that each one matters here)."""
    T, H, K, E, d = len(ids), hp["heads"], hp["kv_heads"], hp["head_dim"], hp["hidden"]
    pattern = 2 if arch == "gemma2" else 6
    t = {n: np.asarray(v, np.float64) for n, v in t.items()}
    pos = np.arange(T, dtype=np.float64)
    x = t["token_embd.weight"][ids] * (1.0 if "embed scale" in without else np.sqrt(d))
    for il in range(n_layers):
        b = f"blk.{il}."
        swa = il % pattern < pattern - 1 and "window" not in without
        # gemma3's sliding layers: base 10000, no scaling; gemma2's: as the global ones
        if arch == "gemma3" and il % pattern < pattern - 1 and "local rope" not in without:
            base, freq_scale = 10000.0, 1.0
        else:
            base, freq_scale = hp["theta"], 1.0 / meta.get("rope.scaling.factor", 1.0)
        h = rms_norm(x, t[b + "attn_norm.weight"])
        q, k, v = (h @ t[b + f"attn_{n}.weight"].T for n in "qkv")
        q, k, v = q.reshape(T, H, E), k.reshape(T, K, E), v.reshape(T, K, E)
        if arch == "gemma3":
            q = rms_norm(q, t[b + "attn_q_norm.weight"])
            k = rms_norm(k, t[b + "attn_k_norm.weight"])
        q = rope(q, pos, base, True, freq_scale) * E ** -0.5  # NEOX; f_attention_scale
        k = rope(k, pos, base, True, freq_scale)
        k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
        s = np.einsum("the,she->hts", q, k)
        cap = meta.get("attn_logit_softcapping") if arch == "gemma2" else None
        if cap and "attn softcap" not in without:
            s = cap * np.tanh(s / cap)
        visible = np.tril(np.ones((T, T), bool))
        if swa:  # is_masked_swa: masked when p1 - p0 >= n_swa
            visible &= pos[:, None] - pos[None, :] < meta["attention.sliding_window"]
        s = np.where(visible, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hts,she->the", a, v).reshape(T, H * E) @ t[b + "attn_output.weight"].T
        if "post norms" not in without:
            o = rms_norm(o, t[b + "post_attention_norm.weight"])
        x = x + o
        h = rms_norm(x, t[b + "ffn_norm.weight"])
        g, u = h @ t[b + "ffn_gate.weight"].T, h @ t[b + "ffn_up.weight"].T
        act = gelu_tanh(g) if "gelu" not in without else g / (1 + np.exp(-g))
        y = (act * u) @ t[b + "ffn_down.weight"].T
        if "post norms" not in without:
            y = rms_norm(y, t[b + "post_ffw_norm.weight"])
        x = x + y
    x = rms_norm(x, t["output_norm.weight"])
    out = x @ t.get("output.weight", t["token_embd.weight"]).T
    cap = meta.get("final_logit_softcapping") if arch == "gemma2" else None
    if cap and "final softcap" not in without:
        out = cap * np.tanh(out / cap)
    return out


def _file(tmp_path, name, packed=False, seed=0):
    """(path, tensors as the file holds them) of the ``GEMMAS[name]`` model; ``packed``
    stores the matrices as Q8_0 (the tensors returned are then their dequantized values)."""
    arch, hp, meta, n_layers = GEMMAS[name]
    t = make_tensors(arch, hp, n_layers, seed=seed)
    qtypes = {n: "Q8_0" for n, v in t.items() if v.ndim == 2} if packed else None
    path = write_gguf(tmp_path / f"{name}.gguf", arch, hp, meta, t, n_layers=n_layers,
                      qtypes=qtypes)
    if packed:
        q8 = gguf.GGMLQuantizationType.Q8_0
        t = {n: gguf.quants.dequantize(gguf.quants.quantize(v, q8), q8) if n in qtypes else v
             for n, v in t.items()}
    return path, t


@pytest.mark.parametrize("name, weights", [
    ("gemma2", "float32"), ("gemma2", "packed"), ("gemma3", "float32"), ("gemma3", "packed"),
])
def test_gemma_matches_llama_cpp_definitions(tmp_path, cluster, name, weights):
    arch, hp, meta, n_layers = GEMMAS[name]
    path, t = _file(tmp_path, name, packed=weights == "packed")
    model = tfnb.load_model(path, weights=weights, progress=False)
    assert model.packed == (weights == "packed")
    placed = tfnb.place(model, [cluster.devices[0]], cluster)
    want = reference_logits(arch, hp, meta, t, IDS, n_layers)
    assert_close(placed.logits(IDS), want)
    # two prompts of different lengths (left padding) decoding past the window together
    prompts = [IDS, IDS[7:]]
    for prompt, got in zip(prompts, placed.logits(prompts)):
        assert_close(got, reference_logits(arch, hp, meta, t, prompt, n_layers))
    for prompt, new in zip(prompts, placed.generate_ids(prompts, max_new_tokens=4)):
        ids = list(prompt)
        for token in new:  # fewer only after an end token
            assert token == int(np.argmax(reference_logits(arch, hp, meta, t, ids,
                                                           n_layers)[-1]))
            ids.append(token)


def test_gemma3_split_over_two_workers(tmp_path, cluster):
    """Sliding and global layers, each with its own rotary base, on both sides of a device
    boundary."""
    arch, hp, meta, n_layers = GEMMAS["gemma3"]
    path, t = _file(tmp_path, "gemma3", seed=1)
    model = tfnb.load_model(path, weights="float32", progress=False)
    placed = tfnb.place(model, cluster.devices[:2], cluster)
    assert len({seg.device for seg in placed.segments}) == 2
    assert_close(placed.logits(IDS), reference_logits(arch, hp, meta, t, IDS, n_layers))


@pytest.mark.parametrize("name, piece", [
    ("gemma2", "embed scale"), ("gemma2", "window"), ("gemma2", "attn softcap"),
    ("gemma2", "final softcap"), ("gemma2", "post norms"), ("gemma2", "gelu"),
    ("gemma3", "window"), ("gemma3", "local rope"), ("gemma3", "post norms"),
])
def test_each_piece_of_the_reference_matters(tmp_path, name, piece):
    """Dropping any one piece moves the prompt's logits by far more than the tolerance, so the
    tests above fail when tfnb gets it wrong."""
    arch, hp, meta, n_layers = GEMMAS[name]
    t = make_tensors(arch, hp, n_layers)
    want = reference_logits(arch, hp, meta, t, IDS, n_layers)
    broken = reference_logits(arch, hp, meta, t, IDS, n_layers, without=(piece,))
    assert np.abs(broken - want).max() > 100 * 1e-4 * np.ptp(want)


def test_the_config_llama_cpp_derives(tmp_path):
    cfg2 = tfnb.load_model(_file(tmp_path, "gemma2")[0], weights="float32",
                           progress=False).config
    assert (cfg2.embed_scale, cfg2.mlp_act, cfg2.post_norms, cfg2.qk_norm) == (
        8.0, "gelu_tanh", True, False)
    assert (cfg2.attn_softcap, cfg2.final_softcap) == (1.5, 3.0)
    assert [cfg2.window(i) for i in range(4)] == [WINDOW, 0, WINDOW, 0]
    assert cfg2.rope_of(0) == cfg2.rope_of(1) == (10000.0, 1.0)
    assert cfg2.attn_scale == pytest.approx(16 ** -0.5) and cfg2.tie_embeddings
    cfg3 = tfnb.load_model(_file(tmp_path, "gemma3")[0], weights="float32",
                           progress=False).config
    assert cfg3.qk_norm and (cfg3.attn_softcap, cfg3.final_softcap) == (0.0, 0.0)
    assert [cfg3.window(i) for i in range(7)] == [WINDOW] * 5 + [0, WINDOW]
    assert cfg3.rope_of(0) == (10000.0, 1.0) and cfg3.rope_of(5) == (1000000.0, 4.0)
    assert cfg3.attn_scale == pytest.approx(32 ** -0.5)


def test_gemma2_defaults_and_the_27b_scale(tmp_path):
    """Without the keys llama.cpp's defaults hold (window 4096, caps 50 and 30); at the 27B's
    46 layers the scale is (hidden / heads) ** -0.5, its query_pre_attn_scalar, not the head
    width's."""
    hp = dict(GEMMAS["gemma2"][1], head_dim=32)
    t = make_tensors("gemma2", hp, 46)
    path = write_gguf(tmp_path / "g27.gguf", "gemma2", hp, {}, t, n_layers=46)
    cfg = tfnb.load_model(path, weights="float32", progress=False).config
    assert (cfg.sliding_window, cfg.attn_softcap, cfg.final_softcap) == (4096, 50.0, 30.0)
    assert cfg.attn_scale == pytest.approx(16 ** -0.5)


def test_gemma3_without_a_window_is_refused(tmp_path):
    arch, hp, meta, n_layers = GEMMAS["gemma3"]
    t = make_tensors(arch, hp, n_layers)
    path = write_gguf(tmp_path / "bad.gguf", arch, hp, {}, t, n_layers=n_layers)
    with pytest.raises(ModelError, match=r"lacks metadata 'gemma3\.attention\.sliding_window'"):
        tfnb.load_model(path, weights="float32", progress=False)


def test_gemma_runs_in_tfnb_only(tmp_path):
    model = tfnb.load_model(_file(tmp_path, "gemma2")[0], weights="float32", progress=False)
    with pytest.raises(ModelError, match="runs in tfnb only"):
        model.to_hf()


@pytest.mark.parametrize("name, weights", [
    ("gemma2", "packed"), ("gemma3", "float32"), ("gemma3", "packed"),
])
def test_decode_steps_match_the_prompt(tmp_path, name, weights):
    """Decode steps past the window (the packed attention op with its first slot raised, or
    the TF path with the window's mask) give the hidden states a prefill of the whole prompt
    gives, for two rows, one left-padded. Greedy tokens alone may not tell a wrong window."""
    import tensorflow as tf

    from tfnb.models.chain import Segment, stage_names
    from tfnb.runtime.graphs import client_cpu, pack_ctl, pack_prefill_ctl, segment_functions
    from tfnb.runtime.weights import kv_caches, segment_params

    path, _ = _file(tmp_path, name, packed=weights == "packed")
    model = tfnb.load_model(path, weights=weights, progress=False)
    cfg, dev = model.config, client_cpu()
    seg = Segment(dev, tuple(stage_names(cfg.n_layers)[1:-1]))  # the blocks only
    params = segment_params(cfg, model.weights, seg, head_device=dev)
    caches = kv_caches(seg, [2, cfg.n_kv_heads, 32, cfg.head_dim])
    fns = segment_functions(seg, params, caches, cfg, cfg.eos_ids, 0)
    T, P, pad_B = len(IDS), 12, tf.constant([0, 4])
    x_BxTxD = np.asarray(model.weights["embed"])[np.array([IDS, IDS])] * cfg.embed_scale
    x_BxTxD[1, :4] = 0.0  # row 1's padding
    with tf.device(dev):
        x_BxTxD = tf.constant(x_BxTxD, tf.float32)
        full_BxTxD = fns.prefill(x_BxTxD, pack_prefill_ctl(0, 0, pad_B), None, None).numpy()
        fns.prefill(x_BxTxD[:, :P], pack_prefill_ctl(0, 0, pad_B), None, None)
        for slot in range(P, T):
            got_BxD = fns.decode(x_BxTxD[:, slot:slot + 1], pack_ctl(slot, pad_B), None,
                                 None).numpy()[:, 0]
            assert_close(got_BxD, full_BxTxD[:, slot])
