"""Tokenizers with one small interface: ``encode``, ``decode``, ``apply_chat_template``.

``Tokenizer`` wraps a Hugging Face fast tokenizer (built from GGUF metadata without torch, or
loaded from a ``save_pretrained`` directory). ``CharTokenizer`` is a tiny deterministic
character-level tokenizer for the random test models.
"""

from __future__ import annotations

from collections.abc import Sequence

from tfnb.errors import ModelError

__all__ = ["Tokenizer", "CharTokenizer", "tokenizer_from_gguf_fields"]

_GGUF_CONTROL = 3  # llama.cpp token type of special tokens such as <|im_start|>


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

    Examples
    --------
    >>> tok = load_model("smollm2").tokenizer  # doctest: +SKIP
    >>> tok.decode(tok.encode("Hello world"))  # doctest: +SKIP
    'Hello world'
    """

    def __init__(self, hf_tokenizer, bos_id: int | None, eos_ids: Sequence[int],
                 add_bos: bool = False):
        self.hf = hf_tokenizer
        self.bos_id = bos_id
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.add_bos = add_bos

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


def tokenizer_from_gguf_fields(meta: dict) -> Tokenizer:
    """Build a ``Tokenizer`` from GGUF ``tokenizer.*`` metadata (GPT-2 style BPE only).

    ``meta`` maps GGUF keys to decoded values. Control tokens (token type 3) become special
    added tokens, so they are never split. The ``smollm`` pre-tokenizer splits digits one by one,
    as llama.cpp and the original HF tokenizer do.

    Examples
    --------
    >>> tok = tokenizer_from_gguf_fields(meta)  # doctest: +SKIP
    """
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.ggml import GGUFGPTConverter

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelError(f"GGUF tokenizer model {kind!r} is not supported: expected 'gpt2' (BPE)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    converter = GGUFGPTConverter({
        "tokens": tokens,
        "merges": list(meta["tokenizer.ggml.merges"]),
        "add_prefix_space": bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
    })
    backend = converter.converted()
    if meta.get("tokenizer.ggml.pre") == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer])
    specials = [tokens[i] for i, t in enumerate(types) if t == _GGUF_CONTROL]
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])

    def name(i):
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    pad_id = meta.get("tokenizer.ggml.padding_token_id")
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=name(bos_id), eos_token=name(eos_id), pad_token=name(pad_id),
        unk_token=name(meta.get("tokenizer.ggml.unknown_token_id")),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    return Tokenizer(hf, bos_id=bos_id, eos_ids=() if eos_id is None else (eos_id,),
                     add_bos=add_bos)


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
