// The float route's AVX2 code (AVX2, FMA, F16C), what x86 CPUs without AVX-512 run: each
// block of 32 weights is dequantized into four ymm registers and multiplied there, never
// written out. Up to kMaxN activation rows read the packed rows directly; more go through
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
  if (QT == kF32 || QT == kF16) {
    for (int64_t j = 0; j < cols; j += 8) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* rr = row + r * row_bytes;
        const __m256 w = QT == kF32
            ? _mm256_loadu_ps(reinterpret_cast<const float*>(rr) + j)
            : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rr + 2 * j)));
        for (int n = 0; n < NN; ++n)
          acc[r][n] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + n * cols + j), acc[r][n]);
      }
    }
  } else {
    for (int64_t b = 0; b < cols / kBlock; ++b) {
      __m256 w[R][4];
      for (int r = 0; r < R; ++r) DecodeBlock<QT>(row + r * row_bytes + b * BlockBytes<QT>(), w[r]);
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
  for (int64_t b = 0; b < cols / kBlock; ++b, row += BlockBytes<QT>(), out += kBlock) {
    __m256 w[4];
    DecodeBlock<QT>(row, w);
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
        if (QT == kF16) {
          for (int64_t j = 0; j < cols; j += 8)
            _mm256_storeu_ps(decoded.data() + i * cols + j, _mm256_cvtph_ps(_mm_loadu_si128(
                reinterpret_cast<const __m128i*>(w + (m + i) * row_bytes + 2 * j))));
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

template void RowsAvx2<kF32>(const uint8_t*, int64_t, int64_t, const float*, int64_t, float*,
                             int64_t, int64_t, int64_t);
template void RowsAvx2<kF16>(const uint8_t*, int64_t, int64_t, const float*, int64_t, float*,
                             int64_t, int64_t, int64_t);
template void RowsAvx2<kQ4_0>(const uint8_t*, int64_t, int64_t, const float*, int64_t, float*,
                              int64_t, int64_t, int64_t);
template void RowsAvx2<kQ4_1>(const uint8_t*, int64_t, int64_t, const float*, int64_t, float*,
                              int64_t, int64_t, int64_t);
template void RowsAvx2<kQ8_0>(const uint8_t*, int64_t, int64_t, const float*, int64_t, float*,
                              int64_t, int64_t, int64_t);

}  // namespace packed
}  // namespace tfnb
#endif  // TFNB_X86
