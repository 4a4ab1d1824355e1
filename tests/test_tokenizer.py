"""GGUF tokenizers: SentencePiece (``tokenizer.ggml.model == "llama"``) and the BPE
pre-tokenizers named by ``tokenizer.ggml.pre``, on tiny GGUF files written with gguf's writer.

Expected ids are worked out by hand from llama.cpp's definitions (``src/llama-vocab.cpp``):
SentencePiece merges the adjacent pair whose merged token has the highest score first (the
leftmost on a tie) and spells characters outside the vocabulary as ``<0xNN>`` byte tokens.
"""

from __future__ import annotations

import heapq
import random
import warnings

import numpy as np
import pytest

from tfnb.errors import ModelError
from tfnb.models.tokenizer import end_token_ids, tokenizer_from_gguf_fields

# ---------------------------------------------------------------- tiny files

BYTE0 = 3  # <0x00> is id 3: ids 0-2 are <unk> <s> </s>, then the 256 byte tokens
SP_NORMAL = {  # text -> score; unique scores, so the merge order is never a tie
    "▁": -100.0, "a": -101.0, "b": -102.0, "c": -103.0, "x": -104.0,
    "ab": -1.0, "bc": -2.0, "abc": -3.0, "▁a": -5.0, "ca": -0.5, "cab": -4.0, "▁c": -6.0,
    "[INST]": 0.0,
}
SP_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + list(SP_NORMAL)
SP = {t: i for i, t in enumerate(SP_TOKENS)}
SP_TYPES = [2, 3, 3] + [6] * 256 + [1] * (len(SP_NORMAL) - 1) + [4]  # [INST] user-defined


def read_meta(path) -> dict:
    """The metadata as tfnb's GGUF reader decodes it (``field.contents()`` per key)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def write_gguf(path, fill) -> dict:
    """A GGUF file with one tiny tensor and the tokenizer metadata ``fill(writer)`` adds."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-tokenizer")
    fill(writer)
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_meta(path)


def sp_meta(tmp_path, name="sp.gguf", **flags) -> dict:
    def fill(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(SP_TOKENS)
        w.add_token_scores([0.0] * (3 + 256) + list(SP_NORMAL.values()))
        w.add_token_types(SP_TYPES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        if "add_bos" in flags:
            w.add_add_bos_token(flags["add_bos"])
        if "add_eos" in flags:
            w.add_add_eos_token(flags["add_eos"])
        if "add_space_prefix" in flags:
            w.add_add_space_prefix(flags["add_space_prefix"])
        w.add_chat_template("{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} "
                            "[/INST]{% endfor %}")
    return write_gguf(tmp_path / name, fill)


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    return tokenizer_from_gguf_fields(sp_meta(tmp_path_factory.mktemp("sp")))


# ---------------------------------------------------------------- SentencePiece


def test_sentencepiece_ids_follow_scores_not_position(sp):
    ids = sp.encode
    # "▁abc": pairs ▁a -5, ab -1, bc -2 -> ab first; then ab+c = abc -3 (▁ab is no token)
    # -> [▁, abc]; merging left to right would give ▁a + bc
    assert ids("abc") == [1, SP["▁"], SP["abc"]]
    # "▁aab": ▁a -5, ab -1 -> ab; then ▁a -> [▁a, ab] (aab, ▁aab are no tokens)
    assert ids("aab") == [1, SP["▁a"], SP["ab"]]
    # "▁cab": ▁c -6, ca -0.5, ab -1 -> ca; then ▁ca? no, cab -4 -> [▁, cab]
    assert ids("cab") == [1, SP["▁"], SP["cab"]]
    # "▁bcab": bc -2, ca -0.5, ab -1 -> ca first, which spoils bc and ab; of the new pairs
    # b+ca (bca) is no token, ca+b = cab -4 merges -> [▁, b, cab]
    assert ids("bcab") == [1, SP["▁"], SP["b"], SP["cab"]]
    # each space is a ▁ and the text starts with one: "▁ab▁▁c" -> ab, then ▁c -6 at the right
    assert ids("ab  c") == [1, SP["▁"], SP["ab"], SP["▁"], SP["▁c"]]


def test_sentencepiece_byte_fallback_and_round_trip(sp):
    # é (C3 A9) and 🙂 (F0 9F 99 82) are not in the vocabulary: one byte token per UTF-8 byte
    assert sp.encode("é") == [1, SP["▁"], BYTE0 + 0xC3, BYTE0 + 0xA9]
    assert sp.encode("a🙂") == [1, SP["▁a"]] + [BYTE0 + b for b in (0xF0, 0x9F, 0x99, 0x82)]
    assert sp.encode("\n") == [1, SP["▁"], BYTE0 + 0x0A]
    for text in ["abc", "ab  c", " abc", "é café\n\tx", "a🙂b", "x" * 50, "日本"]:
        assert sp.decode(sp.encode(text)) == text, text


def test_sentencepiece_bos_eos_space_prefix_and_specials(tmp_path, sp):
    assert sp.add_bos and not sp.add_eos  # llama.cpp's defaults for SentencePiece files
    assert (sp.bos_id, sp.eos_ids) == (1, (2,))
    assert sp.encode("") == [1]
    # a text that starts with <s> gets no second one; after a special token the text starts
    # with ▁ again, as llama.cpp splits it
    assert sp.encode("<s>abc</s>ab") == [1, SP["▁"], SP["abc"], 2, SP["▁"], SP["ab"]]
    assert sp.encode("<unk>") == [1, 0]
    assert sp.decode([1, SP["▁"], SP["abc"], 2]) == "abc"
    assert sp.decode([1, SP["▁"], SP["abc"], 2], skip_special=False) == "<s> abc</s>"
    # a user-defined token is one id, kept by decode
    assert sp.encode("[INST]ab") == [1, SP["[INST]"], SP["▁"], SP["ab"]]
    assert sp.decode(sp.encode("[INST]ab")) == "[INST] ab"
    prompt = sp.apply_chat_template([{"role": "user", "content": "abc"}])
    assert prompt == "<s>[INST] abc [/INST]"
    # after [INST] comes the ▁ llama.cpp puts after every special token, then the space's own
    assert sp.encode(prompt)[:5] == [1, SP["[INST]"], SP["▁"], SP["▁"], SP["abc"]]

    off = tokenizer_from_gguf_fields(sp_meta(tmp_path, "off.gguf", add_bos=False,
                                             add_eos=True, add_space_prefix=False))
    assert off.encode("abc") == [SP["abc"], 2]  # no ▁ in front (Gemma's files), no <s>
    # "c▁ab": ▁a -5, ab -1 -> ab, which spoils ▁a; c▁ and ▁ab are no tokens
    assert off.encode("c ab") == [SP["c"], SP["▁"], SP["ab"], 2]
    assert off.decode(off.encode("c ab")) == "c ab"


def test_phi3_special_tokens_take_the_whitespace_after_them(tmp_path):
    meta = sp_meta(tmp_path)
    # "\n ab" -> "▁\n▁ab": ▁, the byte 0A, then ▁a -5 loses to ab -1
    assert tokenizer_from_gguf_fields(meta).encode("[INST]\n ab") == [
        1, SP["[INST]"], SP["▁"], BYTE0 + 0x0A, SP["▁"], SP["ab"]]
    # llama.cpp, by general.name: Phi-3's special tokens but <s>, <unk>, <|endoftext|> strip it
    phi3 = tokenizer_from_gguf_fields({**meta, "general.name": "Phi3 Mini 4k"})
    assert phi3.encode("[INST]\n ab") == [1, SP["[INST]"], SP["▁"], SP["ab"]]
    assert phi3.encode("<s> ab") == [1, SP["▁"], SP["▁"], SP["ab"]]


def test_sentencepiece_needs_scores(tmp_path):
    meta = sp_meta(tmp_path)
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(ModelError, match="tokenizer.ggml.scores"):
        tokenizer_from_gguf_fields(meta)
    with pytest.raises(ModelError, match="'bert' is not supported"):
        tokenizer_from_gguf_fields({**meta, "tokenizer.ggml.model": "bert"})


def spm_reference(text: str, scores: dict[str, float], ids: dict[str, int]) -> list[int]:
    """llama.cpp's llm_tokenizer_spm_session, transcribed: bigrams in a heap by (score, left),
    stale ones skipped, then each final symbol spelled as a token or its bytes."""
    syms = list(text)  # one symbol per character; merged symbols grow, absorbed ones become ""
    nxt = list(range(1, len(syms))) + [-1]
    prv = list(range(-1, len(syms) - 1))
    heap = []

    def bigram(left, right):
        if left != -1 and right != -1 and syms[left] + syms[right] in scores:
            text = syms[left] + syms[right]
            heapq.heappush(heap, (-scores[text], left, right, text))

    for i in range(1, len(syms)):
        bigram(i - 1, i)
    while heap:
        _, left, right, text = heapq.heappop(heap)
        if not syms[left] or not syms[right] or syms[left] + syms[right] != text:
            continue
        syms[left], syms[right] = text, ""
        nxt[left] = nxt[right]
        if nxt[right] != -1:
            prv[nxt[right]] = left
        bigram(prv[left], left)
        bigram(left, nxt[left])
    out, i = [], 0
    while i != -1 and syms:
        s = syms[i]
        out += [ids[s]] if s in ids else [BYTE0 + b for b in s.encode()]
        i = nxt[i]
    return out


def test_sentencepiece_matches_a_transcription_of_llama_cpp(sp):
    scores = {t: s for t, s in SP_NORMAL.items() if t != "[INST]"}
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abcx é") for _ in range(rng.randint(1, 12)))
        want = [1] + spm_reference("▁" + text.replace(" ", "▁"), scores, SP)
        assert sp.encode(text) == want, text


# ---------------------------------------------------------------- BPE pre-tokenizers


def byte_level(text: str) -> str:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode())


BPE_EXTRA = ["12", "123", "1234", "12345", "45", "yz", "xyz"]
BPE_MERGES = ["1 2", "12 3", "123 4", "1234 5", "4 5", "y z"]  # xyz: no merge reaches it


def bpe_tokenizer(tmp_path, pre, **flags):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [bytes_to_unicode()[b] for b in range(256)] + BPE_EXTRA + ["<|begin|>", "<|end|>"]

    def fill(w):
        w.add_tokenizer_model("gpt2")
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
        w.add_token_merges(BPE_MERGES)
        w.add_bos_token_id(len(tokens) - 2)
        w.add_eos_token_id(len(tokens) - 1)
        if "add_bos" in flags:
            w.add_add_bos_token(flags["add_bos"])
    meta = write_gguf(tmp_path / f"bpe-{pre}.gguf", fill)
    return tokenizer_from_gguf_fields(meta), {t: i for i, t in enumerate(tokens)}


def pieces(tok, text):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    back = {c: b for b, c in bytes_to_unicode().items()}
    pre = tok.hf.backend_tokenizer.pre_tokenizer
    return [bytes(back[c] for c in p).decode() for p, _ in pre.pre_tokenize_str(text)]


TEXT = "Hi, I'm 12345 DON'T  go!!\n\n x=3.14"


@pytest.mark.parametrize("pre, want", [
    # llama.cpp's LLAMA3 regex: digits in groups of up to three, contractions of any case,
    # punctuation keeps the newlines after it
    ("llama-bpe", ["Hi", ",", " I", "'m", " ", "123", "45", " DON", "'T", " ", " go", "!!\n\n",
                   " x", "=", "3", ".", "14"]),
    # QWEN2: the same with one digit each
    ("qwen2", ["Hi", ",", " I", "'m", " ", "1", "2", "3", "4", "5", " DON", "'T", " ", " go",
               "!!\n\n", " x", "=", "3", ".", "1", "4"]),
    # GPT2: a space joins the number after it; lower-case contractions only
    ("gpt-2", ["Hi", ",", " I", "'m", " 12345", " DON", "'", "T", " ", " go", "!!", "\n\n",
               " x", "=", "3", ".", "14"]),
    # SMOLLM: every digit alone first, then GPT2's regex
    ("smollm", ["Hi", ",", " I", "'m", " ", "1", "2", "3", "4", "5", " DON", "'", "T", " ",
                " go", "!!", "\n\n", " x", "=", "3", ".", "1", "4"]),
])
def test_bpe_pre_tokenizer_splits_like_llama_cpp(tmp_path, pre, want):
    tok, _ = bpe_tokenizer(tmp_path, pre)
    assert pieces(tok, TEXT) == want
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_bpe_pre_tokenizer_ids_bos_and_ignore_merges(tmp_path):
    llama3, ids = bpe_tokenizer(tmp_path, "llama-bpe")
    # 12345 is one token, but Llama 3 never merges across its groups of three digits
    assert llama3.add_bos and llama3.encode("12345") == [ids["<|begin|>"], ids["123"], ids["45"]]
    # a piece that is a token is taken whole even where no merge leads to it
    assert llama3.encode("xyz")[1:] == [ids["xyz"]]
    assert llama3.eos_ids == (ids["<|end|>"],)
    gpt2, _ = bpe_tokenizer(tmp_path, "gpt-2")
    assert not gpt2.add_bos and gpt2.encode("12345") == [ids["12345"]]
    assert gpt2.encode("xyz") == [ids["x"], ids["yz"]]
    qwen2, _ = bpe_tokenizer(tmp_path, "qwen2", add_bos=False)
    assert qwen2.encode("12345") == [ids[d] for d in "12345"]
    assert qwen2.encode("<|begin|>1") == [ids["<|begin|>"], ids["1"]]


def test_unknown_pre_tokenizer_warns_and_splits_like_gpt2(tmp_path):
    with pytest.warns(UserWarning, match="pre-tokenizer 'no-such-regex' is unknown"):
        tok, ids = bpe_tokenizer(tmp_path, "no-such-regex")
    assert tok.encode("12345") == [ids["12345"]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no name at all: GPT-2's regex without a warning
        tok, _ = bpe_tokenizer(tmp_path, None)
    assert pieces(tok, TEXT) == pieces(bpe_tokenizer(tmp_path, "gpt-2")[0], TEXT)


def test_end_token_ids_found_by_text_as_llama_cpp_does():
    meta = {"tokenizer.ggml.tokens": ["<bos>", "<eos>", "<end_of_turn>", "a"],
            "tokenizer.ggml.eos_token_id": 1}
    assert end_token_ids(meta) == (1, 2)
    meta = {"tokenizer.ggml.tokens": ["<|end|>", "<|return|>", "<|call|>", "</s>"],
            "tokenizer.ggml.eos_token_id": 1}
    assert end_token_ids(meta) == (1, 2, 3)  # <|end|> only closes a message here
    assert end_token_ids({"tokenizer.ggml.model": "llama",
                          "tokenizer.ggml.tokens": SP_TOKENS}) == (2,)
