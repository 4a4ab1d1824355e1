// The float route's AVX-512 code (F, BW, VL), for up to 8 activation rows at a time: a block
// of 32 is two zmm vectors, and the 32 registers hold 8 rows' accumulators, so each weight byte
// is read once per 8 activation rows; prompts go in groups of 8 over chunks of weight rows.
// The weights are the same values as the AVX2 and portable code's, bit for bit (w = q * d +
// offset), decoded in fewer instructions: a Q4 block's 16 possible values are computed once as
// a table (one FMA) and its 32 codes look them up (vpermps); Q5 and Q4_K/Q5_K groups likewise,
// Q6_K's codes are converted. Quantized rows go two at a time, each output summed in one order
// from 1 to 8 activation rows, so a decode step's row gets the same bits alone as in a batch
// (but for a row range's odd last weight row of Q4_0, Q4_1 or Q8_0: DotRowAvx512).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "packed_common.h"

#ifdef TFNB_X86
namespace tfnb {
namespace packed {
namespace {

constexpr int kMaxN512 = 8;

template <int QT>
TFNB_AVX512 inline void DecodeBlock512(const uint8_t* blk, __m512* w) {
  if (QT == kQ8_0) {
    const __m512 dv = _mm512_set1_ps(HalfToFloatF16C(blk));
    for (int k = 0; k < 2; ++k)
      w[k] = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * k)))));
    return;
  }
  // Byte j of the 16 holds codes j (low nibble) and j + 16 (high nibble).
  const __m512i codes = _mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == kQ4_1 ? 4 : 2))));
  __m512 dv, off;
  if (QT == kQ4_1) {
    uint32_t dm;
    std::memcpy(&dm, blk, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));  // d, m
    dv = _mm512_broadcastss_ps(f);
    off = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
  } else {
    dv = _mm512_set1_ps(HalfToFloatF16C(blk));
    off = _mm512_mul_ps(dv, _mm512_set1_ps(-8.f));
  }
  const __m512 table = _mm512_fmadd_ps(
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), dv, off);
  w[0] = _mm512_permutexvar_ps(codes, table);  // vpermps reads the low 4 bits of an index
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
}

// A Q5_0 or Q5_1 block: a table of the 32 possible values (two FMAs), looked up by the low
// nibbles and, where a value's fifth bit is set (a mask of qh), by the high half of the table.
template <int QT>
TFNB_AVX512 inline void DecodeQ5_512(const uint8_t* blk, __m512* w) {
  constexpr bool kQ51 = QT == kQ5_1;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const float d = HalfToFloatF16C(blk);
  const __m512 dv = _mm512_set1_ps(d);
  const __m512 off = _mm512_set1_ps(kQ51 ? HalfToFloatF16C(blk + 2) : -16.f * d);
  const uint32_t qh = LoadU32(blk + (kQ51 ? 4 : 2));
  const __m512i codes = _mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (kQ51 ? 8 : 6))));
  const __m512 lo = _mm512_fmadd_ps(iota, dv, off);  // q d exact: one rounding, as elsewhere
  const __m512 hi = _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.f)), dv, off);
  const __m512i high = _mm512_srli_epi32(codes, 4);
  w[0] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(codes, lo),
                                    static_cast<__mmask16>(qh), codes, hi);
  w[1] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(high, lo),
                                    static_cast<__mmask16>(qh >> 16), high, hi);
}

// Group g of a K-quant block (layouts in packed_common.h) as two vectors. Q4_K and Q5_K look
// their codes up in a table of 16 (or 32) values as Q4 and Q5 blocks do; Q6_K's 64 codes, two
// scales a group, are converted and multiplied.
TFNB_AVX512 inline __m512i Bytes16(const uint8_t* p) {  // 16 bytes as 32-bit lanes
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int QT>
TFNB_AVX512 inline void DecodeK512(const uint8_t* blk, int g, __m512* w) {
  if constexpr (QT == kQ6_K) {
    const int h = g / 4, k = g % 4;
    const uint8_t* ql = blk + 64 * h + 32 * (k % 2);
    const uint8_t* qh = blk + 128 + 32 * h;
    const float d = HalfToFloatF16C(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192 + 2 * g);
    const __m128i ls = _mm_cvtsi32_si128(4 * (k / 2)), hs = _mm_cvtsi32_si128(2 * k);
    for (int v = 0; v < 2; ++v) {
      const __m512i low = _mm512_and_si512(_mm512_srl_epi32(Bytes16(ql + 16 * v), ls),
                                           _mm512_set1_epi32(0x0f));
      const __m512i top = _mm512_and_si512(_mm512_srl_epi32(Bytes16(qh + 16 * v), hs),
                                           _mm512_set1_epi32(3));
      const __m512i code = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(top, 4)),
                                            _mm512_set1_epi32(32));
      w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(code), _mm512_set1_ps(d * sc[v]));
    }
  } else {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int sc, m;
    KScaleMin(blk + 4, g, &sc, &m);
    const __m512 dsc = _mm512_set1_ps(HalfToFloatF16C(blk) * sc);
    const __m512 off = _mm512_set1_ps(-(HalfToFloatF16C(blk + 2) * m));
    const uint8_t* qs = blk + (QT == kQ5_K ? 48 : 16) + 32 * (g / 2);
    const __m128i shift = _mm_cvtsi32_si128(4 * (g % 2));
    const __m512 lo = _mm512_fmadd_ps(iota, dsc, off);  // vpermps reads an index's low 4 bits
    for (int v = 0; v < 2; ++v) {
      const __m512i codes = _mm512_srl_epi32(Bytes16(qs + 16 * v), shift);
      w[v] = _mm512_permutexvar_ps(codes, lo);
      if constexpr (QT == kQ5_K) {
        const __m512 hi = _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.f)), dsc, off);
        const __mmask16 fifth = _mm_test_epi8_mask(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 + 16 * v)),
            _mm_set1_epi8(static_cast<char>(1 << g)));
        w[v] = _mm512_mask_permutexvar_ps(w[v], fifth, codes, hi);
      }
    }
  }
}

// Group g (values 32 g to 32 g + 31) of a row of the types without a scale prepass.
template <int QT>
TFNB_AVX512 inline void DecodeGroup512(const uint8_t* row, int64_t g, __m512* w) {
  if constexpr (IsKQuant(QT))
    DecodeK512<QT>(GroupBlock<QT>(row, g), GroupInBlock<QT>(g), w);
  else
    DecodeQ5_512<QT>(row + g * BlockBytes<QT>(), w);
}

// The scales of `n` (<= 64) consecutive blocks of a quantized row as float32, 16 blocks per
// conversion: Q4_1 as pairs (d, m) in `out[2b]`, `out[2b + 1]`; Q4_0 and Q8_0 as d in
// `out[b]`. Nothing past the n blocks is read. Q4_1's heads (dword 5b of a run of 16 blocks)
// are picked out of five plain loads by permutes, the other types' d (at 18b or 34b bytes, not
// dword-aligned) read one by one: a gather instruction was slower than either.
template <int QT>
TFNB_AVX512 inline void BlockScales512(const uint8_t* blk, int64_t n, float* out) {
  if constexpr (QT == kQ4_1) {
    const __m512i pick[4] = {  // dwords 0, 5, ..., 75 of five registers, the first two at once
        _mm512_setr_epi32(0, 5, 10, 15, 20, 25, 30, 0, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 19, 24, 29, 0, 0, 0, 0, 0, 0),
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 18, 23, 28, 0, 0, 0),
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 17, 22, 27)};
    for (int64_t b = 0; b < n; b += 16, blk += 16 * BlockBytes<QT>()) {
      const int64_t words = 5 * std::min<int64_t>(16, n - b);  // dwords of the live blocks
      __m512i r[5];
      for (int k = 0; k < 5; ++k) {
        const int64_t live = std::clamp<int64_t>(words - 16 * k, 0, 16);
        r[k] = _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << live) - 1), blk + 64 * k);
      }
      __m512i head = _mm512_permutex2var_epi32(r[0], pick[0], r[1]);
      for (int k = 1; k < 4; ++k) head = _mm512_permutex2var_epi32(head, pick[k], r[k + 1]);
      _mm512_storeu_ps(out + 2 * b, _mm512_cvtph_ps(_mm512_castsi512_si256(head)));
      _mm512_storeu_ps(out + 2 * b + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(head, 1)));
    }
  } else {
    alignas(32) uint16_t d[16] = {};
    for (int64_t b = 0; b < n; b += 16, blk += 16 * BlockBytes<QT>()) {
      for (int64_t i = 0; i < std::min<int64_t>(16, n - b); ++i)
        d[i] = LoadU16(blk + i * BlockBytes<QT>());
      _mm512_storeu_ps(out + b, _mm512_cvtph_ps(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(d))));
    }
  }
}

// DecodeBlock512 with the block's scales converted already (BlockScales512): the 16 values'
// table is one FMA (Q4_1) or multiply (Q4_0) reading its scales from memory, so no shuffle
// broadcasts them. The same values, bit for bit: Q4_0's (q - 8) d is the one rounding of
// q d - 8 d, as the FMA gives it.
template <int QT>
TFNB_AVX512 inline void DecodeBlockScaled512(const uint8_t* blk, const float* s, __m512* w) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  if (QT == kQ8_0) {
    for (int k = 0; k < 2; ++k)
      w[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(blk + 2 + 16 * k)))), _mm512_set1_ps(s[0]));
    return;
  }
  const __m512i codes = _mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == kQ4_1 ? 4 : 2))));
  const __m512 table = QT == kQ4_1
      ? _mm512_fmadd_ps(iota, _mm512_set1_ps(s[0]), _mm512_set1_ps(s[1]))
      : _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.f)), _mm512_set1_ps(s[0]));
  w[0] = _mm512_permutexvar_ps(codes, table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
}

// As DotRowsAvx2: float rows (up to kMaxN512 activation rows; `cols` a multiple of 16) and a
// quantized row against one activation row, when it has no second row to go with it
// (DotRowsAvx512 takes quantized rows two at a time).
template <int QT, int NN>
TFNB_AVX512 void DotRowAvx512(const uint8_t* row, int64_t cols, const float* x, float* out) {
  constexpr int A = NN == 1 ? 4 : 2;  // accumulators per activation row
  __m512 acc[NN][A];
  for (int n = 0; n < NN; ++n)
    for (int a = 0; a < A; ++a) acc[n][a] = _mm512_setzero_ps();
  if constexpr (IsFloatType(QT)) {
    for (int64_t j = 0; j < cols; j += 16) {
      __m512 w;
      if constexpr (QT == kF32) {
        w = _mm512_loadu_ps(reinterpret_cast<const float*>(row) + j);
      } else {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * j));
        w = QT == kF16 ? _mm512_cvtph_ps(h)
                       : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      }
      const int a = static_cast<int>((j / 16) % A);
      for (int n = 0; n < NN; ++n)
        acc[n][a] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + n * cols + j), acc[n][a]);
    }
  } else {
    static_assert(NN == 1 && IsLegacyBlock(QT),
                  "quantized rows against 2 or more activation rows: DotRowsAvx512");
    constexpr int kS = QT == kQ4_1 ? 2 : 1;  // scale floats per block (BlockScales512)
    alignas(64) float scales[64 * kS];
    const int64_t nb = cols / kBlock;
    for (int64_t b0 = 0; b0 < nb; b0 += 64) {
      const int64_t b1 = std::min(nb, b0 + 64);
      BlockScales512<QT>(row, b1 - b0, scales);
      const float* s = scales;
      int64_t b = b0;
      // two blocks a step, four chains (an index computed from b would spill acc)
      for (; b + 2 <= b1; b += 2, row += 2 * BlockBytes<QT>(), s += 2 * kS) {
        __m512 w[4];
        DecodeBlockScaled512<QT>(row, s, w);
        DecodeBlockScaled512<QT>(row + BlockBytes<QT>(), s + kS, w + 2);
        for (int k = 0; k < 4; ++k)
          acc[0][k % A] = _mm512_fmadd_ps(w[k], _mm512_loadu_ps(x + b * kBlock + 16 * k),
                                          acc[0][k % A]);
      }
      if (b < b1) {  // an odd block count leaves one over
        __m512 w[2];
        DecodeBlockScaled512<QT>(row, s, w);
        acc[0][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(x + b * kBlock), acc[0][0]);
        acc[0][1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(x + b * kBlock + 16), acc[0][1]);
        row += BlockBytes<QT>();
      }
    }
  }
  for (int n = 0; n < NN; ++n) {
    __m512 s = acc[n][0];
    for (int a = 1; a < A; ++a) s = _mm512_add_ps(s, acc[n][a]);
    out[n] = _mm512_reduce_add_ps(s);
  }
}

// The lane sums of 8 vectors, each added in _mm512_reduce_add_ps's order (lanes i and i + 8,
// then i and i + 4, i and i + 2, i and i + 1), so bit for bit its results, in 23 vector
// instructions where 8 of its reductions take about 60: the vectors go two, then four to a
// register as they halve. `sums[k]` is v[k]'s. A call of 2 to 8 activation rows ends with 4 to
// 16 sums, which on short rows (SmolLM2's are 18 blocks) weigh on the call's time.
TFNB_AVX512 inline void ReduceAdd8(const __m512* v, float* sums) {
  __m512 p[4], q[2];
  for (int k = 0; k < 4; ++k)  // [v[2k] | v[2k + 1]], 8 lanes each
    p[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  for (int k = 0; k < 2; ++k)  // [v[4k] | ... | v[4k + 3]], 4 lanes each
    q[k] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  // 128-bit lane k: 2 lanes of v[k], 2 of v[k + 4]; then each pair's sum
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(3, 2, 3, 2)));
  alignas(64) float t[16];
  _mm512_store_ps(t, _mm512_add_ps(r, _mm512_permute_ps(r, _MM_SHUFFLE(2, 3, 0, 1))));
  for (int k = 0; k < 4; ++k) {
    sums[k] = t[4 * k];
    sums[k + 4] = t[4 * k + 2];
  }
}

// MR weight rows against NN activation rows of a quantized matrix: each activation vector
// loaded feeds MR FMAs, since a 512-bit load from L1 issues about once per cycle and at one
// weight row the loads, not the FMAs, would set the pace. One activation row goes two weight
// rows at a time too, so each output sums in the order it does at any other row count. Q4_1's
// block scales of rows of kMinPrepass blocks or more are converted 64 blocks at a time before
// their codes (BlockScales512): converting and broadcasting them block by block inside the
// loop takes the shuffle port that the codes' lookups and half the FMAs need.
template <int QT, int NN, int MR>
TFNB_AVX512 void DotRowsAvx512(const uint8_t* row, int64_t row_bytes, int64_t cols,
                               const float* x, float* out) {
  constexpr int kS = QT == kQ4_1 ? 2 : 1;  // scale floats per block
  constexpr int64_t kSpan = 64;            // blocks per scale conversion
  // At 8 rows the prepass measured no faster; Q4_0 and Q8_0 read their one scale per block
  // (their prepass was slower)
  constexpr bool kScaled = NN < kMaxN512 && QT == kQ4_1;
  __m512 acc[MR][NN];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NN; ++n) acc[r][n] = _mm512_setzero_ps();
  alignas(64) float scales[MR][kSpan * kS];
  const int64_t nb = cols / kBlock;
  // A row of fewer than kMinPrepass blocks reads its scales per block: its prepass would end
  // in a span of a few blocks whose masks are computed one by one (SmolLM2's 576 columns are
  // 16 blocks and 2), which cost more than the prepass saves there.
  constexpr int64_t kMinPrepass = 32;
  constexpr int kStep = IsLegacyBlock(QT) ? BlockBytes<QT>() : 0;  // the others: by group
  auto blocks = [&](auto prepass) TFNB_AVX512 {
    for (int64_t b0 = 0; b0 < nb; b0 += kSpan) {
      const int64_t b1 = std::min(nb, b0 + kSpan);
      if constexpr (decltype(prepass)::value)
        for (int r = 0; r < MR; ++r)
          BlockScales512<QT>(row + r * row_bytes + b0 * BlockBytes<QT>(), b1 - b0, scales[r]);
      const uint8_t* blk = row + b0 * kStep;
      for (int64_t b = b0; b < b1; ++b, blk += kStep) {
        __m512 w[MR][2];
        for (int r = 0; r < MR; ++r) {
          if constexpr (decltype(prepass)::value)
            DecodeBlockScaled512<QT>(blk + r * row_bytes, scales[r] + (b - b0) * kS, w[r]);
          else if constexpr (IsLegacyBlock(QT))
            DecodeBlock512<QT>(blk + r * row_bytes, w[r]);
          else
            DecodeGroup512<QT>(row + r * row_bytes, b, w[r]);
        }
        for (int n = 0; n < NN; ++n) {
          const float* xb = x + n * cols + b * kBlock;
          __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
          // Keeps x0 and x1 in registers: otherwise GCC folds the load into every FMA.
          if (MR > 1) __asm__("" : "+v"(x0), "+v"(x1));
          for (int r = 0; r < MR; ++r) {
            acc[r][n] = _mm512_fmadd_ps(w[r][0], x0, acc[r][n]);
            acc[r][n] = _mm512_fmadd_ps(w[r][1], x1, acc[r][n]);
          }
        }
      }
    }
  };
  if (kScaled && nb >= kMinPrepass)
    blocks(std::bool_constant<kScaled>{});
  else
    blocks(std::false_type{});
  if constexpr (MR * NN < 4) {
    for (int r = 0; r < MR; ++r)
      for (int n = 0; n < NN; ++n) out[r * kMaxN512 + n] = _mm512_reduce_add_ps(acc[r][n]);
  } else {  // eight at a time
    for (int i0 = 0; i0 < MR * NN; i0 += 8) {
      __m512 v[8];
      float sums[8];
      for (int i = 0; i < 8; ++i)
        v[i] = i0 + i < MR * NN ? acc[(i0 + i) / NN][(i0 + i) % NN] : _mm512_setzero_ps();
      ReduceAdd8(v, sums);
      for (int i = 0; i < 8 && i0 + i < MR * NN; ++i)
        out[(i0 + i) / NN * kMaxN512 + (i0 + i) % NN] = sums[i];
    }
  }
}

// Weight rows [row, row + mr) against g (<= kMaxN512) activation rows x: out[r * kMaxN512 + n].
template <int QT>
inline void DotGroupAvx512(const uint8_t* row, int64_t row_bytes, int64_t cols, const float* x,
                           int g, int mr, float* out) {
  if constexpr (!IsFloatType(QT)) {
    if (g == 1) {  // one activation row: two weight rows at once, or DotRowAvx512 for one
      if (mr == 2)
        DotRowsAvx512<QT, 1, 2>(row, row_bytes, cols, x, out);
      else if constexpr (IsLegacyBlock(QT))
        DotRowAvx512<QT, 1>(row, cols, x, out);
      else  // the newer types: one chain, as among 2 to 8 rows
        DotRowsAvx512<QT, 1, 1>(row, row_bytes, cols, x, out);
      return;
    }
    switch (g * 2 + mr - 1) {
#define TFNB_CASE(K) case 2 * K: DotRowsAvx512<QT, K, 1>(row, row_bytes, cols, x, out); break; \
                     case 2 * K + 1: DotRowsAvx512<QT, K, 2>(row, row_bytes, cols, x, out); break;
      TFNB_CASE(2) TFNB_CASE(3) TFNB_CASE(4) TFNB_CASE(5) TFNB_CASE(6) TFNB_CASE(7) TFNB_CASE(8)
#undef TFNB_CASE
    }
  } else {
    switch (g) {
#define TFNB_CASE(K) case K: DotRowAvx512<QT, K>(row, cols, x, out); break;
      TFNB_CASE(1) TFNB_CASE(2) TFNB_CASE(3) TFNB_CASE(4)
      TFNB_CASE(5) TFNB_CASE(6) TFNB_CASE(7) TFNB_CASE(8)
#undef TFNB_CASE
    }
  }
}

// Weight rows [m0, m1) against N activation rows. Up to kMaxN512 rows, one pass over the weight
// rows, two at a time for quantized types. More rows (a prompt) go in groups of kMaxN512 over
// chunks of kChunk512 weight rows, so a chunk's bytes stay near while every group passes and
// the weights stream from memory once (faster than TiledRowsAvx2's tiles, and not sensitive to
// the chunk's size).
constexpr int64_t kChunk512 = 32;

}  // namespace

template <int QT>
void RowsAvx512(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, int64_t N,
                float* y, int64_t M, int64_t m0, int64_t m1) {
  constexpr bool kQuantized = !IsFloatType(QT);
  float out[2 * kMaxN512];
  const int64_t chunk = N <= kMaxN512 ? m1 - m0 : kChunk512;
  for (int64_t c0 = m0; c0 < m1; c0 += chunk) {
    const int64_t c1 = std::min(m1, c0 + chunk);
    for (int64_t n0 = 0; n0 < N; n0 += kMaxN512) {
      const int g = static_cast<int>(std::min<int64_t>(kMaxN512, N - n0));
      for (int64_t m = c0; m < c1;) {
        const uint8_t* row = w + m * row_bytes;
        const int mr = kQuantized && m + 1 < c1 ? 2 : 1;
        if (n0 == 0) PrefetchRow(row, mr * row_bytes, w + m1 * row_bytes);
        DotGroupAvx512<QT>(row, row_bytes, cols, x + n0 * cols, g, mr, out);
        for (int r = 0; r < mr; ++r)
          for (int n = 0; n < g; ++n) y[(n0 + n) * M + m + r] = out[r * kMaxN512 + n];
        m += mr;
      }
    }
  }
}

#define TFNB_INSTANCE(QT)                                                                     \
  template void RowsAvx512<QT>(const uint8_t*, int64_t, int64_t, const float*, int64_t, float*, \
                               int64_t, int64_t, int64_t);
TFNB_INSTANCE(kF32) TFNB_INSTANCE(kF16) TFNB_INSTANCE(kBF16) TFNB_INSTANCE(kQ4_0)
TFNB_INSTANCE(kQ4_1) TFNB_INSTANCE(kQ5_0) TFNB_INSTANCE(kQ5_1) TFNB_INSTANCE(kQ8_0)
TFNB_INSTANCE(kQ4_K) TFNB_INSTANCE(kQ5_K) TFNB_INSTANCE(kQ6_K)
#undef TFNB_INSTANCE

}  // namespace packed
}  // namespace tfnb
#endif  // TFNB_X86
