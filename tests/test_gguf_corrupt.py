"""Corrupt GGUF files: each one ModelError that names the bad value, never a raw traceback.

The files are tiny llama GGUFs written with the ``gguf`` package's own writer (the helper of
tests/test_models.py), with one thing changed as they are written.
"""
import gguf
import pytest

from tfnb.errors import ModelError
from tfnb.models import decoder, load_model

from .test_models import write_llama_gguf


def _write(path, monkeypatch, *, meta=None, rename=None, extra=(), drop=()):
    """A tiny GGUF with metadata ``meta`` ({writer method: value}) overriding the normal values,
    tensors renamed by ``rename`` ({old: new}), ``extra`` tensor names added and ``drop``ped."""
    meta, rename = dict(meta or {}), dict(rename or {})
    real = gguf.GGUFWriter

    class Corrupting(real):
        def __getattribute__(self, name):
            attr = super().__getattribute__(name)
            if name in meta:
                return lambda *_: attr(meta[name])
            return attr

        def add_tensor(self, name, tensor, *args, **kw):
            if name in drop:
                return
            super().add_tensor(rename.get(name, name), tensor, *args, **kw)
            for extra_name in extra:
                if name == "token_embd.weight":
                    super().add_tensor(extra_name, tensor[:2].copy(), *args, **kw)

    monkeypatch.setattr(gguf, "GGUFWriter", Corrupting)
    config = decoder.tiny_config()
    write_llama_gguf(path, config, decoder.random_weights(config))
    monkeypatch.setattr(gguf, "GGUFWriter", real)
    return path


@pytest.mark.parametrize("meta, message", [
    ({"add_head_count": 0}, r"'llama\.attention\.head_count'=0 .*expected a positive integer"),
    ({"add_block_count": 0}, r"'llama\.block_count'=0 .*expected a positive integer"),
    ({"add_head_count_kv": 0}, r"'llama\.attention\.head_count_kv'=0"),
    ({"add_head_count": 3}, r"'llama\.embedding_length'=64 .*not divisible by .*head_count'=3"),
    ({"add_head_count_kv": 3}, r"n_kv_heads=3 does not divide n_heads=4"),
    ({"add_feed_forward_length": 0}, r"'llama\.feed_forward_length'=0"),
    ({"add_layer_norm_rms_eps": 0.0},
     r"'llama\.attention\.layer_norm_rms_epsilon'=0\.0 .*positive number"),
])
def test_bad_metadata_is_named(tmp_path, monkeypatch, meta, message):
    path = _write(tmp_path / "bad.gguf", monkeypatch, meta=meta)
    with pytest.raises(ModelError, match=message) as err:
        load_model(path, progress=False)
    assert "bad.gguf" in str(err.value)


def test_an_extra_block_is_named(tmp_path, monkeypatch):
    path = _write(tmp_path / "extra.gguf", monkeypatch, extra=["blk.2.attn_norm.weight"])
    with pytest.raises(ModelError, match=r"\['blk\.2\.attn_norm\.weight'\] beyond its "
                                         r"'llama\.block_count'=2: expected blocks blk\.0 to "
                                         r"blk\.1"):
        load_model(path, progress=False)


@pytest.mark.parametrize("old, new", [
    ("blk.1.attn_q.weight", "blk.one.attn_q.weight"),   # index not a number
    ("blk.0.ffn_up.weight", "blk.0.ffn_upp.weight"),    # unknown tensor kind
    ("blk.0.attn_k.weight", "blk.0.attn_k.scale"),      # unknown suffix
])
def test_a_misnamed_block_tensor_is_named(tmp_path, monkeypatch, old, new):
    path = _write(tmp_path / "renamed.gguf", monkeypatch, rename={old: new})
    with pytest.raises(ModelError, match=rf"tensors \['{new}'\] that tfnb does not support"):
        load_model(path, progress=False)


def test_a_missing_block_tensor_is_named(tmp_path, monkeypatch):
    path = _write(tmp_path / "short.gguf", monkeypatch, drop={"blk.1.ffn_down.weight"})
    with pytest.raises(ModelError, match=r"lacks tensors for \['blocks\.1\.w_down'\]"):
        load_model(path, progress=False)


def test_the_uncorrupted_writer_still_loads(tmp_path, monkeypatch):
    model = load_model(_write(tmp_path / "ok.gguf", monkeypatch), progress=False)  # the control
    assert model.config.n_heads == 4 and model.config.n_layers == 2
