// The int8 route (the op's `activations = "int8"`): llama.cpp's numerics for Q4_0, Q4_1 and
// Q8_0 weights. Each activation row is rounded once per call into blocks of 32 int8 values as
// llama.cpp's quantize_row_q8_0/q8_1 round them: d = max|x| / 127 kept as float16,
// q = x * (127 / max|x|) rounded to nearest even, and for Q4_1 s = float16(d * sum q). A weight
// block's integer dot with q is exact; the row's output is the float sum over its blocks, in
// block order, of isum * (d_w * d_x) (fused multiply-adds), plus for Q4_1 the sum of m * s.
// Every code below computes each output in exactly that order, so a row gets the same bits
// on every CPU, alone or in any batch, at any place in a row range.
//
// The x86 code takes 8 weight rows at a time: their codes are transposed in registers so that
// one 32-bit word of activations (4 values), broadcast, meets 4 codes of each of the 8 rows in
// one integer dot instruction (vpdpbusd with AVX512-VNNI or AVX-VNNI, maddubs + madd on AVX2),
// and each lane holds one row's sum: no horizontal sums, the 8 rows' scales in one gather.
// The weights stay in the GGUF layout, so every other reader of them (lookups, dequantize,
// the file reads on the workers) is unchanged.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "packed_common.h"

namespace tfnb {
namespace packed {
namespace {

// float32 -> float16, rounded to nearest even (as F16C and llama.cpp's GGML_FP32_TO_FP16):
// the float16 scaling trick of the FP16 library, exact for every input.
uint16_t FloatToHalf(float f) {
  auto bits = [](float v) { uint32_t u; std::memcpy(&u, &v, 4); return u; };
  auto from = [](uint32_t u) { float v; std::memcpy(&v, &u, 4); return v; };
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = bits(f), shl1 = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1 & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = from((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = bits(base);
  const uint32_t nonsign = ((b >> 13) & 0x00007c00u) + (b & 0x00000fffu);
  return static_cast<uint16_t>((sign >> 16) | (shl1 > 0xff000000u ? 0x7e00u : nonsign));
}

// One block of 32: q, d (float16-rounded), sum q, s = float16(d * sum q). A block holding an
// inf or NaN gets d = s = NaN (its row's outputs are NaN).
void QuantizeBlock(const float* x, int8_t* q, float* d_out, int32_t* sum_out, float* s_out) {
  float amax = 0.f, probe = 0.f;  // probe: NaN if any value is inf or NaN
  for (int j = 0; j < kBlock; ++j) {
    amax = std::max(amax, std::fabs(x[j]));
    probe += x[j] * 0.f;
  }
  if (probe != probe) {
    std::memset(q, 0, kBlock);
    *d_out = *s_out = std::nanf("");
    *sum_out = 0;
    return;
  }
  const float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));  // the default mode: nearest even
    sum += q[j];
  }
  *d_out = HalfToFloat(FloatToHalf(d));
  *sum_out = sum;
  *s_out = HalfToFloat(FloatToHalf(d * static_cast<float>(sum)));
}

template <int QT>
constexpr int CodeOffset() { return QT == kQ4_1 ? 4 : 2; }

// Row m's output for activation row n, one block at a time: what every code computes.
template <int QT>
float DotRowPortable(const uint8_t* row, const QuantizedRows& xq, int64_t n) {
  float acc = 0.f, accm = 0.f;
  for (int64_t b = 0; b < xq.nb; ++b) {
    const uint8_t* blk = row + b * BlockBytes<QT>();
    const uint8_t* codes = blk + CodeOffset<QT>();
    const int8_t* q = xq.Q(n, b);
    int32_t isum = 0;
    if (QT == kQ8_0) {
      for (int j = 0; j < kBlock; ++j) isum += static_cast<int8_t>(codes[j]) * q[j];
    } else {
      for (int j = 0; j < 16; ++j) isum += (codes[j] & 15) * q[j] + (codes[j] >> 4) * q[j + 16];
      if (QT == kQ4_0) isum -= 8 * xq.Sum(n)[b];
    }
    const float dd = HalfToFloat(LoadU16(blk)) * xq.D(n)[b];
    acc = std::fma(static_cast<float>(isum), dd, acc);
    if (QT == kQ4_1) accm = std::fma(HalfToFloat(LoadU16(blk + 2)), xq.S(n)[b], accm);
  }
  return QT == kQ4_1 ? acc + accm : acc;
}

template <int QT>
void RowsQ8PortableT(const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, float* y,
                     int64_t M, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {
    PrefetchRow(w + m * row_bytes, row_bytes, w + m1 * row_bytes);
    for (int64_t n = 0; n < xq.n; ++n) y[n * M + m] = DotRowPortable<QT>(w + m * row_bytes, xq, n);
  }
}

}  // namespace

void QuantizeRows(const float* x, int64_t N, int64_t cols, QuantizedRows* out) {
  out->n = N;
  out->nb = cols / kBlock;
  out->q.reset(new int8_t[N * cols]);
  out->d.reset(new float[N * out->nb]);
  out->s.reset(new float[N * out->nb]);
  out->sum.reset(new int32_t[N * out->nb]);
  for (int64_t i = 0; i < N * out->nb; ++i)  // i = n * nb + b
    QuantizeBlock(x + i * kBlock, out->q.get() + i * kBlock, &out->d[i], &out->sum[i],
                  &out->s[i]);
}

void RowsQ8Portable(int qtype, const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq,
                    float* y, int64_t M, int64_t m0, int64_t m1) {
  switch (qtype) {
    case kQ4_0: return RowsQ8PortableT<kQ4_0>(w, row_bytes, xq, y, M, m0, m1);
    case kQ4_1: return RowsQ8PortableT<kQ4_1>(w, row_bytes, xq, y, M, m0, m1);
    case kQ8_0: return RowsQ8PortableT<kQ8_0>(w, row_bytes, xq, y, M, m0, m1);
  }
}

#ifdef TFNB_X86
namespace {

// acc + the dot of each 4 unsigned bytes of u with the 4 signed bytes of s, per 32-bit lane.
// The VNNI forms are written in assembly so that this one function (and the kernel it is
// inlined into) keeps the AVX2 target: the compiler then uses no other AVX-512 instruction,
// and the dispatch (Int8Dot) runs each form only where the CPU has it. maddubs's 16-bit pair
// sums stay below 2^15 for the operands the kernel gives it (|u| <= 128, |s| <= 127, or
// u <= 15).
template <int kDot>
TFNB_AVX2 inline __m256i DotU8S8(__m256i acc, __m256i u, __m256i s) {
  if constexpr (kDot == kInt8Vnni512) {
    asm("vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
    return acc;
  } else if constexpr (kDot == kInt8AvxVnni) {
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
    return acc;
  } else {
    return _mm256_add_epi32(
        acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
}

// 16 bytes of each of 8 rows (p + r * stride) as 4 vectors: vector k, lane r = row r's bytes
// 4k to 4k + 3.
TFNB_AVX2 inline __m256i RowPair(const uint8_t* p, int64_t stride, int r) {  // rows r, r + 4
  return _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + r * stride))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (r + 4) * stride)), 1);
}

TFNB_AVX2 inline void Transpose8x16(const uint8_t* p, int64_t stride, __m256i* k) {
  const __m256i a = RowPair(p, stride, 0), b = RowPair(p, stride, 1);
  const __m256i c = RowPair(p, stride, 2), d = RowPair(p, stride, 3);
  const __m256i t0 = _mm256_unpacklo_epi32(a, b), t1 = _mm256_unpackhi_epi32(a, b);
  const __m256i t2 = _mm256_unpacklo_epi32(c, d), t3 = _mm256_unpackhi_epi32(c, d);
  k[0] = _mm256_unpacklo_epi64(t0, t2);
  k[1] = _mm256_unpackhi_epi64(t0, t2);
  k[2] = _mm256_unpacklo_epi64(t1, t3);
  k[3] = _mm256_unpackhi_epi64(t1, t3);
}

TFNB_AVX2 inline __m256i Broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}

// Rows m to m + 7 against activation rows n0 to n0 + NN - 1: y[n, m + r].
template <int QT, int NN, int kDot>
TFNB_AVX2 void Group8(const uint8_t* w, int64_t rb, const QuantizedRows& xq, int64_t n0,
                      int64_t m, const uint8_t* end, float* y, int64_t M) {
  constexpr int bytes = BlockBytes<QT>();
  // Q8_0's signed codes: VNNI takes them offset by 128 (and takes 128 sum q off again);
  // maddubs takes their magnitude, their sign moved onto the activations
  constexpr bool kOffset8 = QT == kQ8_0 && kDot != kInt8Maddubs;
  const __m256i vindex = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32(static_cast<int>(rb)));
  const __m256i nib = _mm256_set1_epi8(0x0f);
  // a gathered dword's float16 d (bytes 0-1) and Q4_1's m (bytes 2-3), each lane's 4 to the
  // low half of its 128 bits
  const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  __m256 acc[NN], accm[NN];
  for (int n = 0; n < NN; ++n) acc[n] = accm[n] = _mm256_setzero_ps();
  const uint8_t* base = w + m * rb;
  const uint8_t* next = base + 8 * rb;  // the next group, read ahead a block's lines at a time
  for (int64_t b = 0; b < xq.nb; ++b) {
    const uint8_t* blk = base + b * bytes;
    if (b % (QT == kQ8_0 ? 2 : 4) == 0 && next + b * bytes < end)
      for (int r = 0; r < 8; ++r) __builtin_prefetch(next + r * rb + b * bytes, 0, 3);
    const __m256i heads = _mm256_permute4x64_epi64(
        _mm256_shuffle_epi8(_mm256_i32gather_epi32(reinterpret_cast<const int*>(blk), vindex, 1),
                            split), 0xd8);  // d0-3 d4-7 | m0-3 m4-7
    const __m256 dw = _mm256_cvtph_ps(_mm256_castsi256_si128(heads));
    const __m256 mw = _mm256_cvtph_ps(_mm256_extracti128_si256(heads, 1));
    __m256i k[8], u[8];  // code vectors; u: their unsigned operands, 4 values a lane each
    Transpose8x16(blk + CodeOffset<QT>(), rb, k);
    if (QT == kQ8_0) {
      Transpose8x16(blk + CodeOffset<QT>() + 16, rb, k + 4);
      for (int j = 0; j < 8; ++j)
        u[j] = kOffset8 ? _mm256_xor_si256(k[j], _mm256_set1_epi8(-128)) : _mm256_abs_epi8(k[j]);
    } else {
      for (int j = 0; j < 4; ++j) {
        u[j] = _mm256_and_si256(k[j], nib);                           // values 4j..4j+3
        u[j + 4] = _mm256_and_si256(_mm256_srli_epi16(k[j], 4), nib);  // 16 + 4j..
      }
    }
    for (int n = 0; n < NN; ++n) {
      const int8_t* q = xq.Q(n0 + n, b);
      const int32_t sum = xq.Sum(n0 + n)[b];
      __m256i isum = _mm256_set1_epi32(QT == kQ4_0 ? -8 * sum : kOffset8 ? -128 * sum : 0);
      for (int j = 0; j < 8; ++j) {  // u[j]: values 4j to 4j + 3 of each row's block
        __m256i s = Broadcast4(q + 4 * j);
        if (QT == kQ8_0 && !kOffset8) s = _mm256_sign_epi8(s, k[j]);
        isum = DotU8S8<kDot>(isum, u[j], s);
      }
      const __m256 dd = _mm256_mul_ps(dw, _mm256_set1_ps(xq.D(n0 + n)[b]));
      acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dd, acc[n]);
      if (QT == kQ4_1) accm[n] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xq.S(n0 + n)[b]), accm[n]);
    }
  }
  for (int n = 0; n < NN; ++n) {
    const __m256 out = QT == kQ4_1 ? _mm256_add_ps(acc[n], accm[n]) : acc[n];
    _mm256_storeu_ps(y + (n0 + n) * M + m, out);
  }
}

}  // namespace

template <int QT, int kDot>
void RowsQ8X86(const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, float* y,
               int64_t M, int64_t m0, int64_t m1) {
  const uint8_t* end = w + m1 * row_bytes;
  int64_t m = m0;
  for (; m + 8 <= m1; m += 8) {
    for (int64_t n0 = 0; n0 < xq.n; n0 += 4) {
      switch (std::min<int64_t>(4, xq.n - n0)) {
        case 1: Group8<QT, 1, kDot>(w, row_bytes, xq, n0, m, end, y, M); break;
        case 2: Group8<QT, 2, kDot>(w, row_bytes, xq, n0, m, end, y, M); break;
        case 3: Group8<QT, 3, kDot>(w, row_bytes, xq, n0, m, end, y, M); break;
        default: Group8<QT, 4, kDot>(w, row_bytes, xq, n0, m, end, y, M); break;
      }
    }
  }
  if (m < m1) RowsQ8PortableT<QT>(w, row_bytes, xq, y, M, m, m1);
}

#define TFNB_INT8_INSTANCE(QT, DOT)                                                       \
  template void RowsQ8X86<QT, DOT>(const uint8_t*, int64_t, const QuantizedRows&, float*, \
                                   int64_t, int64_t, int64_t);
#define TFNB_INT8_INSTANCES(DOT) \
  TFNB_INT8_INSTANCE(kQ4_0, DOT) TFNB_INT8_INSTANCE(kQ4_1, DOT) TFNB_INT8_INSTANCE(kQ8_0, DOT)
TFNB_INT8_INSTANCES(kInt8Maddubs)
TFNB_INT8_INSTANCES(kInt8AvxVnni)
TFNB_INT8_INSTANCES(kInt8Vnni512)
#undef TFNB_INT8_INSTANCES
#undef TFNB_INT8_INSTANCE
#endif  // TFNB_X86

}  // namespace packed
}  // namespace tfnb
