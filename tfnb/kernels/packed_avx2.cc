// The float route's AVX2 code (AVX2, FMA, F16C), what x86 CPUs without AVX-512 run: each
// group of 32 weights (a block, or an eighth of a K-quant block: DecodeGroup) is dequantized
// into four ymm registers and multiplied there, never written out. Up to kMaxN activation rows read the packed rows directly; more go through
// register tiles of decoded rows. Every route sums an output in one order, so a row's outputs
// are the same bits alone as in a batch of any size (tests/test_packed.py pins it).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "packed_common.h"

#ifdef TFNB_X86
namespace tfnb {
namespace packed {
namespace {

// 32 unsigned nibbles of a Q4 block (16 bytes) as four vectors of 8 floats, in value order.
// Each half of the bytes is widened once, straight from memory, and gives two vectors (its low
// nibbles masked, its high ones shifted down): the same values as widening four shifted
// copies of the bytes, in fewer instructions.
TFNB_AVX2 inline __m256i Widen8(const uint8_t* p) {  // 8 bytes as 8 unsigned 32-bit lanes
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

TFNB_AVX2 inline void Nibbles(const uint8_t* qs, __m256* q) {
  const __m256i mask = _mm256_set1_epi32(0x0f);
  const __m256i bytes0 = Widen8(qs), bytes8 = Widen8(qs + 8);
  q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes0, mask));  // values 0-7
  q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes8, mask));  // 8-15
  q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes0, 4));    // 16-23
  q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes8, 4));    // 24-31
}

// One block of 32 weights as four vectors w = q * d + offset (Q4_0: offset -8d, Q4_1: m).
template <int QT>
TFNB_AVX2 inline void DecodeBlock(const uint8_t* blk, __m256* w) {
  const float d = HalfToFloatF16C(blk);
  const __m256 dv = _mm256_set1_ps(d);
  if (QT == kQ8_0) {
    for (int k = 0; k < 4; ++k)
      w[k] = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * k)))));
  } else {
    Nibbles(blk + (QT == kQ4_1 ? 4 : 2), w);
    const __m256 off = _mm256_set1_ps(QT == kQ4_1 ? HalfToFloatF16C(blk + 2) : -8.f * d);
    for (int k = 0; k < 4; ++k) w[k] = _mm256_fmadd_ps(w[k], dv, off);
  }
}

// 8 bytes at p widened to 32-bit lanes, shifted right by s, masked.
TFNB_AVX2 inline __m256i Bits8(const uint8_t* p, int s, int mask) {
  return _mm256_and_si256(_mm256_srl_epi32(Widen8(p), _mm_cvtsi32_si128(s)),
                          _mm256_set1_epi32(mask));
}

// A Q5_0 or Q5_1 block (Q4_0 and Q4_1 with a word of fifth bits): bit j of qh is value j's.
template <int QT>
TFNB_AVX2 inline void DecodeQ5(const uint8_t* blk, __m256* w) {
  constexpr bool kQ51 = QT == kQ5_1;
  const float d = HalfToFloatF16C(blk);
  const __m256 dv = _mm256_set1_ps(d);
  const __m256 off = _mm256_set1_ps(kQ51 ? HalfToFloatF16C(blk + 2) : -16.f * d);
  const __m256i qh = _mm256_set1_epi32(static_cast<int>(LoadU32(blk + (kQ51 ? 4 : 2))));
  const uint8_t* qs = blk + (kQ51 ? 8 : 6);
  const __m256i bytes0 = Widen8(qs), bytes8 = Widen8(qs + 8), low = _mm256_set1_epi32(0x0f);
  const __m256i q[4] = {_mm256_and_si256(bytes0, low), _mm256_and_si256(bytes8, low),
                        _mm256_srli_epi32(bytes0, 4), _mm256_srli_epi32(bytes8, 4)};
  for (int k = 0; k < 4; ++k) {
    const __m256i bit = _mm256_and_si256(
        _mm256_srlv_epi32(qh, _mm256_setr_epi32(8 * k, 8 * k + 1, 8 * k + 2, 8 * k + 3,
                                                8 * k + 4, 8 * k + 5, 8 * k + 6, 8 * k + 7)),
        _mm256_set1_epi32(1));
    const __m256i code = _mm256_or_si256(q[k], _mm256_slli_epi32(bit, 4));
    w[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), dv, off);  // q d exact: one rounding
  }
}

// Group g of a K-quant block (layouts in packed_common.h) as four vectors.
template <int QT>
TFNB_AVX2 inline void DecodeK(const uint8_t* blk, int g, __m256* w) {
  if constexpr (QT == kQ6_K) {
    const int h = g / 4, k = g % 4;
    const uint8_t* ql = blk + 64 * h + 32 * (k % 2);
    const uint8_t* qh = blk + 128 + 32 * h;
    const float d = HalfToFloatF16C(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192 + 2 * g);
    const __m256 s0 = _mm256_set1_ps(d * sc[0]), s1 = _mm256_set1_ps(d * sc[1]);
    for (int v = 0; v < 4; ++v) {
      const __m256i code = _mm256_or_si256(Bits8(ql + 8 * v, 4 * (k / 2), 0x0f),
                                           _mm256_slli_epi32(Bits8(qh + 8 * v, 2 * k, 3), 4));
      w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(code, _mm256_set1_epi32(32))),
                           v < 2 ? s0 : s1);
    }
  } else {
    int sc, m;
    KScaleMin(blk + 4, g, &sc, &m);
    const __m256 dsc = _mm256_set1_ps(HalfToFloatF16C(blk) * sc);
    const __m256 off = _mm256_set1_ps(-(HalfToFloatF16C(blk + 2) * m));
    const uint8_t* qs = blk + (QT == kQ5_K ? 48 : 16) + 32 * (g / 2);
    for (int v = 0; v < 4; ++v) {
      __m256i code = Bits8(qs + 8 * v, 4 * (g % 2), 0x0f);
      if (QT == kQ5_K)
        code = _mm256_or_si256(code, _mm256_slli_epi32(Bits8(blk + 16 + 8 * v, g, 1), 4));
      w[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), dsc, off);
    }
  }
}

// Group g (values 32 g to 32 g + 31) of a quantized row as four vectors.
template <int QT>
TFNB_AVX2 inline void DecodeGroup(const uint8_t* row, int64_t g, __m256* w) {
  if constexpr (IsKQuant(QT))
    DecodeK<QT>(GroupBlock<QT>(row, g), GroupInBlock<QT>(g), w);
  else if constexpr (QT == kQ5_0 || QT == kQ5_1)
    DecodeQ5<QT>(row + g * BlockBytes<QT>(), w);
  else
    DecodeBlock<QT>(row + g * BlockBytes<QT>(), w);
}

// 8 values of a float row from value j on.
template <int QT>
TFNB_AVX2 inline __m256 LoadFloats(const uint8_t* row, int64_t j) {
  if constexpr (QT == kF32) return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + j);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * j));
  if constexpr (QT == kF16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // BF16
}

// Dot products of R consecutive packed rows (1 or 2) with NN activation rows at once, so each
// row's bytes are decoded once per call (up to kMaxN activation rows; more go through
// TiledRowsAvx2). Every output has one accumulator, which takes its row's 8-value chunks in
// order, and is summed across lanes at the end: the order of TileAvx2, so a row's outputs are
// the same bits alone as in a batch of any size, whichever of the two computes them. Two
// weight rows at a time give 2 x NN independent chains to keep the FMA units busy (a lone
// row's single chain is latency-bound at one activation row).
constexpr int kMaxN = 5;

template <int QT, int NN, int R>
TFNB_AVX2 void DotRowsAvx2(const uint8_t* row, int64_t row_bytes, int64_t cols, const float* x,
                           float* out) {
  __m256 acc[R][NN];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NN; ++n) acc[r][n] = _mm256_setzero_ps();
  if constexpr (IsFloatType(QT)) {
    for (int64_t j = 0; j < cols; j += 8) {
      for (int r = 0; r < R; ++r) {
        const __m256 w = LoadFloats<QT>(row + r * row_bytes, j);
        for (int n = 0; n < NN; ++n)
          acc[r][n] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + n * cols + j), acc[r][n]);
      }
    }
  } else {
    for (int64_t b = 0; b < cols / kBlock; ++b) {
      __m256 w[R][4];
      for (int r = 0; r < R; ++r) DecodeGroup<QT>(row + r * row_bytes, b, w[r]);
      for (int n = 0; n < NN; ++n) {
        const float* xb = x + n * cols + b * kBlock;
        for (int k = 0; k < 4; ++k) {
          const __m256 xv = _mm256_loadu_ps(xb + 8 * k);
          for (int r = 0; r < R; ++r) acc[r][n] = _mm256_fmadd_ps(w[r][k], xv, acc[r][n]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NN; ++n) out[r * kMaxN + n] = HSum(acc[r][n]);
}

// A quantized row as floats in `out`.
template <int QT>
TFNB_AVX2 void DecodeRowAvx2(const uint8_t* row, int64_t cols, float* out) {
  for (int64_t b = 0; b < cols / kBlock; ++b, out += kBlock) {
    __m256 w[4];
    DecodeGroup<QT>(row, b, w);
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(out + 8 * k, w[k]);
  }
}

// y[n][m] = dot(w[m], x[n]) for MR float weight rows (stride `cols`) and NR activation rows:
// MR x NR accumulators, so each load feeds several FMAs (4 x 3 fills the 16 vector registers).
template <int MR, int NR>
TFNB_AVX2 void TileAvx2(const float* w, const float* x, int64_t cols, float* y, int64_t M) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < cols; k += 8) {
    __m256 xv[NR];
    for (int j = 0; j < NR; ++j) xv[j] = _mm256_loadu_ps(x + j * cols + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 wv = _mm256_loadu_ps(w + i * cols + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[j * M + i] = HSum(acc[i][j]);
}

template <int MR>
TFNB_AVX2 void TileRowsAvx2(const float* w, const float* x, int64_t N, int64_t cols, float* y,
                            int64_t M) {
  int64_t n = 0;
  for (; n + 3 <= N; n += 3) TileAvx2<MR, 3>(w, x + n * cols, cols, y + n * M, M);
  if (N - n == 2) TileAvx2<MR, 2>(w, x + n * cols, cols, y + n * M, M);
  if (N - n == 1) TileAvx2<MR, 1>(w, x + n * cols, cols, y + n * M, M);
}

// More than kMaxN activation rows (a batch, a prefill): 4 weight rows at a time are decoded
// into floats (a few KB: they stay in L1) and multiplied in 4 x 3 register tiles, so each
// activation row is read once per 4 weight rows instead of once per row. These tiles stay at
// AVX2 width: at 16 lanes each output's horizontal sum costs twice as much, and AVX-512 CPUs
// run RowsAvx512's groups of 8 rows instead.
template <int QT>
TFNB_AVX2 void TiledRowsAvx2(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x,
                   int64_t N, float* y, int64_t M, int64_t m0, int64_t m1) {
  constexpr int kMR = 4;
  std::vector<float> decoded(kMR * cols);
  for (int64_t m = m0; m < m1; m += kMR) {
    const int mr = static_cast<int>(std::min<int64_t>(kMR, m1 - m));
    const float* rows = reinterpret_cast<const float*>(w + m * row_bytes);
    PrefetchRow(w + m * row_bytes, mr * row_bytes, w + m1 * row_bytes);
    if (QT != kF32) {
      for (int i = 0; i < mr; ++i) {
        if constexpr (IsFloatType(QT)) {  // F16, BF16
          for (int64_t j = 0; j < cols; j += 8)
            _mm256_storeu_ps(decoded.data() + i * cols + j,
                             LoadFloats<QT>(w + (m + i) * row_bytes, j));
        } else {
          DecodeRowAvx2<QT>(w + (m + i) * row_bytes, cols, decoded.data() + i * cols);
        }
      }
      rows = decoded.data();
    }
    switch (mr) {
      case 4: TileRowsAvx2<4>(rows, x, N, cols, y + m, M); break;
      case 3: TileRowsAvx2<3>(rows, x, N, cols, y + m, M); break;
      case 2: TileRowsAvx2<2>(rows, x, N, cols, y + m, M); break;
      case 1: TileRowsAvx2<1>(rows, x, N, cols, y + m, M); break;
    }
  }
}

template <int QT, int NN>
void DotRowsAvx2N(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, float* y,
                  int64_t M, int64_t m0, int64_t m1) {
  constexpr int R = NN < kMaxN ? 2 : 1;  // 10 accumulators and 8 weights would not fit in 16
  float out[2 * kMaxN];
  for (int64_t m = m0; m < m1; m += R) {
    const uint8_t* row = w + m * row_bytes;
    const int r = static_cast<int>(std::min<int64_t>(R, m1 - m));
    PrefetchRow(row, r * row_bytes, w + m1 * row_bytes);
    if (r == R) {
      DotRowsAvx2<QT, NN, R>(row, row_bytes, cols, x, out);
    } else {  // the range's last row, alone
      DotRowsAvx2<QT, NN, 1>(row, row_bytes, cols, x, out);
    }
    for (int i = 0; i < r; ++i)
      for (int n = 0; n < NN; ++n) y[n * M + m + i] = out[i * kMaxN + n];
  }
}

}  // namespace

template <int QT>
void RowsAvx2(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, int64_t N,
              float* y, int64_t M, int64_t m0, int64_t m1) {
  switch (N) {
    case 5: return DotRowsAvx2N<QT, 5>(w, row_bytes, cols, x, y, M, m0, m1);
    case 4: return DotRowsAvx2N<QT, 4>(w, row_bytes, cols, x, y, M, m0, m1);
    case 3: return DotRowsAvx2N<QT, 3>(w, row_bytes, cols, x, y, M, m0, m1);
    case 2: return DotRowsAvx2N<QT, 2>(w, row_bytes, cols, x, y, M, m0, m1);
    case 1: return DotRowsAvx2N<QT, 1>(w, row_bytes, cols, x, y, M, m0, m1);
  }
  TiledRowsAvx2<QT>(w, row_bytes, cols, x, N, y, M, m0, m1);
}

#define TFNB_INSTANCE(QT)                                                                    \
  template void RowsAvx2<QT>(const uint8_t*, int64_t, int64_t, const float*, int64_t, float*, \
                             int64_t, int64_t, int64_t);
TFNB_INSTANCE(kF32) TFNB_INSTANCE(kF16) TFNB_INSTANCE(kBF16) TFNB_INSTANCE(kQ4_0)
TFNB_INSTANCE(kQ4_1) TFNB_INSTANCE(kQ5_0) TFNB_INSTANCE(kQ5_1) TFNB_INSTANCE(kQ8_0)
TFNB_INSTANCE(kQ4_K) TFNB_INSTANCE(kQ5_K) TFNB_INSTANCE(kQ6_K)
#undef TFNB_INSTANCE

}  // namespace packed
}  // namespace tfnb
#endif  // TFNB_X86
