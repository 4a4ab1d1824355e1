"""Packed GGUF weights: tfnb's kernels against gguf's own dequantizer, and packed models against
the float32 path on real workers."""
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import tfnb
from tfnb import kernels
from tfnb.errors import ModelError, PlacementError
from tfnb.models import llama
from tfnb.models.packed import PackedTensor, fuse_rows

from tests.test_models import write_llama_gguf

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

TYPES = ["F32", "F16", "Q4_0", "Q4_1", "Q8_0"]


def packed_rows(w_MxC, name):
    """``w`` quantized by gguf and viewed as tfnb's packed rows (uint8 [M, row bytes])."""
    qt = gguf.GGMLQuantizationType[name]
    q = np.ascontiguousarray(quantize(w_MxC, qt))
    return q.view(np.uint8).reshape(w_MxC.shape[0], -1), dequantize(q, qt).astype(np.float32)


# ---------------------------------------------------------------- the kernels


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("M,C,N", [(1, 32, 1), (7, 96, 3), (33, 576, 9), (5, 1536, 4)])
def test_packed_matmul_matches_gguf_dequantize(name, M, C, N):
    """Odd row counts, one-block and many-block rows, batches around the kernel's groups of 4."""
    import tensorflow as tf

    rng = np.random.default_rng(M * C + N)
    w_MxR, ref_MxC = packed_rows(rng.standard_normal((M, C)).astype(np.float32), name)
    x_NxC = rng.standard_normal((N, C)).astype(np.float32)
    want = x_NxC @ ref_MxC.T
    tol = 1e-5 * np.sqrt(C) * np.abs(ref_MxC).max()
    qtype = kernels.QTYPES[name]
    eager = kernels.packed_matmul(x_NxC, w_MxR, qtype, C).numpy()
    compiled = tf.function(lambda x, w: kernels.packed_matmul(x, w, qtype, C),
                           jit_compile=True)(x_NxC, w_MxR).numpy()
    np.testing.assert_allclose(eager, want, atol=tol, rtol=0)
    np.testing.assert_allclose(compiled, want, atol=tol, rtol=0)
    assert np.array_equal(kernels.packed_dequantize(w_MxR, qtype, C).numpy(), ref_MxC)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_many_rows_go_through_a_dequantized_dot_with_the_same_result(name):
    """A prefill's matmul (``DEQUANTIZE_ROWS`` rows or more) takes the dequantize-then-dot
    route inside XLA; it equals the packed kernel's result, so both routes give one model."""
    import tensorflow as tf

    from tfnb.runtime import llama as L

    rng = np.random.default_rng(3)
    C, M = 96, 40
    w_MxR, ref_MxC = packed_rows(rng.standard_normal((M, C)).astype(np.float32), name)
    w = L.Packed(tf.constant(w_MxR), kernels.QTYPES[name], C)
    for N in (L.DEQUANTIZE_ROWS - 1, L.DEQUANTIZE_ROWS + 5):
        x_NxC = rng.standard_normal((N, C)).astype(np.float32)
        got = tf.function(lambda x: L.matmul(x, w), jit_compile=True)(x_NxC).numpy()
        np.testing.assert_allclose(got, x_NxC @ ref_MxC.T, rtol=0,
                                   atol=1e-5 * np.sqrt(C) * np.abs(ref_MxC).max())


@pytest.mark.parametrize("name", ["F32", "F16"])
def test_float_rows_of_any_width_use_the_portable_path(name):
    rng = np.random.default_rng(1)
    w_MxR, ref_MxC = packed_rows(rng.standard_normal((3, 20)).astype(np.float32), name)
    x_NxC = rng.standard_normal((2, 20)).astype(np.float32)
    got = kernels.packed_matmul(x_NxC, w_MxR, kernels.QTYPES[name], 20).numpy()
    np.testing.assert_allclose(got, x_NxC @ ref_MxC.T, atol=1e-5)


def test_bad_packed_shapes_name_what_is_expected():
    import tensorflow as tf

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"expected \[rows, 40\]"):
        kernels.packed_matmul(np.ones((1, 64), np.float32), np.zeros((2, 41), np.uint8), 3, 64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="qtype 6"):
        kernels.packed_matmul(np.ones((1, 64), np.float32), np.zeros((2, 40), np.uint8), 6, 64)
    with pytest.raises(ValueError, match="'Q4_1' with 40 columns"):
        kernels.row_bytes(kernels.QTYPES["Q4_1"], 40)


def test_packed_tensor_reads_as_its_float_values():
    rng = np.random.default_rng(2)
    w_MxR, ref_MxC = packed_rows(rng.standard_normal((6, 64)).astype(np.float32), "Q4_0")
    p = PackedTensor(w_MxR, kernels.QTYPES["Q4_0"], 64)
    assert p.shape == (64, 6) and p.nbytes == 6 * 36 and p.size == 384
    assert np.array_equal(np.asarray(p), ref_MxC.T)  # canonical (in, out)
    table = PackedTensor(w_MxR, kernels.QTYPES["Q4_0"], 64, transposed=False)
    assert np.array_equal(np.asarray(table), ref_MxC)
    fused = fuse_rows([p, p])
    assert isinstance(fused, PackedTensor) and np.array_equal(np.asarray(fused),
                                                              np.concatenate([ref_MxC.T] * 2, 1))
    mixed = fuse_rows([p, np.asarray(p)])  # types differ: float32 side by side
    assert isinstance(mixed, np.ndarray) and mixed.shape == (64, 12)


# ---------------------------------------------------------------- packed models


def write_quantized_gguf(path, config, weights, types):
    """A llama GGUF with each matrix in ``types[kind]`` (kind: embed, attn, ffn), written by
    gguf's writer after tfnb's F32 layout: quantized here, from the same canonical weights."""
    write_llama_gguf(path, config, weights)  # F32 reference layout (permuted q/k rows)
    reader = gguf.GGUFReader(str(path))
    tensors = [(t.name, np.array(t.data)) for t in reader.tensors]
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    del reader
    writer = gguf.GGUFWriter(str(path) + ".q", "llama")
    for key, field in fields.items():
        if key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    for name, data in tensors:
        kind = "embed" if name.startswith("token_embd") else \
            "ffn" if ".ffn_" in name else "attn" if name.endswith("weight") and data.ndim == 2 \
            else None
        if kind is None:
            writer.add_tensor(name, data)
            continue
        qt = gguf.GGMLQuantizationType[types[kind]]
        writer.add_tensor(name, quantize(data, qt), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(path) + ".q", path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    config = llama.tiny_config(n_layers=3)
    path = tmp_path_factory.mktemp("packed") / "tiny-q.gguf"
    write_quantized_gguf(path, config, llama.random_weights(config, 3),
                         {"embed": "Q8_0", "attn": "Q4_0", "ffn": "Q4_1"})
    return path


def test_a_quantized_gguf_loads_packed_by_default(tiny_gguf):
    packed = tfnb.load_model(tiny_gguf, progress=False)
    floats = tfnb.load_model(tiny_gguf, weights="float32", progress=False)
    assert packed.packed and not floats.packed
    assert packed.weights["embed"].qtype_name == "Q8_0"
    assert packed.weights["blocks.0.wk"].qtype_name == "Q4_0"
    assert packed.weights["blocks.2.w_down"].qtype_name == "Q4_1"
    for name, w in floats.weights.items():  # the same values, dequantized by gguf
        assert np.array_equal(np.asarray(packed.weights[name]), w), name
    assert packed.nbytes < 0.3 * floats.nbytes
    assert packed.chain.unique_param_bytes == packed.nbytes
    assert "packed" in repr(packed)


def test_weights_option_is_checked(tiny_gguf, tmp_path):
    with pytest.raises(ModelError, match=r"weights='int3': expected one of \['packed', 'float32'\]"):
        tfnb.load_model(tiny_gguf, weights="int3", progress=False)
    with pytest.raises(ModelError, match="packed weights come from GGUF files"):
        tfnb.load_model(tmp_path, weights="packed", progress=False)


PROMPTS = [[1, 5, 9, 14, 30], [1, 44, 7]]


def test_packed_decode_matches_float32_on_one_and_two_workers(tiny_gguf, cluster):
    packed = tfnb.load_model(tiny_gguf, progress=False)
    floats = tfnb.load_model(tiny_gguf, weights="float32", progress=False)
    ref = tfnb.place(floats, [cluster.devices[0]], cluster)
    want_ids = ref.generate_ids(PROMPTS, max_new_tokens=12)
    want_logits = ref.logits(PROMPTS)
    for devices in ([cluster.devices[0]], cluster.devices[:2]):
        placed = tfnb.place(packed, devices, cluster)
        assert len(set(placed.assignment.values())) == len(devices)
        assert placed.generate_ids(PROMPTS, max_new_tokens=12) == want_ids
        for got, want in zip(placed.logits(PROMPTS), want_logits):
            # the same float math but for summation order: within 1e-4 of the logits' range
            assert np.abs(got - want).max() <= 1e-4 * np.ptp(want)
    # the workers hold the packed bytes (split: the tied embedding on both ends)
    var_bytes = sum(int(np.prod(v.shape)) * v.dtype.size for v in placed.variables)
    assert var_bytes == packed.nbytes + packed.weights["embed"].nbytes


def wait_for_port(port, proc, timeout=90.0):
    import socket
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the plain TF server exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def test_a_worker_without_the_packed_ops_gets_one_clear_error(tiny_gguf):
    """A plain ``tf.distribute.Server`` (no tfnb kernels loaded): placing packed weights on it
    names the missing op and the way out; float32 weights still place there."""
    from tfnb.cluster.local import free_ports
    from tfnb.cluster.security import LoopbackGuard
    from tfnb.errors import ClusterError

    port = free_ports(1)[0]
    try:
        guard = LoopbackGuard([port])
    except ClusterError as e:
        pytest.skip(f"a plain TF server listens on every interface; no loopback guard here ({e})")
    code = ("import tensorflow as tf, sys; tf.distribute.Server(tf.train.ClusterSpec("
            f"{{'worker': ['127.0.0.1:{port}']}}), 'worker', 0).join()")
    server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    try:
        wait_for_port(port, server)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cluster = tfnb.connect([f"127.0.0.1:{port}"], timeout=30.0)
        with pytest.raises(PlacementError, match="TfnbPackedDequantize") as err:
            tfnb.place(tfnb.load_model(tiny_gguf, progress=False), [cluster.devices[0]], cluster)
        assert "tfnb worker" in str(err.value) and "weights='float32'" in str(err.value)
        floats = tfnb.load_model(tiny_gguf, weights="float32", progress=False)
        assert len(tfnb.place(floats, [cluster.devices[0]], cluster).generate_ids(
            PROMPTS[0], max_new_tokens=2)) == 2
    finally:
        server.kill()
        server.wait(timeout=10)
        guard.close()
