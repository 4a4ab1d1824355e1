"""tfnb.models: llama weights and conversions, loaders (GGUF, HF, Keras), LayerChain, errors."""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

from tfnb.errors import ModelError
from tfnb.models import LayerChain, decoder, load_model, tiny
from tfnb.models.model import smollm2_path
from tfnb.models.packed import PackedTensor

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


# ---------------------------------------------------------------- helpers


def add_tiny_metadata(writer, config, name):
    """The hyper-parameters of ``config`` and a tiny GPT-2 style tokenizer (one merge), as
    llama.cpp's converter writes them."""
    writer.add_name(name)
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.max_context)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.ffn_size)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(33, 33 + config.vocab_size - 4)]
    tokens.append("ab")  # the one merge's result
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
                             "{% if add_generation_prompt %}<s>{% endif %}")


def write_llama_gguf(path, config, weights, arch="llama"):
    """Write canonical weights as an F32 GGUF the way llama.cpp's converter lays them out.

    Written independently of tfnb's reader: (in, out) -> (out, in), and q/k rows permuted per
    head with llama.cpp's formula (HF halves -> interleaved pairs).
    """
    import gguf

    def permute(w_RxC, n_head):
        return (w_RxC.reshape(n_head, 2, w_RxC.shape[0] // n_head // 2, w_RxC.shape[1])
                .swapaxes(1, 2).reshape(w_RxC.shape))

    writer = gguf.GGUFWriter(str(path), arch)
    add_tiny_metadata(writer, config, "tiny-gguf")
    writer.add_tensor("token_embd.weight", weights["embed"])
    gguf_names = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
                  "wo": "attn_output", "mlp_norm": "ffn_norm", "w_gate": "ffn_gate",
                  "w_up": "ffn_up", "w_down": "ffn_down"}
    for i in range(config.n_layers):
        for short, gname in gguf_names.items():
            w = weights[f"blocks.{i}.{short}"]
            if w.ndim == 2:
                w = np.ascontiguousarray(w.T)
            if short == "wq":
                w = permute(w, config.n_heads)
            elif short == "wk":
                w = permute(w, config.n_kv_heads)
            writer.add_tensor(f"blk.{i}.{gname}.weight", w)
    writer.add_tensor("output_norm.weight", weights["final_norm"])
    if not config.tie_embeddings:
        writer.add_tensor("output.weight", np.ascontiguousarray(weights["lm_head"].T))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def logits(hf_model, ids):
    return hf_model(np.asarray([ids], dtype=np.int32)).logits.numpy()[0]


# ---------------------------------------------------------------- decoder.py


@pytest.mark.parametrize("tie", [True, False])
def test_llama_to_hf_from_hf_round_trips_exactly(tie):
    config = decoder.tiny_config(tie_embeddings=tie)
    weights = decoder.random_weights(config, seed=3)
    config2, weights2 = decoder.from_hf(decoder.to_hf(config, weights))
    assert config2 == config
    assert sorted(weights2) == sorted(weights)
    assert ("lm_head" in weights2) == (not tie)
    for name, w in weights.items():
        assert w.dtype == np.float32
        np.testing.assert_array_equal(weights2[name], w, err_msg=name)


def test_tiny_llama_logits_are_finite_spread_and_position_dependent():
    model = tiny("llama", seed=0)
    out_TxV = logits(model.to_hf(), model.tokenizer.encode("Hello, world"))
    assert out_TxV.shape == (12, model.config.vocab_size)
    assert np.isfinite(out_TxV).all()
    assert out_TxV.std() > 1.0
    top2 = np.sort(out_TxV, axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0] > 1e-3).all(), "greedy decoding would see ties"
    assert len(set(out_TxV.argmax(-1).tolist())) > 1
    assert not np.allclose(decoder.random_weights(model.config, 1)["embed"], model.weights["embed"])


def test_tiny_llama_model_tokenizer_and_chain():
    model = tiny("llama")
    tok = model.tokenizer
    assert tok.decode(tok.encode("The capital: Paris.")) == "The capital: Paris."
    prompt = tok.apply_chat_template(FRANCE)
    assert prompt.endswith("assistant:") and "France" in prompt
    assert max(tok.encode(prompt)) < model.config.vocab_size
    assert model.chain is model.chain  # cached
    assert model.chain.names == ["embed", "block.0", "block.1", "head"]
    assert sorted(model.stage_weights("head")) == ["embed", "final_norm"]  # tied head
    assert model.stage_weights("head")["embed"] is model.weights["embed"]  # no copy
    assert len(model.stage_weights("block.1")) == 9
    assert "tiny-llama" in repr(model) and "MB" in repr(model)


def test_layer_chain_sequence_tables_and_kv():
    chain = tiny("llama").chain
    assert isinstance(chain, LayerChain)
    assert [s.name for s in chain] == chain.names and chain[-1] is chain["head"]
    assert chain[1:3].names == ["block.0", "block.1"]
    block = chain["block.0"]
    assert block.kv_bytes_per_token == 2 * 2 * 16 * 4
    assert block.flops(100) == block.flops_per_token + 100 * 4 * 4 * 16
    assert chain.kv_bytes(batch=3, context_len=10) == {
        "embed": 0, "block.0": 3 * 10 * 256, "block.1": 3 * 10 * 256, "head": 0}
    rows = chain.to_rows()
    assert rows[0]["name"] == "embed" and rows[-1]["act_bytes_out_per_token"] == 96 * 4
    assert "block.0 .. block.1" in str(chain) and "<table>" in chain._repr_html_()
    with pytest.raises(ModelError, match="-1"):
        chain.kv_bytes(batch=-1, context_len=4)
    with pytest.raises(ModelError, match="'block.7'"):
        chain["block.7"]


# ---------------------------------------------------------------- GGUF


def test_gguf_written_like_llama_cpp_loads_back_exactly(tmp_path):
    config = decoder.tiny_config(tie_embeddings=False, max_context=128)
    weights = decoder.random_weights(config, seed=5)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, config, weights)
    calls = []
    model = load_model(str(path), progress=lambda done, total, what: calls.append((done, total)))
    assert model.arch == "llama" and model.name == "tiny-gguf"
    assert model.config.tie_embeddings is False and model.config.max_context == 128
    for name, w in weights.items():
        np.testing.assert_array_equal(model.weights[name], w, err_msg=name)
    assert calls[-1][0] == calls[-1][1] > 1
    assert model.tokenizer.encode("<s>!!ab") == [1, 3, 3, config.vocab_size - 1]


def test_progress_true_prints_a_bar_in_a_terminal(tmp_path, capsys):
    config = decoder.tiny_config()
    write_llama_gguf(tmp_path / "t.gguf", config, decoder.random_weights(config))
    load_model(tmp_path / "t.gguf")
    assert "reading weights" in capsys.readouterr().err
    load_model(tmp_path / "t.gguf", weights="float32")
    assert "dequantizing" in capsys.readouterr().err
    load_model(tmp_path / "t.gguf", progress=False)
    assert capsys.readouterr().err == ""


def test_widget_reporter_tracks_progress():
    pytest.importorskip("ipywidgets")
    from tqdm.notebook import tqdm

    from tfnb.models.progress import TqdmReporter

    report = TqdmReporter(tqdm_class=tqdm, mininterval=0)  # the bar tqdm.auto picks in Jupyter
    report(3, 10, "dequantizing")
    label, bar, counts = report.bar.container.children
    assert (bar.value, bar.max) == (3, 10)
    assert label.value.startswith("dequantizing") and "3/10" in counts.value
    report(10, 10, "dequantizing")
    assert bar.value == 10 and bar.bar_style == "success"


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2", progress=False)


@pytest.mark.slow
def test_smollm2_config_matches_the_gguf_facts(smollm2):
    assert smollm2.name == "smollm2" and smollm2.arch == "llama"
    assert smollm2.config == decoder.LlamaConfig(
        vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_size=1536,
        rope_theta=100000.0, norm_eps=1e-5, max_context=8192, tie_embeddings=True,
        bos_id=1, eos_ids=(2, 0, 4))  # llama.cpp's end tokens: <|im_end|>, <|endoftext|>,
    # and <reponame>, which it takes for a fill-in-the-middle token
    assert "lm_head" not in smollm2.weights
    # matrices stay in the file's blocks (Q4_1, the embedding Q8_0); norms are float32
    packed = {n: w for n, w in smollm2.weights.items() if isinstance(w, PackedTensor)}
    assert len(packed) == 30 * 7 + 1
    assert packed["embed"].qtype_name == "Q8_0" and packed["blocks.0.wq"].qtype_name == "Q4_1"
    assert packed["embed"].shape == (49152, 576) and packed["blocks.0.wq"].shape == (576, 576)
    for w in smollm2.weights.values():
        # packed matrices are where the file holds them (read on demand, or by the workers);
        # what is read is the file's read-only map; norms are plain float32 arrays
        a = w.data if isinstance(w, PackedTensor) else w
        assert a.flags.c_contiguous
        assert a.dtype == (np.uint8 if isinstance(w, PackedTensor) else np.float32)
        if isinstance(w, PackedTensor):
            assert [p.path for p in w.parts] == [smollm2_path()]
            assert a.flags.writeable == (w.parts[0].order is not None)  # q/k: rows reordered
    # one full copy is about the file's size, not 5.8x it as float32
    assert 90e6 < smollm2.nbytes < 100e6
    assert smollm2.chain.unique_param_bytes == smollm2.nbytes  # what the planners count
    assert smollm2.hf_model is None  # one copy of the weights: the numpy dict


@pytest.mark.slow
def test_smollm2_tokenizer_matches_llama_cpp(smollm2):
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template(FRANCE)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    ids = tok.encode(prompt)
    assert ids[:3] == [1, 9690, 198]  # <|im_start|> system \n : special tokens are single ids
    assert ids[-4:] == [1, 520, 9531, 198]  # <|im_start|> assistant \n
    assert ids.count(1) == 3 and ids.count(2) == 2
    assert tok.encode("2024") == [34, 32, 34, 36]  # smollm pre-tokenizer: one digit per token
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2):
    import tensorflow as tf

    ids = smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(FRANCE))
    out = smollm2.to_hf().generate(tf.constant([ids]), max_new_tokens=9, do_sample=False)
    answer = smollm2.tokenizer.decode(out[0, len(ids):].numpy())
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_smollm2_layer_chain_numbers(smollm2):
    chain = smollm2.chain
    n_params = 134_515_008
    embed_bytes = 49152 * 576 // 32 * 34                        # Q8_0: 34 bytes per 32 values
    block_bytes = (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) // 32 * 20 + 2 * 576 * 4
    assert len(chain) == 32 and chain.names[1] == "block.0" and chain.names[-1] == "head"
    assert chain["block.0"].param_bytes == block_bytes            # Q4_1: 20 bytes per 32
    assert chain.unique_param_bytes == embed_bytes + 30 * block_bytes + 576 * 4
    assert chain.total_param_bytes == chain.unique_param_bytes + embed_bytes  # tied head
    assert chain["head"].param_bytes == embed_bytes + 576 * 4
    assert {chain[f"block.{i}"].kv_bytes_per_token for i in range(30)} == {2 * 3 * 64 * 4}
    assert chain.kv_bytes(1, 1000)["block.7"] == 1536 * 1000
    assert chain["block.0"].act_bytes_out_per_token == 576 * 4
    assert 3.4e9 > chain.flops_per_token() > 2 * (n_params - 49152 * 576) > 2.1e8


# ---------------------------------------------------------------- bad input


def test_unknown_model_name_lists_the_accepted_names():
    with pytest.raises(ModelError, match="'llama-9000'") as err:
        load_model("llama-9000", progress=False)
    assert "smollm2" in str(err.value) and "path" in str(err.value)


def test_missing_path(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ModelError, match="nope.gguf.*does not exist"):
        load_model(missing, progress=False)


def test_truncated_gguf_is_a_model_error(tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path(), "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelError, match="cut.gguf") as err:
        load_model(str(cut), progress=False)
    assert "\n" not in str(err.value)


def test_unsupported_gguf_architecture(tmp_path):
    config = decoder.tiny_config()
    write_llama_gguf(tmp_path / "f.gguf", config, decoder.random_weights(config), arch="falcon")
    with pytest.raises(ModelError, match="'falcon'.*'llama'"):
        load_model(str(tmp_path / "f.gguf"), progress=False)


def test_non_causal_lm_hf_directory(tmp_path):
    from transformers import DistilBertConfig

    DistilBertConfig(n_layers=1, dim=32, hidden_dim=64, n_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="'distilbert'.*causal"):
        load_model(str(tmp_path), progress=False)
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path / ".."), progress=False)


def test_other_bad_inputs(tmp_path):
    (tmp_path / "x.gguf").write_text("hello")
    with pytest.raises(ModelError, match="x.gguf"):
        load_model(str(tmp_path / "x.gguf"), progress=False)
    with pytest.raises(ModelError, match="42"):
        load_model(42)
    with pytest.raises(ModelError, match="'bert'"):
        tiny("bert")
    with pytest.raises(ModelError, match="'block.9'"):
        tiny("llama").stage_weights("block.9")


# ---------------------------------------------------------------- HF and Keras round trips


def test_hf_gpt2_directory_stays_opaque(tmp_path):
    from transformers import GPT2Config, TFGPT2LMHeadModel

    hf = TFGPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    expected = logits(hf, [1, 2, 3])
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), progress=False)
    assert model.arch == "hf" and model.weights is None
    np.testing.assert_allclose(logits(model.hf_model, [1, 2, 3]), expected, rtol=1e-5, atol=1e-5)
    chain = model.chain
    assert chain.names == ["embed", "block.0", "block.1", "head"]
    assert chain["block.0"].kv_bytes_per_token == 2 * 32 * 4
    from tfnb.models.hf_io import hf_blocks

    _, blocks = hf_blocks(model.hf_model)  # the Keras layers the runtime places, one per stage
    assert [tuple(w.name for w in b.weights) for b in blocks] == \
        [chain[f"block.{i}"].weight_names for i in range(2)]
    head = model.stage_weights("head")
    assert any("wte" in n for n in head) and any("ln_f" in n for n in head)  # tied head
    assert sum(w.size for w in model.stage_weights("block.1").values()) * 4 == \
        chain["block.1"].param_bytes


def test_hf_mistral_directory_becomes_llama(tmp_path):
    config = decoder.tiny_config(n_layers=1)
    weights = decoder.random_weights(config, seed=7)
    hf = decoder.to_hf(config, weights)
    expected = logits(hf, [1, 5, 9, 11])
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), progress=False)
    assert model.arch == "llama" and model.hf_model is None and model.config == config
    for name, w in weights.items():
        np.testing.assert_array_equal(model.weights[name], w, err_msg=name)
    np.testing.assert_allclose(logits(model.to_hf(), [1, 5, 9, 11]), expected, atol=1e-5)


@pytest.mark.parametrize("flavour", ["tf_keras", "keras3"])
def test_keras_file_round_trip(tmp_path, flavour):
    if flavour == "tf_keras":
        import tf_keras as K
    else:
        import keras as K
    net = K.Sequential([K.Input((8,)), K.layers.Dense(16, activation="relu", name="hidden"),
                        K.layers.Dense(4, name="out")])
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    path = tmp_path / "net.keras"
    net.save(path)
    model = load_model(str(path), progress=False)
    assert model.arch == "keras" and model.name == "net"
    assert model.keras_model.__module__.split(".")[0] == ("tf_keras" if flavour == "tf_keras"
                                                          else "keras")
    np.testing.assert_allclose(model.keras_model(x), net(x), rtol=1e-6)
    chain = model.chain
    assert chain.names == ["hidden", "out"]
    assert chain["hidden"].param_bytes == (8 * 16 + 16) * 4
    assert chain["hidden"].act_bytes_out_per_token == 16 * 4
    assert chain["out"].flops_per_token == 2 * 16 * 4
    assert sum(w.size for w in model.stage_weights("out").values()) == 16 * 4 + 4


def test_tiny_gpt2_is_an_opaque_hf_model():
    model = tiny("gpt2", seed=1)
    out_TxV = logits(model.to_hf(), model.tokenizer.encode("abc"))
    assert model.arch == "hf" and np.isfinite(out_TxV).all() and out_TxV.std() > 0.1
    assert len(model.chain) == 4


@pytest.mark.parametrize("module",
                         ["decoder", "chain", "gguf_io", "model", "progress", "tokenizer"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    mod = importlib.import_module(f"tfnb.models.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
