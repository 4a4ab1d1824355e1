// The opt-in int8-activation route (the op's `activations = "int8"`): activations rounded to
// int8 blocks, then integer dot products with Q4_0, Q4_1 and Q8_0 rows. Its portable and AVX2
// code sit side by side because they must round the activations identically for machines to
// agree. It has no AVX-512 code: on CPUs where the float route runs AVX-512, this route is no
// faster than it (docs/kernels.md).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "packed_common.h"

namespace tfnb {
namespace packed {
namespace {

// Each activation row is quantized once per call into blocks of 32 int8 q with a float scale
// d = max|x| / 127 (q = x / d rounded to nearest even) and s = d * sum(q). A weight block's dot
// is then an integer dot of its 32 codes with q, scaled by d_w * d_x; the offset of a Q4 block
// (Q4_0: -8 d_w, Q4_1: m) multiplies s. The result is exactly dequantize(w) . dequantize(q(x))
// up to float rounding: the only approximation is the activations' rounding, at most d_x / 2
// per value. A block holding an inf or NaN gets scale NaN (its row's outputs are NaN).
void QuantizeBlockPortable(const float* x, int8_t* q, float* d_out, float* s_out) {
  float amax = 0.f, probe = 0.f;  // probe: NaN if any value is inf or NaN
  for (int j = 0; j < kBlock; ++j) {
    amax = std::max(amax, std::fabs(x[j]));
    probe += x[j] * 0.f;
  }
  if (probe != probe) {
    std::memset(q, 0, kBlock);
    *d_out = *s_out = std::nanf("");
    return;
  }
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  int sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));
    sum += q[j];
  }
  *d_out = d;
  *s_out = d * static_cast<float>(sum);
}

#ifdef TFNB_X86
TFNB_AVX2 void QuantizeBlockAvx2(const float* x, int8_t* q, float* d_out, float* s_out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps(), probe = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
    probe = _mm256_add_ps(probe, _mm256_mul_ps(v[k], _mm256_setzero_ps()));
  }
  if (_mm256_movemask_ps(_mm256_cmp_ps(probe, probe, _CMP_UNORD_Q))) {
    std::memset(q, 0, kBlock);
    *d_out = *s_out = std::nanf("");
    return;
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  const __m256 idv = _mm256_set1_ps(id);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], idv));  // nearest even
  const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  // packs work per 128-bit lane: undo the interleave with one permute
  const __m256i p01 = _mm256_packs_epi32(i[0], i[1]), p23 = _mm256_packs_epi32(i[2], i[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  *d_out = d;
  *s_out = d * static_cast<float>(_mm_cvtsi128_si32(s4));
}
#endif

}  // namespace

void QuantizeRows(const float* x, int64_t N, int64_t cols, QuantizedRows* out) {
  out->n = N;
  out->nb = cols / kBlock;
  out->q.reset(new int8_t[N * cols]);
  out->d.reset(new float[N * out->nb]);
  out->s.reset(new float[N * out->nb]);
#ifdef TFNB_X86
  const bool avx2 = HaveAvx2();
#endif
  for (int64_t i = 0; i < N * out->nb; ++i) {  // i = r * nb + b
    int8_t* q = out->q.get() + ((i % out->nb) * N + i / out->nb) * kBlock;
#ifdef TFNB_X86
    if (avx2) {
      QuantizeBlockAvx2(x + i * kBlock, q, &out->d[i], &out->s[i]);
      continue;
    }
#endif
    QuantizeBlockPortable(x + i * kBlock, q, &out->d[i], &out->s[i]);
  }
  out->n8 = (N + 7) / 8 * 8;
  out->dt.reset(new float[out->nb * out->n8]());
  for (int64_t r = 0; r < N; ++r)
    for (int64_t b = 0; b < out->nb; ++b) out->dt[b * out->n8 + r] = out->d[r * out->nb + b];
}

// Portable: integer dot of each block, d_w * d_x times it, plus the offset times s.
void RowsQ8Portable(int qtype, const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq,
                    float* y, int64_t M, int64_t m0, int64_t m1) {
  const int64_t nb = xq.nb;
  int8_t code[kBlock];
  for (int64_t m = m0; m < m1; ++m) {
    PrefetchRow(w + m * row_bytes, row_bytes, w + m1 * row_bytes);
    for (int64_t n = 0; n < xq.n; ++n) {
      const uint8_t* blk = w + m * row_bytes;
      float acc = 0.f, off_acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* q = xq.Q(b, n);
        const float dw = HalfToFloat(LoadU16(blk));
        float off = 0.f;
        if (qtype == kQ8_0) {
          std::memcpy(code, blk + 2, kBlock);
          blk += 34;
        } else {
          const uint8_t* qs = blk + (qtype == kQ4_1 ? 4 : 2);
          for (int j = 0; j < 16; ++j) {
            code[j] = static_cast<int8_t>(qs[j] & 0x0f);
            code[j + 16] = static_cast<int8_t>(qs[j] >> 4);
          }
          off = qtype == kQ4_1 ? HalfToFloat(LoadU16(blk + 2)) : -8.f * dw;
          blk += qtype == kQ4_1 ? 20 : 18;
        }
        int32_t dot = 0;
        for (int j = 0; j < kBlock; ++j) dot += static_cast<int32_t>(code[j]) * q[j];
        acc += dw * xq.D(n)[b] * static_cast<float>(dot);
        off_acc += off * xq.S(n)[b];
      }
      y[n * M + m] = acc + off_acc;
    }
  }
}

#ifdef TFNB_X86
namespace {

TFNB_AVX2 float DotAvx2(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
  float s = HSum(acc);
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

// NN activation rows against one weight row: each block's codes are decoded once into a
// vector of 32 bytes (Q4: 0..15; Q8_0: |code| with the sign moved onto the activations), then
// per row maddubs (u8 x s8 pairs to s16; at most 2 * 128 * 127, no saturation) and madd with
// ones give 8 int32 partial sums, converted and scaled by d_w * d_x into a float accumulator.
// Q4 offsets are collected per block in `off` and dotted with the rows' s at the end.
constexpr int kMaxNQ = 8;

template <int QT, int NN>
TFNB_AVX2 inline void BlockQ8Avx2(const uint8_t* blk, int64_t b, const int8_t* q,
                                  const float* dt, float* off, __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  const float dw = HalfToFloatF16C(blk);
  __m256i code, sgn;
  if (QT == kQ8_0) {
    sgn = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    code = _mm256_abs_epi8(sgn);
  } else {
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i raw =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == kQ4_1 ? 4 : 2)));
    code = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask),
                            _mm_and_si128(raw, mask));
    off[b] = QT == kQ4_1 ? HalfToFloatF16C(blk + 2) : -8.f * dw;
  }
  for (int n = 0; n < NN; ++n) {
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * kBlock));
    if (QT == kQ8_0) xv = _mm256_sign_epi8(xv, sgn);
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(code, xv), ones);
    acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dt[n]), _mm256_cvtepi32_ps(p), acc[n]);
  }
}

template <int QT, int NN>
TFNB_AVX2 void DotRowQ8Avx2(const uint8_t* row, const QuantizedRows& xq, int64_t n0, float* off,
                            float* out) {
  constexpr int bytes = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;
  const int64_t nb = xq.nb;
  const float* dt = xq.dt.get() + n0;
  // up to two rows, two accumulators per row: consecutive blocks do not wait on each other's
  // FMA (more rows are independent chains already, and more registers would spill)
  constexpr int A = NN <= 2 ? 2 : 1;
  __m256 acc[A][NN];
  for (int a = 0; a < A; ++a)
    for (int n = 0; n < NN; ++n) acc[a][n] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + A <= nb; b += A)
    for (int a = 0; a < A; ++a)
      BlockQ8Avx2<QT, NN>(row + (b + a) * bytes, b + a, xq.Q(b + a, n0), dt + (b + a) * xq.n8, off,
                          acc[a]);
  if (b < nb) BlockQ8Avx2<QT, NN>(row + b * bytes, b, xq.Q(b, n0), dt + b * xq.n8, off, acc[0]);
  for (int n = 0; n < NN; ++n) {
    __m256 s = acc[0][n];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[a][n]);
    out[n] = HSum(s) + (QT == kQ8_0 ? 0.f : DotAvx2(off, xq.S(n0 + n), nb));
  }
}

template <int QT, int NN>
void RowsQ8Avx2N(const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, int64_t n0,
                 float* y, int64_t M, int64_t m0, int64_t m1, float* off) {
  float out[NN];
  for (int64_t m = m0; m < m1; ++m) {
    PrefetchRow(w + m * row_bytes, row_bytes, w + m1 * row_bytes);
    DotRowQ8Avx2<QT, NN>(w + m * row_bytes, xq, n0, off, out);
    for (int n = 0; n < NN; ++n) y[(n0 + n) * M + m] = out[n];
  }
}

}  // namespace

template <int QT>
void RowsQ8Avx2(const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, float* y,
                int64_t M, int64_t m0, int64_t m1) {
  std::unique_ptr<float[]> off(new float[xq.nb]);
  for (int64_t n0 = 0; n0 < xq.n;) {
    const int64_t left = xq.n - n0;
    const int nn = left >= kMaxNQ ? kMaxNQ : static_cast<int>(left);
    switch (nn) {
#define TFNB_CASE(K) case K: RowsQ8Avx2N<QT, K>(w, row_bytes, xq, n0, y, M, m0, m1, off.get()); break;
      TFNB_CASE(1) TFNB_CASE(2) TFNB_CASE(3) TFNB_CASE(4)
      TFNB_CASE(5) TFNB_CASE(6) TFNB_CASE(7) TFNB_CASE(8)
#undef TFNB_CASE
    }
    n0 += nn;
  }
}

template void RowsQ8Avx2<kQ4_0>(const uint8_t*, int64_t, const QuantizedRows&, float*, int64_t,
                                int64_t, int64_t);
template void RowsQ8Avx2<kQ4_1>(const uint8_t*, int64_t, const QuantizedRows&, float*, int64_t,
                                int64_t, int64_t);
template void RowsQ8Avx2<kQ8_0>(const uint8_t*, int64_t, const QuantizedRows&, float*, int64_t,
                                int64_t, int64_t);
#endif  // TFNB_X86

}  // namespace packed
}  // namespace tfnb
