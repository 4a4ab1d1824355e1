"""Tokenizers with one small interface: ``encode``, ``decode``, ``apply_chat_template``.

``Tokenizer`` wraps a Hugging Face fast tokenizer (built from GGUF metadata without torch, or
loaded from a ``save_pretrained`` directory). ``CharTokenizer`` is a tiny deterministic
character-level tokenizer for the random test models.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from tfnb.errors import ModelError

__all__ = ["Tokenizer", "CharTokenizer", "tokenizer_from_gguf_fields", "end_token_ids"]

# llama.cpp token types (tokenizer.ggml.token_type): <unk>, control (<s>, <|im_start|>) and
# user-defined tokens are matched in the text before it is split, so they are never broken up
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# BPE pre-tokenizers by `tokenizer.ggml.pre`, as llama.cpp's src/llama-vocab.cpp splits text:
# each regex in turn splits every piece (matches and the text between them both kept), then
# bytes map to GPT-2's alphabet. Tekken's and GPT-4o's regexes are the models' own
# tokenizer.json ones (upper/lower-case letter classes), which llama.cpp emulates.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_TAIL_RE = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_RE = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL_RE
_QWEN2_RE = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL_RE
_QWEN35_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
              r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_RE = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_RE = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
             rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS = "digits"  # one token per digit, then GPT-2's regex (the pre-tokenizer SmolLM uses)

# name -> (splits, ignore_merges, add_bos default). Splits () keep GPT-2's regex alone.
# ignore_merges: a piece that is itself a token is taken whole, without merging.
_PRE_TOKENIZERS: dict[str, tuple] = {}
for _names, _spec in [
    ("gpt-2 phi-2 mpt olmo jais trillion exaone4 gigachat a.x-4.0 mellum granite-docling",
     ((), False, False)),
    ("smollm starcoder refact command-r codeshell exaone minerva-7b mellum2",
     (_DIGITS, False, False)),
    ("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
     ((_LLAMA3_RE,), True, True)),
    ("dbrx smaug-bpe", ((_LLAMA3_RE,), False, False)),
    ("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2",
     ((_QWEN2_RE,), False, False)),
    ("qwen35", ((_QWEN35_RE,), False, False)),
    ("tekken", ((_TEKKEN_RE,), True, True)),
    ("gpt-4o llama4 kanana2 talkie minimax-m2", ((_GPT4O_RE,), False, False)),
    ("falcon", ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE, r"[0-9][0-9][0-9]"), False, False)),
    ("default", ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"),
                 False, False)),
]:
    _PRE_TOKENIZERS.update(dict.fromkeys(_names.split(), _spec))

# Tokens that end generation, found by their text as llama.cpp does (files rarely list
# end-of-turn tokens such as Gemma's <end_of_turn> or Phi-3's <|end|> in their metadata)
_END_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
    # fill-in-the-middle padding, repository and file separators
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>",
    "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
])


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise ModelError(f"messages={messages!r:.80}: expected a list of "
                         "{'role': ..., 'content': ...} dicts")


class Tokenizer:
    """A Hugging Face ``PreTrainedTokenizerFast`` behind tfnb's small tokenizer interface.

    Parameters
    ----------
    hf_tokenizer : transformers.PreTrainedTokenizerFast
    bos_id : int or None
    eos_ids : tuple of int
    add_bos : bool
        Whether ``encode`` starts with ``bos_id`` (GGUF ``tokenizer.ggml.add_bos_token``).
    add_eos : bool
        Whether ``encode`` ends with ``eos_ids[0]`` (GGUF ``tokenizer.ggml.add_eos_token``).

    Examples
    --------
    >>> tok = load_model("smollm2").tokenizer  # doctest: +SKIP
    >>> tok.decode(tok.encode("Hello world"))  # doctest: +SKIP
    'Hello world'
    """

    def __init__(self, hf_tokenizer, bos_id: int | None, eos_ids: Sequence[int],
                 add_bos: bool = False, add_eos: bool = False):
        self.hf = hf_tokenizer
        self.bos_id = bos_id
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.add_bos = add_bos
        self.add_eos = add_eos

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings such as ``<|im_start|>`` map to one id."""
        if not isinstance(text, str):
            raise ModelError(f"text={text!r:.80}: expected a str")
        ids = self.hf.encode(text, add_special_tokens=False)
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        if self.add_eos and self.eos_ids and ids[-1:] != [self.eos_ids[0]]:
            ids = ids + [self.eos_ids[0]]
        return list(ids)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; special tokens (``<|im_end|>`` ...) are dropped unless asked for."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt text for ``messages``, ending with the assistant's turn opener."""
        _check_messages(messages)
        if not self.hf.chat_template:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.hf.apply_chat_template(list(messages), tokenize=False,
                                           add_generation_prompt=True)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_ids={self.eos_ids})")


def end_token_ids(meta: dict) -> tuple[int, ...]:
    """Ids that end generation, as llama.cpp finds them: eos, eot and eom ids, then tokens
    named like end tokens (``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>``, ...).

    The eos id comes first.

    Examples
    --------
    >>> end_token_ids({"tokenizer.ggml.tokens": ["<s>", "</s>", "<|end|>"],
    ...                "tokenizer.ggml.eos_token_id": 1})
    (1, 2)
    """
    tokens = list(meta.get("tokenizer.ggml.tokens", ()))
    ids = [meta.get(f"tokenizer.ggml.{kind}_token_id")
           for kind in ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")]
    if meta.get("tokenizer.ggml.model") == "llama" and ids[0] is None:
        ids[0] = 2  # llama.cpp's default </s> for SentencePiece vocabularies
    ids += [i for i, t in enumerate(tokens) if t in _END_TEXTS]
    ends = [int(i) for i in dict.fromkeys(ids) if i is not None and 0 <= int(i) < len(tokens)]
    names = {tokens[i]: i for i in ends}
    # llama.cpp's exceptions: <|end|> closes a message, not the answer, in gpt-oss style
    # vocabularies; </s> is no end token beside Gemma 4's <|tool_response>
    if "<|end|>" in names and ({"<|return|>", "<|call|>"} <= names.keys()
                               or {"<|calls|>", "<|flush|>"} <= names.keys()):
        ends.remove(names["<|end|>"])
    if "</s>" in names and "<|tool_response>" in names:
        ends.remove(names["</s>"])
    return tuple(ends)


def tokenizer_from_gguf_fields(meta: dict) -> Tokenizer:
    """Build a ``Tokenizer`` from GGUF ``tokenizer.*`` metadata.

    ``meta`` maps GGUF keys to decoded values. Two kinds of vocabulary, as llama.cpp reads them:

    - ``tokenizer.ggml.model == "gpt2"``: byte-level BPE with merges (SmolLM, Llama 3, Qwen);
      text is first split by the pre-tokenizer named in ``tokenizer.ggml.pre`` (``llama-bpe``:
      digits in groups of up to three, ``qwen2`` and ``smollm``: one digit each, ...). A name
      tfnb does not know warns and splits like GPT-2.
    - ``"llama"``: SentencePiece BPE with scores (Llama 2, Mistral, Phi-3, Gemma): the pair
      whose merged token scores highest merges first, characters outside the vocabulary become
      ``<0xNN>`` byte tokens, spaces become ``▁`` and text starts with one
      (``tokenizer.ggml.add_space_prefix``, default true).

    Control, unknown and user-defined tokens (token types 3, 2, 4) are never split.
    ``encode`` adds bos/eos as ``tokenizer.ggml.add_bos_token``/``add_eos_token`` say
    (llama.cpp's defaults when absent: bos for SentencePiece, Llama 3 and Tekken vocabularies).

    Examples
    --------
    >>> tok = tokenizer_from_gguf_fields(meta)  # doctest: +SKIP
    """
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelError(f"GGUF tokenizer model {kind!r} is not supported: expected 'gpt2' "
                         "(byte-level BPE) or 'llama' (SentencePiece)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    spm = kind == "llama"

    def token_id(key, default=None):
        i = meta.get(f"tokenizer.ggml.{key}_token_id", default if spm else None)
        return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

    # llama.cpp's defaults for SentencePiece files: <unk> 0, <s> 1, </s> 2
    bos_id, eos_id, unk_id = token_id("bos", 1), token_id("eos", 2), token_id("unknown", 0)
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", spm))
    if spm:
        backend, add_bos = _sentencepiece_backend(meta, tokens, unk_id, add_prefix), True
    else:
        backend, add_bos = _byte_level_backend(meta, tokens, add_prefix)
    _add_unsplit_tokens(backend, meta, tokens, types)

    def name(i):
        return None if i is None else tokens[i]

    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=name(bos_id), eos_token=name(eos_id), pad_token=name(token_id("padding")),
        unk_token=name(unk_id),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    return Tokenizer(hf, bos_id=bos_id, eos_ids=end_token_ids(meta),
                     add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)),
                     add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)))


def _byte_level_backend(meta: dict, tokens: list, add_prefix: bool):
    """GPT-2 style BPE (transformers' GGUF converter) with the file's pre-tokenizer; returns
    the backend and llama.cpp's add-bos default for that pre-tokenizer."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.ggml import GGUFGPTConverter

    backend = GGUFGPTConverter({
        "tokens": tokens,
        "merges": list(meta["tokenizer.ggml.merges"]),
        "add_prefix_space": add_prefix,
    }).converted()
    pre = meta.get("tokenizer.ggml.pre")
    spec = _PRE_TOKENIZERS.get(pre)
    if spec is None:
        if pre is not None:  # an absent name keeps GPT-2's regex quietly, as files before it did
            warnings.warn(f"GGUF pre-tokenizer {pre!r} is unknown to tfnb: text is split like "
                          "GPT-2, so digits and punctuation may form other tokens than in "
                          f"llama.cpp; known: {sorted(_PRE_TOKENIZERS)}", UserWarning,
                          stacklevel=3)
        return backend, False
    splits, ignore_merges, add_bos = spec
    if splits == _DIGITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer])
    elif splits:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=False)])
    backend.model.ignore_merges = ignore_merges
    return backend, add_bos


def _sentencepiece_backend(meta: dict, tokens: list, unk_id: int | None, add_prefix: bool):
    """SentencePiece BPE through transformers' ``GGUFLlamaConverter``.

    GGUF stores scores, not merges: the merges are every split of a token into two tokens,
    ranked by the merged token's score (transformers' ``generate_merges``), so BPE merges the
    highest-scoring pair first as llama.cpp does. Merges of pieces holding a space are left out:
    they could never apply (spaces become ``▁`` first) and the converter reads merges as
    space-separated pairs.
    """
    from transformers.convert_slow_tokenizer import generate_merges
    from transformers.integrations.ggml import GGUFLlamaConverter

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) < len(tokens):
        raise ModelError("GGUF tokenizer model 'llama' needs 'tokenizer.ggml.scores', one per "
                         f"token ({len(tokens)}): got "
                         f"{'none' if scores is None else len(scores)}")
    scores = [float(s) for s in scores[:len(tokens)]]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [f"{a} {b}" for a, b in generate_merges(vocab, list(zip(tokens, scores)))
              if " " not in a and " " not in b]
    return GGUFLlamaConverter({
        "tokens": tokens, "scores": scores, "merges": merges, "unk_token_id": unk_id,
        "add_prefix_space": add_prefix,
        # all normal: the special tokens are added by _add_unsplit_tokens, with llama.cpp's set
        "token_type": [1] * len(tokens),
    }).converted()


def _add_unsplit_tokens(backend, meta: dict, tokens: list, types: list) -> None:
    """Make unknown, control and user-defined tokens single tokens wherever they appear; the
    first two are special (dropped by ``decode``)."""
    from tokenizers import AddedToken

    kept = [i for i, t in enumerate(types) if t in (_UNKNOWN, _CONTROL, _USER_DEFINED)]
    # llama.cpp's rule for Phi-3 (by general.name): the whitespace after a special token other
    # than <unk>, <s>, <|endoftext|> belongs to it, as in Phi-3's own tokenizer
    rstrip = set()
    if any(n in str(meta.get("general.name", "")).lower() for n in ("phi-3", "phi3")):
        rstrip = {tokens[i] for i in kept} | {"</s>"}
        rstrip -= {"<unk>", "<s>", "<|endoftext|>"}

    def added(i, special):
        return AddedToken(tokens[i], special=special, normalized=False,
                          rstrip=tokens[i] in rstrip)

    backend.add_special_tokens([added(i, True) for i in kept if types[i] != _USER_DEFINED])
    backend.add_tokens([added(i, False) for i in kept if types[i] == _USER_DEFINED])


class CharTokenizer:
    """A deterministic character tokenizer for tiny test models.

    Ids: 0 unknown, 1 ``<bos>``, 2 ``<eos>``, 3 newline, then printable ASCII from space upwards,
    as many as ``vocab_size`` allows (92 characters, space to ``{``, for vocab 96). Characters
    outside the alphabet encode to 0 and decode to ``"?"``. The chat template is
    ``"<role>: <content>\\n"`` per message, then ``"assistant:"``.

    Examples
    --------
    >>> tok = CharTokenizer(96)
    >>> tok.encode("Hi!")
    [44, 77, 5]
    >>> tok.decode(tok.encode("Hi!"))
    'Hi!'
    >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    'user: Hi\\nassistant:'
    """

    unk_id, bos_id, eos_id, _first_char = 0, 1, 2, 3

    def __init__(self, vocab_size: int = 96):
        n_chars = min(vocab_size - self._first_char, 1 + 95)
        if n_chars < 1:
            raise ModelError(f"vocab_size={vocab_size}: expected at least 4 for CharTokenizer")
        self.alphabet = "\n" + "".join(chr(c) for c in range(32, 32 + n_chars - 1))
        self._id_of = {ch: self._first_char + i for i, ch in enumerate(self.alphabet)}
        self.eos_ids = (self.eos_id,)
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, one per character (no bos added)."""
        if not isinstance(text, str):
            raise ModelError(f"text={text!r:.80}: expected a str")
        return [self._id_of.get(ch, self.unk_id) for ch in text]

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; bos/eos are dropped unless ``skip_special=False``."""
        out = []
        for i in ids:
            i = int(i)
            if i in (self.bos_id, self.eos_id):
                if not skip_special:
                    out.append("<bos>" if i == self.bos_id else "<eos>")
            elif self._first_char <= i < self._first_char + len(self.alphabet):
                out.append(self.alphabet[i - self._first_char])
            else:
                out.append("?")
        return "".join(out)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """``"role: content\\n"`` per message, then ``"assistant:"``."""
        _check_messages(messages)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab={self.vocab_size})"
