"""Load models saved by Hugging Face ``save_pretrained`` (TF weights) or as ``.keras`` files.

Nothing here reaches a hub: every transformers call uses ``local_files_only=True``.
"""

from __future__ import annotations

import json
import os
import zipfile

from tfnb.errors import ModelError
from tfnb.models.chain import variables_chain
from tfnb.models.tokenizer import Tokenizer

__all__ = ["load_hf_dir", "load_keras_file", "hf_blocks", "hf_chain", "tied_embedding_names",
           "LLAMA_FAMILY"]

# model_type values whose TF models use TFMistral's variable layout and convert to llama weights.
LLAMA_FAMILY = ("mistral",)


def load_hf_dir(path: str):
    """``(hf_model, tokenizer_or_None)`` of a ``save_pretrained`` directory of a TF causal LM.

    Examples
    --------
    >>> hf_model, tok = load_hf_dir("/tmp/my-gpt2")  # doctest: +SKIP
    """
    from transformers import AutoConfig, TFAutoModelForCausalLM

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelError(f"directory {path!r} has no config.json: expected a directory written "
                         "by save_pretrained, a .gguf file or a .keras file")
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here
        raise ModelError(f"config.json in {path!r} cannot be read ({type(exc).__name__}: "
                         f"{str(exc)[:120]}): expected a transformers config") from None
    try:
        hf_model = TFAutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise ModelError(f"{path!r} holds a {hf_config.model_type!r} model, which has no "
                             "TensorFlow causal-LM class: expected a causal language model "
                             "such as gpt2 or mistral") from None
        raise ModelError(f"{path!r} cannot be loaded as a causal LM ({str(exc)[:160]}): "
                         "expected TF weights written by save_pretrained") from None
    except OSError as exc:
        raise ModelError(f"{path!r} cannot be loaded as a causal LM ({str(exc)[:160]}): "
                         "expected TF weights (tf_model.h5) written by save_pretrained") from None
    if not hf_model.built:
        hf_model(hf_model.dummy_inputs)
    return hf_model, _load_tokenizer(path)


def _load_tokenizer(path: str):
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        hf_tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for bad files
        raise ModelError(f"tokenizer files in {path!r} cannot be read ({type(exc).__name__}: "
                         f"{str(exc)[:120]}): expected files written by save_pretrained") from None
    eos = hf_tok.eos_token_id
    return Tokenizer(hf_tok, bos_id=hf_tok.bos_token_id, eos_ids=() if eos is None else (eos,))


def hf_blocks(hf_model) -> tuple[object, list]:
    """``(main_layer, blocks)`` of an HF TF transformer: the list of its decoder blocks.

    Examples
    --------
    >>> main, blocks = hf_blocks(gpt2_model)  # doctest: +SKIP
    >>> len(blocks) == gpt2_model.config.n_layer  # doctest: +SKIP
    True
    """
    main = getattr(hf_model, hf_model.base_model_prefix, None) or hf_model.layers[0]
    n_layers = hf_model.config.num_hidden_layers
    for value in vars(main).values():
        if (isinstance(value, (list, tuple)) or type(value).__name__ == "ListWrapper") \
                and len(value) == n_layers and n_layers and hasattr(value[0], "weights"):
            return main, list(value)
    raise ModelError(f"cannot find the {n_layers} blocks of {type(hf_model).__name__}: "
                     "expected a main layer holding a list of transformer blocks")


def tied_embedding_names(hf_model) -> tuple[str, ...]:
    """Variable names of the input embedding when the LM head reuses it, else ``()``."""
    try:
        inp, out = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return ()
    if inp is not None and out is inp:
        return tuple(w.name for w in inp.weights)
    return ()


def hf_chain(hf_model):
    """``LayerChain`` of an opaque HF causal LM (see ``tfnb.models.chain`` for the cost model).

    Examples
    --------
    >>> hf_chain(gpt2_model).names  # doctest: +SKIP
    ['embed', 'block.0', 'block.1', 'head']
    """
    cfg = hf_model.config
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = hidden // heads
    return variables_chain(
        hf_model, tied_names=tied_embedding_names(hf_model),
        kv_bytes_per_token=2 * kv_heads * head_dim * 4, act_bytes=hidden * 4,
        out_bytes=cfg.vocab_size * 4, attn_flops=4 * heads * head_dim)


def _keras_major(path: str) -> int | None:
    try:
        with zipfile.ZipFile(path) as archive:
            meta = json.loads(archive.read("metadata.json"))
    except (zipfile.BadZipFile, KeyError, ValueError, OSError):
        return None
    version = str(meta.get("keras_version", ""))
    return int(version.split(".")[0]) if version[:1].isdigit() else None


def load_keras_file(path: str):
    """The model in a ``.keras`` file: Keras 3 files via ``keras``, Keras 2 via ``tf_keras``.

    The version comes from the archive's ``metadata.json``; without one both loaders are tried.

    Examples
    --------
    >>> model = load_keras_file("/tmp/model.keras")  # doctest: +SKIP
    """
    major = _keras_major(path)
    if major is None and not zipfile.is_zipfile(path):
        raise ModelError(f"{path!r} is not a .keras archive (not a zip file): expected a file "
                         "written by model.save('....keras')")

    def load_3():
        import keras

        return keras.saving.load_model(path)

    def load_2():
        import tf_keras

        return tf_keras.models.load_model(path)

    loaders = [load_3, load_2] if major == 3 else \
        [load_2, load_3] if major == 2 else [load_3, load_2]
    errors = []
    for loader in loaders:
        try:
            return loader()
        except Exception as exc:  # noqa: BLE001 - Keras raises many types for a bad file
            errors.append(f"{type(exc).__name__}: {str(exc)[:100]}")
    raise ModelError(f"{path!r} cannot be loaded by Keras ({'; '.join(errors)}): expected a "
                     "complete .keras file whose custom layers are importable")
