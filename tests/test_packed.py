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
from tfnb.models import decoder
from tfnb.models.packed import PackedStack, PackedTensor, fuse_rows, quantize_rows

from tests.test_models import write_llama_gguf

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize

INT8_TYPES = ["Q4_0", "Q4_1", "Q8_0"]         # what the int8 route multiplies
NEW_TYPES = ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "BF16"]
TYPES = ["F32", "F16", *INT8_TYPES, *NEW_TYPES]
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def cols_for(name, C):
    """``C`` columns, rounded up to whole 256-value blocks for a K-quant."""
    return -(-C // 256) * 256 if name in K_QUANTS else C


def packed_rows(w_MxC, name):
    """``w`` quantized (by gguf, or tfnb's K-quant rounding where gguf has no quantizer) as
    tfnb's packed rows (uint8 [M, row bytes]), and gguf's dequantization of them."""
    q = quantize_rows(w_MxC, kernels.QTYPES[name])
    return q, gguf_values(q, name, w_MxC.shape[1])


def gguf_values(w_MxR, name, C):
    return np.asarray(dequantize(w_MxR, gguf.GGMLQuantizationType[name]),
                      np.float32).reshape(len(w_MxR), C)


# the float16 scales of each new block type: (offset, count) in its block
_SCALES = {"Q5_0": (0, 1), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1)}


def random_blocks(rng, M, C, name):
    """Rows of random bytes (every code, fifth bit, 6-bit scale and min, and Q6_K's int8
    scales, of either sign) whose float16 scales are set to sane values (0.001 to 0.1)."""
    w_MxR = rng.integers(0, 256, (M, kernels.row_bytes(kernels.QTYPES[name], C)), np.uint8)
    if name in _SCALES:
        start, count = _SCALES[name]
        size = len(w_MxR[0]) // (C // (256 if name in K_QUANTS else 32))
        blocks = w_MxR.reshape(-1, size)
        d = rng.uniform(0.001, 0.1, (len(blocks), count)).astype(np.float16)
        blocks[:, start:start + 2 * count] = d.view(np.uint8)
    else:  # BF16: finite values of about 1
        w_MxR.view(np.uint16)[:] = (rng.standard_normal((M, C)).astype(np.float32)
                                    .view(np.uint32) >> 16).astype(np.uint16)
    return w_MxR, gguf_values(w_MxR, name, C)


# ---------------------------------------------------------------- the kernels


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("M,C,N", [(1, 32, 1), (7, 96, 3), (33, 576, 9), (5, 1536, 4),
                                   (6, 64, 5), (9, 64, 6), (3, 160, 8), (10, 96, 17),
                                   (4, 96, 2), (5, 160, 7), (3, 224, 1), (2, 40 * 32, 8),
                                   (13, 64, 10), (16, 96, 48), (70, 64, 19), (65, 96, 9)])
def test_packed_matmul_matches_gguf_dequantize(name, M, C, N):
    """Odd row counts, one-block and many-block rows, odd and even block counts; on AVX2 up
    to 5 activation rows at once in registers, more in tiles of 4 weight rows x 3 activation
    rows (and their 1 to 3 row remainders); on AVX-512 up to 8 in registers (1 to 8 take
    quantized weight rows two at a time, so an odd row count leaves one over, which one
    activation row multiplies two blocks a step, so an odd block count leaves one over), more
    in groups of 8 over chunks of 32 weight rows (a last group of 1 to 7 rows, a last chunk of
    1 to 31)."""
    import tensorflow as tf

    rng = np.random.default_rng(M * C + N)
    C = cols_for(name, C)
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


@pytest.mark.parametrize("name", NEW_TYPES)
@pytest.mark.parametrize("M,C,N", [(3, 256, 1), (9, 512, 5), (4, 1536, 11)])
def test_random_blocks_read_as_gguf_reads_them(name, M, C, N):
    """Blocks of random bytes (every code, high bit, packed 6-bit scale and min, and Q6_K's
    int8 scales of either sign) with sane float16 scales: the dequantize op gives gguf's values
    bit for bit (every product in them is exact in float32, so the order of the multiplies
    does not matter), and the matmul, eager and in XLA, gives their float product within
    float32 summation (1e-5 of sqrt(C) times the largest weight), a row alone as in the
    batch."""
    import tensorflow as tf

    rng = np.random.default_rng(M + C + N)
    w_MxR, ref_MxC = random_blocks(rng, M, C, name)
    qtype = kernels.QTYPES[name]
    assert np.array_equal(kernels.packed_dequantize(w_MxR, qtype, C).numpy(), ref_MxC)
    x_NxC = rng.standard_normal((N, C)).astype(np.float32)
    eager = kernels.packed_matmul(x_NxC, w_MxR, qtype, C).numpy()
    compiled = tf.function(lambda x, w: kernels.packed_matmul(x, w, qtype, C),
                           jit_compile=True)(x_NxC, w_MxR).numpy()
    tol = 1e-5 * np.sqrt(C) * np.abs(ref_MxC).max()
    for got in (eager, compiled):
        np.testing.assert_allclose(got, x_NxC.astype(np.float64) @ ref_MxC.T, atol=tol, rtol=0)
    if name != "BF16":  # float rows on AVX-512 sum in 4 chains at 1 row, 2 from 2 rows on
        assert np.array_equal(eager[-1:], kernels.packed_matmul(x_NxC[-1:], w_MxR, qtype,
                                                                C).numpy())


@pytest.mark.parametrize("name", K_QUANTS)
def test_k_quant_rounding_stays_within_half_a_step(name):
    """``quantize_rows``' K-quants (gguf has no quantizer for them), read back by gguf: each
    value within half its group's step, plus the rounding of the group's scale (6 bits of the
    block's largest; Q6_K: 8 bits, groups of 16 values). Q4_K and Q5_K groups span from their
    minimum or 0, whichever is lower (and rounded to 6 bits), to their maximum."""
    rng = np.random.default_rng(8)
    w_MxC = (rng.standard_normal((6, 512)) + rng.uniform(-1, 1, (6, 1))).astype(np.float32)
    w_MxR, ref_MxC = packed_rows(w_MxC, name)
    assert w_MxR.shape == (6, 2 * {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[name])
    if name == "Q6_K":
        groups = w_MxC.reshape(-1, 16, 16)
        step = np.abs(groups).max(-1) / 31
        bits = 127
    else:
        groups = w_MxC.reshape(-1, 8, 32)
        mins = -np.minimum(groups.min(-1), 0)  # rounded up: by up to 1/63 of the block's most
        span = groups.max(-1) + mins + mins.max(-1, keepdims=True) / 63
        step = span / (15 if name == "Q4_K" else 31)
        bits = 63
    bound = step / 2 + step.max(-1, keepdims=True) / bits / 2
    err = np.abs(ref_MxC - w_MxC).reshape(groups.shape).max(-1)
    assert (err <= bound * (1 + 1e-3)).all()
    assert np.median(err / bound) > 0.5  # and the bound is not loose


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("N,zero", [(48, range(11)), (8, (1, 5, 6)), (9, (8,)), (3, (0, 1, 2))])
def test_zero_rows_are_skipped_and_the_others_multiply_as_without_them(name, N, zero):
    """Rows of zeros (what the runtime makes of a prompt's padding and a lane's free rows) give
    zero outputs, and the other rows come out bit for bit as the same rows multiplied alone:
    the kernel multiplies only those, packed together."""
    import tensorflow as tf

    C, M = cols_for(name, 96), 70
    rng = np.random.default_rng(N)
    w_MxR, ref_MxC = packed_rows(rng.standard_normal((M, C)).astype(np.float32), name)
    x_NxC = rng.standard_normal((N, C)).astype(np.float32)
    x_NxC[list(zero)] = 0.0
    live = [n for n in range(N) if n not in set(zero)]
    qtype = kernels.QTYPES[name]
    compiled = tf.function(lambda x, w: kernels.packed_matmul(x, w, qtype, C), jit_compile=True)
    for run in (lambda x: kernels.packed_matmul(x, w_MxR, qtype, C).numpy(),
                lambda x: compiled(x, w_MxR).numpy()):
        got = run(x_NxC)
        assert not got[list(zero)].any()
        if live:
            assert np.array_equal(got[live], run(x_NxC[live]))
            np.testing.assert_allclose(got[live], x_NxC[live] @ ref_MxC.T, rtol=0,
                                       atol=1e-5 * np.sqrt(C) * np.abs(ref_MxC).max())


@pytest.mark.parametrize("name", [*INT8_TYPES, *NEW_TYPES[:-1]])
@pytest.mark.parametrize("C", [576, 1536])
def test_a_row_gets_the_same_bits_alone_as_among_up_to_8_rows(name, C):
    """A lone request's step and a batch's compute each output alike: from 1 to 8 activation
    rows (a decode step's), every row of the batch gives bit for bit what it gives alone, on
    this CPU's best code (the AVX2 code is pinned on every CPU below). On AVX-512, rows of 18
    blocks read their Q4_1 scales per block, rows of 48 convert them first below 8 rows, and
    the outputs' sums are reduced one at a time or eight at once."""
    rng = np.random.default_rng(C)
    C = cols_for(name, C)
    w_MxR, _ = packed_rows(rng.standard_normal((38, C)).astype(np.float32), name)
    x_NxC = rng.standard_normal((8, C)).astype(np.float32)
    qtype = kernels.QTYPES[name]
    alone = np.concatenate([kernels.packed_matmul(x_NxC[n:n + 1], w_MxR, qtype, C).numpy()
                            for n in range(8)])
    for N in range(2, 9):
        assert np.array_equal(kernels.packed_matmul(x_NxC[:N], w_MxR, qtype, C).numpy(),
                              alone[:N]), N


_SAME_BITS = """
import sys, numpy as np
from tfnb import kernels
data, bad = np.load(sys.argv[1]), []
x = data["x"]
for k in data.files:
    if not k.startswith("w_"):
        continue
    name, C = k[2:].rsplit("_", 1)
    C, w = int(C), data[k]
    alone = np.concatenate([kernels.packed_matmul(x[n:n + 1, :C], w, kernels.QTYPES[name], C)
                            .numpy() for n in range(len(x))])
    for N in list(range(2, 10)) + [16, len(x)]:
        got = kernels.packed_matmul(x[:N, :C], w, kernels.QTYPES[name], C).numpy()
        bad += [f"{name} C={C} M={w.shape[0]} N={N}"] * (not np.array_equal(got, alone[:N]))
print(kernels.isa(), "|", "; ".join(bad))
"""


def same_bits_in_batches(tmp_path, isa, names):
    """Under ``$TFNB_PACKED_ISA=isa``: the code that ran, and which of ``names``' matrices
    (odd and even row counts, one to six 256-value blocks a row) gave some row of a batch of
    2 to 9, 16 or 48 rows other bits than it gets alone."""
    rng = np.random.default_rng(9)
    arrays = {"x": rng.standard_normal((48, 1536)).astype(np.float32)}
    for name in names:
        for M, C in [(38, 576), (37, 1536), (5, 96)]:
            C = cols_for(name, C)
            arrays[f"w_{name}_{C}"] = packed_rows(
                rng.standard_normal((M, C)).astype(np.float32), name)[0]
    np.savez(tmp_path / "in.npz", **arrays)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TFNB_PACKED_")}
    done = subprocess.run([sys.executable, "-c", _SAME_BITS, str(tmp_path / "in.npz")],
                          capture_output=True, text=True, timeout=300,
                          env={**environ, **({} if isa == "best" else {"TFNB_PACKED_ISA": isa}),
                               "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0, done.stderr[-3000:]
    ran, _, bad = (part.strip() for part in done.stdout.strip().splitlines()[-1].partition("|"))
    return ran, bad


def test_avx2_code_gives_a_row_the_same_bits_alone_as_in_any_batch(tmp_path):
    """The AVX2 code (what CPUs without AVX-512 run; ``$TFNB_PACKED_ISA=avx2`` elsewhere) sums
    every output in the same order on each of its routes: one or two weight rows against up
    to 5 activation rows, and the decoded tiles of more (a batch of 6 to 8, a prompt). So
    every row of a batch of any size, including an odd last weight row, gives bit for bit
    what it gives alone, for every weight type."""
    isa, bad = same_bits_in_batches(tmp_path, "avx2", TYPES)
    if isa != "avx2":
        pytest.skip(f"this CPU has no AVX2 (the packed kernels run their {isa} code)")
    assert bad == ""


@pytest.mark.parametrize("isa", ["best", "portable"])
def test_newer_block_types_give_a_row_the_same_bits_alone_as_in_any_batch(tmp_path, isa):
    """Q5_0, Q5_1 and the K-quants sum each output in one order at any batch size on every
    code: on AVX-512 they take weight rows two at a time, and a range's odd last row alone,
    in one chain at any row count (the older block types' last row sums in four at 1 row)."""
    ran, bad = same_bits_in_batches(tmp_path, isa, NEW_TYPES[:-1])
    assert ran == (kernels.isa() if isa == "best" else "portable")
    assert bad == ""


def test_a_zero_row_is_not_multiplied():
    """A zero row is skipped, not multiplied by zeros: against a weight that holds NaN it
    still gives 0, where a product would give NaN (as the row that is multiplied does)."""
    import tensorflow as tf

    w_MxC = np.ones((3, 32), np.float32)
    w_MxC[1, 5] = np.nan
    x_NxC = np.ones((2, 32), np.float32)
    x_NxC[0] = 0.0
    w_MxR = w_MxC.view(np.uint8)
    compiled = tf.function(lambda x: kernels.packed_matmul(x, w_MxR, kernels.QTYPES["F32"], 32),
                           jit_compile=True)
    for got in (kernels.packed_matmul(x_NxC, w_MxR, kernels.QTYPES["F32"], 32).numpy(),
                compiled(x_NxC).numpy()):
        assert np.array_equal(got[0], [0.0, 0.0, 0.0])
        assert np.isnan(got[1, 1]) and got[1, 0] == got[1, 2] == 32.0


def q8_activations(x_NxC):
    """``x`` rounded as the int8 route (and llama.cpp's Q8_0) rounds it: per block of 32,
    ``q = rint(x * (127 / max|x|))`` (ties to even, float32 math) and scale ``d = max|x| / 127``
    kept as float16; returns ``q * d``, ``d`` before and ``d`` after the float16 rounding
    (N, C/32)."""
    x_NxBx32 = x_NxC.reshape(x_NxC.shape[0], -1, 32)
    amax = np.abs(x_NxBx32).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(x_NxBx32 * inv)
    assert np.abs(q).max() <= 127
    d = amax / np.float32(127)
    d16 = d.astype(np.float16).astype(np.float32)
    return (q * d16).reshape(x_NxC.shape).astype(np.float32), d[..., 0], d16[..., 0]


def llama_cpp_q8_dot(w_MxR, name, x_NxC):
    """llama.cpp's dot products of Q4_0, Q4_1 or Q8_0 rows with its Q8_0 (Q4_1: Q8_1)
    activations, written from ggml's quantize_row_q8_0/q8_1 and vec_dot_*_q8_*, in float64:
    per block the integer dot of the codes with q, times ``d_w * d_x`` (both float16), and for
    Q4_1 ``m * s`` with ``s = float16(d_x * sum q)``. Returns (N, M) outputs and, per output,
    what the float16 ``s`` moves it by at most (Q4_1; else 0)."""
    N, C = x_NxC.shape
    M, B = len(w_MxR), C // 32
    blk = w_MxR.reshape(M, B, {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[name])
    half = lambda a: a.copy().view(np.float16)[..., 0].astype(np.float64)  # noqa: E731
    if name == "Q8_0":
        codes = blk[..., 2:].view(np.int8).astype(np.int64)
    else:
        raw = blk[..., 4 if name == "Q4_1" else 2:].astype(np.int64)
        codes = np.concatenate([raw & 15, raw >> 4], -1) - (8 if name == "Q4_0" else 0)
    x_NxBx32 = x_NxC.reshape(N, B, 32)
    amax = np.abs(x_NxBx32).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(x_NxBx32 * inv[..., None]).astype(np.int64)
    d = (amax / np.float32(127)).astype(np.float32)
    d16 = d.astype(np.float16).astype(np.float64)
    out = (np.einsum("mbj,nbj->nmb", codes, q) * half(blk[..., :2])[None]
           * d16[:, None]).sum(-1)
    if name != "Q4_1":
        return out, np.zeros_like(out)
    s_exact = d.astype(np.float64) * q.sum(-1)
    s16 = (d * q.sum(-1).astype(np.float32)).astype(np.float16).astype(np.float64)
    m = half(blk[..., 2:4])
    return out + s16 @ m.T, np.abs(s16 - s_exact) @ np.abs(m).T


INT8_CASES = [(1, 32, 1), (7, 96, 3), (33, 576, 9), (5, 1536, 4), (19, 64, 8), (3, 160, 16),
              (2, 64, 7)]


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("M,C,N", INT8_CASES)
def test_int8_activations_are_exact_for_the_rounded_activations(name, M, C, N):
    """The int8 route computes what llama.cpp computes: equal to its formula (in numpy) up to
    float32 summation (the same tolerance as the float route), and within the rounding's own
    bound of the float32 result: each activation moves by at most half its block's scale
    ``d`` (and the float16 rounding of the scales), so an output moves by at most about
    ``sum_j |w_j| d_j / 2``. Groups of 8 weight rows and their tails, 1 to 16 activation rows,
    one-block and odd-length rows, blocks of zeros."""
    import tensorflow as tf

    rng = np.random.default_rng(M * C + N + 7)
    w_MxR, ref_MxC = packed_rows(rng.standard_normal((M, C)).astype(np.float32), name)
    x_NxC = (rng.standard_normal((N, C)) * rng.uniform(0.01, 10, (N, 1))).astype(np.float32)
    x_NxC[0, :32] = 0  # an all-zero block: scale 0, no NaN
    qtype = kernels.QTYPES[name]
    eager = kernels.packed_matmul(x_NxC, w_MxR, qtype, C, activations="int8").numpy()
    compiled = tf.function(lambda x, w: kernels.packed_matmul(x, w, qtype, C, "int8"),
                           jit_compile=True)(x_NxC, w_MxR).numpy()
    assert np.array_equal(eager, compiled)  # one kernel behind both
    _, d_NxB, d16_NxB = q8_activations(x_NxC)
    scale = np.sqrt(C) * np.abs(ref_MxC).max() * np.abs(x_NxC).max()
    want, s_moves = llama_cpp_q8_dot(w_MxR, name, x_NxC)
    np.testing.assert_allclose(eager, want, atol=1e-6 * scale, rtol=0)
    absw_MxB = np.abs(ref_MxC).reshape(M, -1, 32).sum(-1)
    # a value moves by half its block's step, plus 127 times the float16 rounding of the step
    bound_NxM = (0.5 * d_NxB + 127 * np.abs(d16_NxB - d_NxB)) @ absw_MxB.T + s_moves
    err_NxM = np.abs(eager - x_NxC.astype(np.float64) @ ref_MxC.T)
    assert (err_NxM <= bound_NxM + 1e-6 * scale).all()
    # and the bound is not vacuous: typical errors are a fraction of it
    assert np.median(err_NxM / (bound_NxM + 1e-30)) < 0.5


@pytest.mark.parametrize("name", INT8_TYPES)
def test_int8_rows_get_the_same_bits_alone_in_any_batch_and_anywhere_in_the_matrix(name):
    """The int8 code takes weight rows 8 at a time and a range's last few one by one, and
    activation rows 4 at a time: an output's bits depend on neither (the serving tests rely on
    a request's tokens not depending on its batch)."""
    rng = np.random.default_rng(11)
    w_MxR, _ = packed_rows(rng.standard_normal((37, 576)).astype(np.float32), name)
    x_NxC = rng.standard_normal((9, 576)).astype(np.float32)
    q = kernels.QTYPES[name]
    full = kernels.packed_matmul(x_NxC, w_MxR, q, 576, "int8").numpy()
    for n in range(9):
        alone = kernels.packed_matmul(x_NxC[n:n + 1], w_MxR, q, 576, "int8").numpy()
        assert np.array_equal(alone[0], full[n]), n
    for start in (1, 3, 8, 30):  # rows that sat in a group of 8 now in a tail, and back
        shifted = kernels.packed_matmul(x_NxC, w_MxR[start:], q, 576, "int8").numpy()
        assert np.array_equal(shifted, full[:, start:]), start


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_int8_activations_carry_inf_and_nan_to_their_row_only(name):
    rng = np.random.default_rng(6)
    w_MxR, ref_MxC = packed_rows(rng.standard_normal((9, 96)).astype(np.float32), name)
    x_NxC = rng.standard_normal((3, 96)).astype(np.float32)
    x_NxC[0, 40], x_NxC[1, 70] = np.nan, np.inf
    got = kernels.packed_matmul(x_NxC, w_MxR, kernels.QTYPES[name], 96, "int8").numpy()
    assert np.isnan(got[:2]).all()
    want = llama_cpp_q8_dot(w_MxR, name, x_NxC[2:])[0]
    np.testing.assert_allclose(got[2:], want, atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("name", [t for t in TYPES if t not in INT8_TYPES])
def test_int8_activations_leave_the_other_types_on_the_float_route(name):
    rng = np.random.default_rng(4)
    C = cols_for(name, 64)
    w_MxR, _ = packed_rows(rng.standard_normal((5, C)).astype(np.float32), name)
    x_NxC = rng.standard_normal((3, C)).astype(np.float32)
    q = kernels.QTYPES[name]
    assert np.array_equal(kernels.packed_matmul(x_NxC, w_MxR, q, C, "int8").numpy(),
                          kernels.packed_matmul(x_NxC, w_MxR, q, C).numpy())


def test_activations_option_is_checked():
    with pytest.raises(ValueError,
                       match=r"activations='int4': expected one of \['float32', 'int8'\]"):
        kernels.packed_matmul(np.ones((1, 32), np.float32), np.zeros((1, 20), np.uint8), 3, 32,
                              activations="int4")


_PORTABLE = """
import sys, numpy as np
from tfnb import kernels
data = np.load(sys.argv[1])
out = {}
for k in data.files:
    if k.startswith("w_"):
        name, n = k[2:].rsplit("_", 1)
        x = data["x_" + n]
        for route in kernels.ACTIVATIONS:
            out[f"{name}_{n}_{route}"] = kernels.packed_matmul(
                x, data[k], kernels.QTYPES[name], x.shape[1], route).numpy()
np.savez(sys.argv[2], isa=kernels.isa(), int8_isa=kernels.int8_isa(), **out)
"""


def test_portable_and_avx2_code_agree_with_this_cpus_best(tmp_path):
    """``$TFNB_PACKED_PORTABLE=1`` runs the C++ fallback that CPUs without AVX2 get, and
    ``$TFNB_PACKED_ISA=avx2`` the AVX2 code that CPUs without AVX-512 get (maddubs for the int8
    route), ``=avxvnni`` that of CPUs with AVX-VNNI but no AVX-512: every float route agrees
    with this machine's best up to summation, and the int8 route gives the same bits on every
    code (each output summed in one order, whichever instruction made its integer dots)."""
    rng = np.random.default_rng(5)
    arrays, refs = {}, {}
    for i, (M, C, N) in enumerate([(7, 96, 3), (11, 576, 9), (6, 160, 2), (5, 96, 8),
                                   (5, 2336, 9), (4, 2336, 3), (19, 96, 5)]):
        for name in ["F16", *INT8_TYPES, *NEW_TYPES]:
            Cn = cols_for(name, C)
            key = f"{i}k" if Cn != C else f"{i}"  # the K-quants' own activations
            if f"x_{key}" not in arrays:
                arrays[f"x_{key}"] = rng.standard_normal((N, Cn)).astype(np.float32)
                arrays[f"x_{key}"][0, 50] = np.nan  # row 0: NaN on both routes, both codes
            # the newer types: quantized floats, and random blocks (every bit pattern)
            w = random_blocks(rng, M, Cn, name) if name in NEW_TYPES and i % 2 else \
                packed_rows(rng.standard_normal((M, Cn)).astype(np.float32), name)
            arrays[f"w_{name}_{key}"], refs[f"{name}_{key}"] = w
    np.savez(tmp_path / "in.npz", **arrays)
    outs, isas = {}, {}
    envs = {"portable": {"TFNB_PACKED_PORTABLE": "1"}, "avx2": {"TFNB_PACKED_ISA": "avx2"},
            "avxvnni": {"TFNB_PACKED_ISA": "avxvnni"}, "best": {}}
    for env, extra in envs.items():
        environ = {k: v for k, v in os.environ.items() if not k.startswith("TFNB_PACKED_")}
        subprocess.run([sys.executable, "-c", _PORTABLE, str(tmp_path / "in.npz"),
                        str(tmp_path / f"{env}.npz")], check=True, timeout=300,
                       env={**environ, **extra, "TF_CPP_MIN_LOG_LEVEL": "3"})
        outs[env] = np.load(tmp_path / f"{env}.npz")
        isas[env] = str(outs[env]["isa"]), str(outs[env]["int8_isa"])
    assert isas["portable"] == ("portable", "portable")
    assert isas["avx2"] in (("avx2", "avx2"), ("portable", "portable"))  # a CPU without AVX2
    assert isas["best"] == (kernels.isa(), kernels.int8_isa())
    for key in outs["best"].files:
        if key in ("isa", "int8_isa"):
            continue
        name, i, route = key.rsplit("_", 2)
        x = arrays[f"x_{i}"]
        ref = refs[f"{name}_{i}"]
        tol = 1e-6 * np.sqrt(x.shape[1]) * np.abs(ref).max() * np.nanmax(np.abs(x))
        int8 = route == "int8" and name in INT8_TYPES
        for env in ("portable", "avx2", "avxvnni"):
            if int8:
                assert np.array_equal(outs[env][key], outs["best"][key], equal_nan=True), \
                    (key, env, isas[env])
            np.testing.assert_allclose(outs[env][key], outs["best"][key], atol=tol, rtol=0)
            assert np.isnan(outs[env][key][0]).all()
        assert np.isnan(outs["best"][key][0]).all()
        x = x[1:]
        want = llama_cpp_q8_dot(arrays[f"w_{name}_{i}"], name, x)[0] if int8 else x @ ref.T
        for env in envs:
            np.testing.assert_allclose(outs[env][key][1:], want, atol=tol, rtol=0)
    # the codes this CPU has ran (an AVX-512 VNNI CPU runs all four int8 codes)
    if isas["best"][1] == "vnni512":
        assert isas["avxvnni"][1] in ("avxvnni", "avx2")


_CONCURRENT = """
import os, sys, threading, time, numpy as np, tensorflow as tf
from tfnb import kernels
w = tf.constant(np.load(sys.argv[1])["w"])
C, Q8_0 = 576, kernels.QTYPES["Q8_0"]

@tf.function(jit_compile=True)
def layers(x):
    for _ in range(8):
        wide = tf.tanh(tf.tile(x, [256, 8]))  # a loop XLA spreads over its pool, whose thread
        x = x + tf.reduce_mean(tf.reshape(wide, [256, 4, 8 * C]), 0)[:, :C] * 1e-3  # runs on
        x = kernels.packed_matmul(x, w, Q8_0, C)[:, :C] * 1e-3  # into the packed matmul
    return x

x = tf.constant(np.random.default_rng(1).standard_normal((4, C)).astype(np.float32))
alone = layers(x).numpy()
results = []
def run():
    results.extend(layers(x).numpy() for _ in range(40))
threads = [threading.Thread(target=run, daemon=True) for _ in range(4)]
for t in threads:
    t.start()
deadline = time.monotonic() + 90  # about 6 s on 2 cores
for t in threads:
    t.join(max(0.0, deadline - time.monotonic()))
finished = not any(t.is_alive() for t in threads)
print(len(results), finished and all(np.array_equal(r, alone) for r in results), flush=True)
os._exit(0)  # threads stuck in C++ would keep a normal exit waiting
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 CPUs: with one, XLA's pool has one thread and the packed "
                           "matmul never splits its rows")
def test_packed_matmuls_of_concurrent_computations_all_finish(tmp_path):
    """Two lanes of a split run their stages at once on one worker. XLA runs a computation's
    next thunks on the pool thread that finished a parallel loop, so the packed matmul's caller
    is often a pool thread; when it waited for its queued row shards, 4 computations on a 2-core
    pool left every thread waiting and the worker spun for ever (a served split stopped
    answering). Each of 4 threads runs 40 computations, with the result of one alone."""
    rng = np.random.default_rng(0)
    w_MxR, _ = packed_rows(rng.standard_normal((1536, 576)).astype(np.float32), "Q8_0")
    np.savez(tmp_path / "w.npz", w=w_MxR)
    out = subprocess.run([sys.executable, "-c", _CONCURRENT, str(tmp_path / "w.npz")],
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    # "160 True": every computation finished, each with the result of one alone
    assert out.stdout.split()[-2:] == ["160", "True"], out.stdout[-500:] + out.stderr[-2000:]


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_many_rows_go_through_a_dequantized_dot_with_the_same_result(name):
    """A prefill's matmul (``DEQUANTIZE_ROWS`` rows or more) takes the dequantize-then-dot
    route inside XLA; it equals the packed kernel's result, so both routes give one model."""
    import tensorflow as tf

    from tfnb.runtime import forward as L

    rng = np.random.default_rng(3)
    C, M = cols_for(name, 96), 40
    w_MxR, ref_MxC = packed_rows(rng.standard_normal((M, C)).astype(np.float32), name)
    w = L.Packed(tf.constant(w_MxR), kernels.QTYPES[name], C)
    for N in (L.DEQUANTIZE_ROWS - 1, L.DEQUANTIZE_ROWS + 5):
        x_NxC = rng.standard_normal((N, C)).astype(np.float32)
        got = tf.function(lambda x: L.matmul(x, w), jit_compile=True)(x_NxC).numpy()
        np.testing.assert_allclose(got, x_NxC @ ref_MxC.T, rtol=0,
                                   atol=1e-5 * np.sqrt(C) * np.abs(ref_MxC).max())


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_rows_of_any_width_use_the_portable_path(name):
    rng = np.random.default_rng(1)
    w_MxR, ref_MxC = packed_rows(rng.standard_normal((3, 20)).astype(np.float32), name)
    x_NxC = rng.standard_normal((2, 20)).astype(np.float32)
    got = kernels.packed_matmul(x_NxC, w_MxR, kernels.QTYPES[name], 20).numpy()
    np.testing.assert_allclose(got, x_NxC @ ref_MxC.T, atol=1e-5)


@pytest.mark.parametrize("B,Bc,H,K,S,window,E", [(8, 8, 9, 3, 256, 128, 64),
                                                (3, 8, 4, 2, 64, 64, 8), (1, 2, 2, 1, 128, 64, 40)])
def test_decode_attention_reads_the_caches_in_place_as_attention_over_the_window(
        B, Bc, H, K, S, window, E):
    """``TfnbDecodeAttention`` (eager and inside XLA) equals the runtime's grouped-query
    attention over the gathered window with the decode mask: rows of the batch only (the caches
    may hold more), each row from its own padding to the write slot; a row that sees no slot
    (padding past the slot, as a free row of a lane) gets zeros, not NaN. Head widths of 64, 8
    and 40 take the 16-lane loops, their remainder, and both."""
    import tensorflow as tf

    from tfnb.runtime.forward import attention, decode_mask

    rng = np.random.default_rng(B * S + E)
    q = rng.standard_normal((B, H, E)).astype(np.float32)
    kc, vc = (rng.standard_normal((Bc, K, S, E)).astype(np.float32) * 3 for _ in range(2))
    slot = window - 7
    pad = rng.integers(0, slot + 1, B).astype(np.int32)
    pad[0] = slot + 1                                   # sees nothing
    if B > 1:
        pad[1] = slot                                   # sees its own slot only
    mask = decode_mask(pad, slot, window)
    want = attention(q[:, None], kc[:B, :, :window], vc[:B, :, :window], mask).numpy()[:, 0]
    want[0] = 0.0
    eager = kernels.decode_attention(q, kc, vc, pad, np.int32(slot), window).numpy()
    compiled = tf.function(lambda *a: kernels.decode_attention(*a, window),
                           jit_compile=True)(q, kc, vc, pad, np.int32(slot)).numpy()
    for got in (eager, compiled):
        assert got.shape == (B, H * E) and np.isfinite(got).all()
        np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(vc).max(), rtol=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"window 300.*1 <= window <= S"):
        kernels.decode_attention(q, kc, vc, pad, np.int32(slot), 300)


def test_bad_packed_shapes_name_what_is_expected():
    import tensorflow as tf

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"expected \[rows, 40\]"):
        kernels.packed_matmul(np.ones((1, 64), np.float32), np.zeros((2, 41), np.uint8), 3, 64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="qtype 10"):  # Q2_K
        kernels.packed_matmul(np.ones((1, 64), np.float32), np.zeros((2, 40), np.uint8), 10, 64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="256 for the K-quants"):
        kernels.packed_matmul(np.ones((1, 64), np.float32), np.zeros((2, 36), np.uint8), 12, 64)
    with pytest.raises(ValueError, match="'Q4_1' with 40 columns"):
        kernels.row_bytes(kernels.QTYPES["Q4_1"], 40)
    with pytest.raises(ValueError, match=r"'Q6_K' with 288 columns.*256 for the K-quants"):
        kernels.row_bytes(kernels.QTYPES["Q6_K"], 288)


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


@pytest.mark.parametrize("kinds,common", [(("Q5_0", "Q5_0", "Q8_0"), "Q8_0"),
                                          (("Q4_0", "Q8_0"), "Q8_0"), (("Q4_1", "Q5_1"), "Q5_1")])
def test_matrices_of_types_one_holds_exactly_fuse_packed_in_that_type(kinds, common):
    """llama-quantize's mixes give a block's q and k one type and its v another (Q4_K_M:
    Q5_0 and Q8_0): fused, they stay packed, value for value, instead of becoming float32."""
    rng = np.random.default_rng(7)
    parts, refs = [], []
    for i, name in enumerate(kinds):
        if name in _SCALES:
            w_MxR, ref_MxC = random_blocks(rng, 3 + i, 64, name)
        else:
            w_MxR, ref_MxC = packed_rows(rng.standard_normal((3 + i, 64)).astype(np.float32),
                                         name)
        parts.append(PackedTensor(w_MxR, kernels.QTYPES[name], 64))
        refs.append(ref_MxC.T)
    fused = fuse_rows(parts)
    assert isinstance(fused, PackedTensor) and fused.qtype_name == common
    assert np.array_equal(np.asarray(fused), np.concatenate(refs, 1))
    # a pair no type holds exactly (Q5_1 has a min, Q8_0 none) stays packed side by side
    q51, ref51 = random_blocks(rng, 2, 64, "Q5_1")
    q80, ref80 = packed_rows(rng.standard_normal((2, 64)).astype(np.float32), "Q8_0")
    mixed = fuse_rows([PackedTensor(q51, kernels.QTYPES["Q5_1"], 64),
                       PackedTensor(q80, kernels.QTYPES["Q8_0"], 64)])
    assert isinstance(mixed, PackedStack) and mixed.shape == (64, 4)
    assert mixed.nbytes == q51.nbytes + q80.nbytes
    assert np.array_equal(np.asarray(mixed), np.concatenate([ref51.T, ref80.T], 1))


# ---------------------------------------------------------------- packed models


def write_quantized_gguf(path, config, weights, types):
    """A llama GGUF with each matrix in ``types[kind]`` (kind: embed, attn, ffn) or
    ``types[its GGUF name]``, written by gguf's writer after tfnb's F32 layout: quantized here
    (``quantize_rows``), from the same canonical weights."""
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
        qtype = types.get(name, types[kind])
        qt = gguf.GGMLQuantizationType[qtype]
        rows = quantize_rows(data.reshape(-1, data.shape[-1]), kernels.QTYPES[qtype])
        writer.add_tensor(name, rows.reshape(*data.shape[:-1], -1), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(path) + ".q", path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    config = decoder.tiny_config(n_layers=3)
    path = tmp_path_factory.mktemp("packed") / "tiny-q.gguf"
    write_quantized_gguf(path, config, decoder.random_weights(config, 3),
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


def test_a_k_quant_gguf_runs_packed_as_float32_does(tmp_path, cluster):
    """The common download: K-quant matrices and a tied Q6_K embedding (the token lookup
    dequantizes the gathered rows, the head multiplies the packed table) stay packed, read
    as gguf reads them, at a fraction of their float32 bytes, and decode the float32 path's
    tokens and logits (up to summation order)."""
    config = decoder.tiny_config(hidden_size=256, ffn_size=512)
    path = tmp_path / "tiny-k.gguf"
    write_quantized_gguf(path, config, decoder.random_weights(config, 4),
                         {"embed": "Q6_K", "attn": "Q4_K", "ffn": "Q5_K"})
    packed = tfnb.load_model(path, progress=False)
    floats = tfnb.load_model(path, weights="float32", progress=False)
    assert packed.packed and packed.weights["embed"].qtype_name == "Q6_K"
    assert packed.weights["blocks.1.wq"].qtype_name == "Q4_K"
    assert packed.weights["blocks.0.w_down"].qtype_name == "Q5_K"
    for name, w in floats.weights.items():
        assert np.array_equal(np.asarray(packed.weights[name]), w), name
    assert packed.nbytes < 0.2 * floats.nbytes
    ref = tfnb.place(floats, [cluster.devices[0]], cluster)
    placed = tfnb.place(packed, [cluster.devices[0]], cluster)
    assert placed.generate_ids(PROMPTS, max_new_tokens=8) == \
        ref.generate_ids(PROMPTS, max_new_tokens=8)
    for got, want in zip(placed.logits(PROMPTS), ref.logits(PROMPTS)):
        assert np.abs(got - want).max() <= 1e-4 * np.ptp(want)


def test_a_q4_k_m_style_mix_stays_packed_and_decodes_as_float32_does(tmp_path, cluster):
    """Q4_K_M gives some blocks a Q6_K v (or up) beside Q4_K q and k (gate): no one type holds
    the other, so the fused matrix is a stack of both, each multiplied in its own blocks; the
    device holds the file's bytes, and decoding equals the float32 path."""
    config = decoder.tiny_config(hidden_size=256, ffn_size=512)
    path = tmp_path / "tiny-k-mixed.gguf"
    write_quantized_gguf(path, config, decoder.random_weights(config, 6),
                         {"embed": "Q6_K", "attn": "Q4_K", "ffn": "Q4_K",
                          "blk.0.attn_v.weight": "Q6_K", "blk.1.ffn_up.weight": "Q6_K"})
    packed = tfnb.load_model(path, progress=False)
    floats = tfnb.load_model(path, weights="float32", progress=False)
    placed = tfnb.place(packed, [cluster.devices[0]], cluster)
    p0, p1 = placed.params[0]["blocks"][:2]
    assert [part.qtype for part in p0.wqkv.parts] == [kernels.QTYPES[t] for t in
                                                      ("Q4_K", "Q4_K", "Q6_K")]
    assert [part.qtype for part in p1.w_gate_up.parts] == [kernels.QTYPES[t] for t in
                                                           ("Q4_K", "Q6_K")]
    held = sum(v.shape.num_elements() * v.dtype.size for v in placed.variables)
    assert held <= 1.05 * packed.nbytes and packed.nbytes < 0.25 * floats.nbytes
    ref = tfnb.place(floats, [cluster.devices[0]], cluster)
    assert placed.generate_ids(PROMPTS, max_new_tokens=8) == \
        ref.generate_ids(PROMPTS, max_new_tokens=8)
    for got, want in zip(placed.logits(PROMPTS), ref.logits(PROMPTS)):
        assert np.abs(got - want).max() <= 1e-4 * np.ptp(want)


def test_weights_option_is_checked(tiny_gguf, tmp_path):
    with pytest.raises(ModelError,
                       match=r"weights='int3': expected one of \['packed', 'float32'\]"):
        tfnb.load_model(tiny_gguf, weights="int3", progress=False)
    with pytest.raises(ModelError, match="packed weights come from GGUF files"):
        tfnb.load_model(tmp_path, weights="packed", progress=False)


PROMPTS = [[1, 5, 9, 14, 30], [1, 44, 7]]


def test_packed_decode_matches_float32_on_one_and_two_workers(tiny_gguf, cluster):
    """The same tokens and, up to summation order, logits as the float32 path; with three
    prompts of three lengths the packed path also skips the padding's rows in the prompts'
    matmuls and the fourth, free row of the batch in every decode step."""
    packed = tfnb.load_model(tiny_gguf, progress=False)
    floats = tfnb.load_model(tiny_gguf, weights="float32", progress=False)
    ref = tfnb.place(floats, [cluster.devices[0]], cluster)
    want_ids = ref.generate_ids(PROMPTS, max_new_tokens=12)
    want_logits = ref.logits(PROMPTS)
    for devices in ([cluster.devices[0]], cluster.devices[:2]):
        placed = tfnb.place(packed, devices, cluster)
        assert len(set(placed.assignment.values())) == len(devices)
        assert placed.generate_ids(PROMPTS, max_new_tokens=12) == want_ids
        assert placed.generate_ids(PROMPTS + [[1, 8]], max_new_tokens=12) == \
            ref.generate_ids(PROMPTS + [[1, 8]], max_new_tokens=12)
        for got, want in zip(placed.logits(PROMPTS), want_logits):
            # the same float math but for summation order: within 1e-4 of the logits' range
            assert np.abs(got - want).max() <= 1e-4 * np.ptp(want)
    # the workers hold the packed bytes (split: the tied embedding on both ends)
    var_bytes = sum(int(np.prod(v.shape)) * v.dtype.size for v in placed.variables)
    assert var_bytes == packed.nbytes + packed.weights["embed"].nbytes


def test_int8_activations_are_a_placement_option(tiny_gguf, cluster):
    """``place(..., activations="int8")`` multiplies the Q4_0, Q4_1 and Q8_0 matrices as
    llama.cpp does: the logits move from the float route's by the activations' rounding (not
    at all would mean the route was not taken), a request's tokens do not depend on its
    batch, a replaced placement keeps the route, and a value that is no route is one
    ``PlacementError``."""
    packed = tfnb.load_model(tiny_gguf, progress=False)
    ref = tfnb.place(packed, [cluster.devices[0]], cluster)
    placed = tfnb.place(packed, cluster.devices[:2], cluster, activations="int8")
    assert (ref.activations, placed.activations) == ("float32", "int8")
    want = placed.logits(PROMPTS)
    for got, floats in zip(want, ref.logits(PROMPTS)):
        assert 0 < np.abs(got - floats).max() <= 0.02 * np.ptp(floats)
    together = placed.generate_ids(PROMPTS, max_new_tokens=8)
    assert together == [placed.generate_ids([p], max_new_tokens=8)[0] for p in PROMPTS]
    moved = placed.replace([cluster.devices[0]])
    assert moved.activations == "int8"
    for got, w in zip(moved.logits(PROMPTS), want):
        assert np.abs(got - w).max() <= 1e-5 * np.ptp(w)
    with pytest.raises(PlacementError, match=r"activations='int4': expected one of "
                                             r"\['float32', 'int8'\]"):
        tfnb.place(packed, [cluster.devices[0]], cluster, activations="int4")


def test_calibration_times_a_packed_blocks_matmuls(tmp_path):
    """Calibration feeds its loops rows that are not zeros: the packed kernel skips zero rows,
    and a block fed zeros passes zeros on, so such a loop would time a packed block's matmuls
    as free (3% of the float32 block's time, probed). Timed, a packed block's decode step
    costs a good part of the float32 one's (its 4 MB of weights against 25 MB). And a step
    reads as many cache slots as it is told to attend (4x the time at 1024 as at 16 slots)."""
    from tfnb.runtime.calibrate import time_stages

    config = decoder.tiny_config(hidden_size=1024, ffn_size=4096, n_layers=1, n_heads=8,
                               n_kv_heads=4)
    path = tmp_path / "wide-q.gguf"
    write_quantized_gguf(path, config, decoder.random_weights(config, 5),
                         {"embed": "Q8_0", "attn": "Q4_0", "ffn": "Q4_1"})
    packed = tfnb.load_model(path, progress=False)
    dev = "/device:CPU:0"
    # 64 steps a timed call: this head's step (tens of microseconds) then stands out of a
    # call's own jitter (with 4 steps its timed difference once came out as 0 under load)
    kw = dict(slots=64, steps=64, repeats=5, stream_bytes=0)
    packed_s = time_stages(packed.config, [dev], like=packed.weights, **kw)[dev]
    float_s = time_stages(packed.config, [dev], **kw)[dev]
    for kind in ("block", "head"):
        assert packed_s[kind] > 0.1 * float_s[kind], (kind, packed_s, float_s)
    # a packed model's attention reads a row's slots in place, up to its current one: a step
    # is timed attending what it is asked to, not the few slots a count from 0 would reach
    # (a block whose caches outweigh its weights: 8 KV heads of 32 over 1024 slots, 8 rows)
    config = decoder.tiny_config(hidden_size=256, ffn_size=512, n_layers=1, n_heads=8,
                               n_kv_heads=8)
    write_quantized_gguf(path, config, decoder.random_weights(config, 6),
                         {"embed": "Q8_0", "attn": "Q4_0", "ffn": "Q4_1"})
    kv = tfnb.load_model(path, progress=False)
    kw = dict(slots=1024, steps=16, repeats=3, stream_bytes=0, like=kv.weights, batch=8)
    few, all_ = (time_stages(kv.config, [dev], attend=a, **kw)[dev]["block"] for a in (16, 1024))
    assert all_ > 2 * few, (few, all_)


def test_a_packed_models_profile_counts_its_in_place_attention_as_attention(tiny_gguf, cluster):
    """A packed model's decode steps attend through tfnb's op inside the compiled blocks, and a
    profile of them books that op's time as attention, not as a matmul (tfnb's other custom
    calls)."""
    import tfnb.profiler

    packed = tfnb.load_model(tiny_gguf, progress=False)
    placed = tfnb.place(packed, [cluster.devices[0]], cluster)
    placed.eos_ids = ()
    placed.generate_ids(PROMPTS[:1], max_new_tokens=4)   # compiles outside the profile
    with tfnb.profiler.profile(cluster, timeout=30) as prof:
        placed.generate_ids(PROMPTS[:1], max_new_tokens=16)
    assert not prof.partial, prof.reasons
    block = next(r for r in prof.stage_times(placed) if r["stage"] == "block.1")
    assert block["steps"] > 0 and block["step_kinds"].get("attention", 0) > 0, block
    kinds = {e["kind"] for e in prof.compiled
             if e["stage"] == "block.1" and e["name"].startswith("TfnbDecodeAttention")}
    assert kinds == {"attention"}, sorted({(e["kind"], e["name"]) for e in prof.compiled})


def test_a_worker_without_the_packed_ops_takes_the_xla_route(tiny_gguf):
    """A plain ``tf.distribute.Server`` (no tfnb kernels loaded): a packed model placed there
    takes the XLA route by itself and generates; asked for the kernel there, ``place`` names
    the missing op and the ways out."""
    from tests.plain_servers import plain_servers

    with plain_servers(1) as addresses:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cluster = tfnb.connect(addresses, timeout=30.0)
        model = tfnb.load_model(tiny_gguf, progress=False)
        with pytest.raises(PlacementError, match="TfnbPackedDequantize") as err:
            tfnb.place(model, [cluster.devices[0]], cluster, route="kernel")
        assert "tfnb worker" in str(err.value) and "route='xla'" in str(err.value)
        placed = tfnb.place(model, [cluster.devices[0]], cluster)
        assert set(placed.stage_routes.values()) == {"xla"} and "xla" in repr(placed)
        assert len(placed.generate_ids(PROMPTS[0], max_new_tokens=2)) == 2
        # planning times the stages there as they will run: on the XLA route, or on the route
        # the plan is made for
        with pytest.raises(PlacementError, match="TfnbPackedDequantize"):
            tfnb.plan(model, cluster, route="kernel")
        planned = tfnb.place(model, tfnb.plan(model, cluster), cluster)
        assert planned.generate_ids(PROMPTS[0], max_new_tokens=2) == \
            placed.generate_ids(PROMPTS[0], max_new_tokens=2)


def test_kernels_docstring_examples_run():
    import doctest

    result = doctest.testmod(kernels, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 4
