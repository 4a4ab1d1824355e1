"""The XLA route's compact weights (``tfnb.runtime.compact``): every packed type held in plain
tensors gives gguf's values, one-row and many-row products agree with them, and a decode loop
compiled whole keeps the weights compact."""

import re

import numpy as np
import pytest
import tensorflow as tf

from tfnb import kernels
from tfnb.runtime import compact

from tests.test_packed import gguf_values, packed_rows, random_blocks

gguf = pytest.importorskip("gguf")

EXACT = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"]
FORM = {"F32": "float", "F16": "float", "BF16": "float", "Q8_0": "q8", "Q5_0": "q8",
        "Q4_0": "q4", "Q4_1": "q4"}


def blocks_of(rng, M, C, name):
    """Random rows of ``name`` blocks (every code) and gguf's values of them."""
    if name in ("Q5_0", "BF16"):
        return random_blocks(rng, M, C, name)
    return packed_rows(rng.standard_normal((M, C)).astype(np.float32), name)


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("M,C", [(1, 32), (7, 96), (33, 576)])
def test_compact_values_and_products_match_gguf(name, M, C):
    rng = np.random.default_rng(M * C)
    rows, values_MxC = blocks_of(rng, M, C, name)
    w = compact.to_compact(tf.constant(rows), kernels.QTYPES[name])
    assert w.form == FORM[name] and w.cols == C and w.rows == M
    np.testing.assert_array_equal(compact.dequantize(w).numpy(), values_MxC)
    ids = np.array([M - 1, 0, M // 2])
    np.testing.assert_array_equal(compact.gather_rows(w, tf.constant(ids)).numpy(),
                                  values_MxC[ids])
    R = compact.REDUCE_ROWS
    for N in (1, R, R + 1, R + 7):  # the fused reduce (its rows), the dequantized dot
        x_NxC = rng.standard_normal((N, C)).astype(np.float32)
        want = x_NxC.astype(np.float64) @ values_MxC.T.astype(np.float64)
        got = tf.function(compact.matmul, jit_compile=True)(tf.constant(x_NxC), w).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_the_compact_form_takes_the_file_bytes():
    """q8 and q4 hold the blocks' own bytes (values, scales, minimums), nothing more."""
    rng = np.random.default_rng(0)
    for name in ("Q8_0", "Q4_0", "Q4_1", "BF16"):
        rows, _ = blocks_of(rng, 8, 256, name)
        w = compact.to_compact(tf.constant(rows), kernels.QTYPES[name])
        held = sum(t.shape.num_elements() * t.dtype.size for t in (w.q, w.d, w.m)
                   if t is not None)
        assert held == rows.nbytes, name


@pytest.mark.parametrize("name", ["Q5_1", "Q4_K", "Q6_K"])
def test_other_types_are_requantized_with_their_error_stated(name):
    from tfnb.models.packed import PackedTensor

    rng = np.random.default_rng(1)
    rows, values_MxC = random_blocks(rng, 4, 256, name)
    q8, error = compact.requantized(PackedTensor(rows, kernels.QTYPES[name], 256))
    assert q8.qtype_name == "Q8_0" and q8.shape == (256, 4)
    back = gguf_values(q8.data, "Q8_0", 256)
    measured = (np.abs(back - values_MxC) / np.abs(values_MxC).max(1, keepdims=True)).max()
    assert error == pytest.approx(measured) and 0 < error < 0.01


def test_to_compact_refuses_a_type_it_cannot_hold_exactly():
    with pytest.raises(ValueError, match="no exact compact form"):
        compact.to_compact(tf.zeros([1, 144], tf.uint8), kernels.QTYPES["Q4_K"])


@pytest.mark.parametrize("N", [1, compact.REDUCE_ROWS + 1])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "F16"])
def test_a_compiled_decode_loop_keeps_the_weights_compact(name, N):
    """Inside a loop compiled whole, the weights' widening stays in the loop body: XLA's
    loop-invariant code motion hoists it when nothing ties it to the step's input
    (``compact._tied``) and carries a float32 copy of every matrix through the loop. The
    one-row product makes no float32 matrix at all; the dot of more rows makes one per step."""
    rng = np.random.default_rng(2)
    M, C = 512, 256
    rows, _ = blocks_of(rng, M, C, name)
    w = compact.to_compact(tf.constant(rows), kernels.QTYPES[name])
    w = w._replace(**{k: tf.Variable(getattr(w, k)) for k in "qdm" if getattr(w, k) is not None})

    @tf.function(jit_compile=True)
    def loop(x_NxC):
        def step(i, x):
            return i + 1, tf.tanh(compact.matmul(x, w)[:, :C])
        return tf.while_loop(lambda i, x: i < 8, step, (0, x_NxC))[1]

    x = tf.constant(rng.standard_normal((N, C)).astype(np.float32))
    hlo = loop.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    whole = re.compile(rf"f32\[{M},{C // 32},32\]|f32\[{M},{C}\]|f32\[{C},{M}\]")
    assert whole.search(hlo), "the values are widened somewhere"
    carried = " ".join(re.findall(r"= \(([^)]*)\) while\(", hlo))
    assert carried and not whole.search(carried), "a float32 matrix is carried through the loop"
    if N <= compact.REDUCE_ROWS:
        assert not [c for c in materialized(hlo) if whole.search(c)], \
            "a float32 copy of the matrix is made"
    assert np.isfinite(loop(x).numpy()).all()


def materialized(hlo: str) -> list[str]:
    """The computations of an optimized HLO module whose values are buffers: all but the
    bodies of fusions (whose intermediate values live in registers)."""
    computations = re.split(r"\n(?=%|ENTRY)", hlo)
    fused = set(re.findall(r"kind=k\w+, calls=(%[\w.-]+)", hlo))
    return [c for c in computations if c.split(" ", 1)[0] not in fused]
