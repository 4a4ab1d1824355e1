// What the packed-weight kernels share: GGUF's block layouts, scalar helpers, and the entry
// points packed_op.cc dispatches to. The kernels are one file per instruction set
// (packed_portable.cc, packed_avx2.cc, packed_avx512.cc; packed_int8.cc for the opt-in int8
// route), so each reads alone, without TensorFlow. All are built with the same flags: x86 code
// carries GCC target attributes, so one library runs on any x86-64 CPU and picks its code at
// run time (HaveAvx2, HaveAvx512). docs/kernels.md describes them.
#ifndef TFNB_KERNELS_PACKED_COMMON_H_
#define TFNB_KERNELS_PACKED_COMMON_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TFNB_X86 1
#endif

namespace tfnb {
namespace packed {

// A packed matrix is a uint8 tensor [rows, row_bytes]: each row is one output channel stored
// as the GGUF file holds it. Types by ggml id: the float types F32, F16 and BF16 (the top 16
// bits of a float32), and the block types, whose decoders all turn out 32 values (a group) at
// a time. Blocks of 32 values, a float16 scale d first: Q4_0 (18 bytes) then 16 bytes of 4-bit
// codes q, value (q - 8) d; Q4_1 (20) a float16 m, then codes, value q d + m; Q8_0 (34) 32 int8
// codes, value q d; Q5_0 (22) and Q5_1 (24) as Q4_0 and Q4_1 with a 32-bit word qh (before
// the nibbles) whose bit j is value j's fifth bit, values (q - 16) d and q d + m. A 4-bit
// block's byte j holds value j in its low nibble and value j + 16 in its high one. The
// K-quants hold 256 values (8 groups) per block: their layouts are below, above KScaleMin.
enum QType : int {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30
};
constexpr int kBlock = 32;  // values per group: what every block decoder turns out at once

constexpr bool IsFloatType(int qt) { return qt == kF32 || qt == kF16 || qt == kBF16; }
constexpr bool IsKQuant(int qt) { return qt == kQ4_K || qt == kQ5_K || qt == kQ6_K; }
// The types the int8 route (packed_int8.cc) and the AVX-512 code's scale prepasses know.
constexpr bool IsLegacyBlock(int qt) { return qt == kQ4_0 || qt == kQ4_1 || qt == kQ8_0; }

// Values and bytes per block (0 for the float types).
constexpr int BlockValues(int qt) { return IsKQuant(qt) ? 256 : IsFloatType(qt) ? 0 : kBlock; }
constexpr int BlockBytesOf(int qt) {
  return qt == kQ4_0 ? 18 : qt == kQ4_1 ? 20 : qt == kQ5_0 ? 22 : qt == kQ5_1 ? 24
       : qt == kQ8_0 ? 34 : qt == kQ4_K ? 144 : qt == kQ5_K ? 176 : qt == kQ6_K ? 210 : 0;
}
template <int QT>
constexpr int BlockBytes() { return BlockBytesOf(QT); }

// Bytes per row of `cols` values, or -1 for a type or width the kernels do not take.
inline int64_t RowBytes(int qtype, int64_t cols) {
  switch (qtype) {
    case kF32: return cols * 4;
    case kF16: case kBF16: return cols * 2;
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0:
    case kQ4_K: case kQ5_K: case kQ6_K:
      return cols % BlockValues(qtype) ? -1 : cols / BlockValues(qtype) * BlockBytesOf(qtype);
    default: return -1;
  }
}

// The block holding group g (values 32 g to 32 g + 31) of a row, and g's place in it.
template <int QT>
inline const uint8_t* GroupBlock(const uint8_t* row, int64_t g) {
  return row + g / (BlockValues(QT) / kBlock) * BlockBytes<QT>();
}
template <int QT>
inline int GroupInBlock(int64_t g) { return static_cast<int>(g % (BlockValues(QT) / kBlock)); }

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t LoadU16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t LoadU32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

inline float BF16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The K-quants: blocks of 256 values in 8 groups of 32.
//   Q4_K (144 bytes): float16 d, float16 dmin, 12 bytes of 6-bit scales sc and mins m (one
//     each per group; KScaleMin), 128 bytes of nibbles: group g's value j is the low (g even)
//     or high (g odd) nibble of byte 32 (g / 2) + j. Value q d sc - dmin m.
//   Q5_K (176): as Q4_K, with 32 bytes qh before the nibbles: bit g of qh[j] is the fifth bit.
//   Q6_K (210): 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 values), float16 d last.
//     Value (q - 32) d sc. Group g = 4 h + k (h the half of 128 values): the low 4 bits are
//     the low (k < 2) or high nibbles of ql[64 h + 32 (k % 2) + j], the top 2 bits are bits
//     2k, 2k + 1 of qh[32 h + j].
// Every product in these values is exact in float32 (d sc and dmin m are products of an 11-bit
// and a 6- or 8-bit integer, times codes of 4 to 6 bits), so any order of the multiplies, fused
// or not, gives gguf's values bit for bit; only Q4_K and Q5_K's subtraction rounds.
// Group g's 6-bit scale and min of a Q4_K or Q5_K block, from its 12 scale bytes: groups 0-3
// hold them in the low 6 bits of bytes g and g + 4; groups 4-7 in the nibbles of byte g + 4,
// their top 2 bits in the top bits of bytes g - 4 and g.
inline void KScaleMin(const uint8_t* s, int g, int* sc, int* m) {
  if (g < 4) {
    *sc = s[g] & 63;
    *m = s[g + 4] & 63;
  } else {
    *sc = (s[g + 4] & 0x0f) | ((s[g - 4] >> 6) << 4);
    *m = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
}

// Weights stream from memory once per step: each row loop asks for the bytes kPrefetchAhead
// past the row it works on, since hardware prefetchers stop at the end of a 4 KB page (and
// TF's buffers sit on 4 KB pages). The lines a loop then reads cost one instruction each.
constexpr int64_t kPrefetchAhead = 2048;

inline void PrefetchRow(const uint8_t* row, int64_t row_bytes, const uint8_t* end) {
  const uint8_t* stop = std::min(row + kPrefetchAhead + row_bytes, end);
  for (const uint8_t* p = row + kPrefetchAhead; p < stop; p += 64) __builtin_prefetch(p, 0, 3);
}

// Whether this CPU runs the AVX2 or AVX-512 code, as $TFNB_PACKED_ISA caps it (packed_op.cc).
bool HaveAvx2();
bool HaveAvx512();

// Every `Rows` entry point computes y[:, m0:m1] of y = x @ dequantize(w).T, for float32 x
// [N, cols] and packed w [M, row_bytes]; y is [N, M], row-major.

// packed_portable.cc: any CPU.
void DequantRow(int qtype, const uint8_t* row, int64_t cols, float* out);
void RowsPortable(int qtype, const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x,
                  int64_t N, float* y, int64_t M, int64_t m0, int64_t m1);

#ifdef TFNB_X86
#define TFNB_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TFNB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

TFNB_AVX2 inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

TFNB_AVX2 inline float HalfToFloatF16C(const uint8_t* p) {
  return _cvtsh_ss(LoadU16(p));
}

// packed_avx2.cc and packed_avx512.cc, one instance per QType.
template <int QT>
void RowsAvx2(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, int64_t N,
              float* y, int64_t M, int64_t m0, int64_t m1);
template <int QT>
void RowsAvx512(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, int64_t N,
                float* y, int64_t M, int64_t m0, int64_t m1);
#endif  // TFNB_X86

// packed_int8.cc: activation rows rounded to int8 blocks once per call as llama.cpp rounds
// them, then integer dot products with Q4_0, Q4_1 and Q8_0 rows (the op's
// `activations = "int8"`).
struct QuantizedRows {
  int64_t n = 0, nb = 0;          // rows, blocks per row
  std::unique_ptr<int8_t[]> q;    // [n, nb, 32]
  std::unique_ptr<float[]> d;     // [n, nb]: each block's scale, float16-rounded
  std::unique_ptr<int32_t[]> sum; // [n, nb]: sum of each block's q
  std::unique_ptr<float[]> s;     // [n, nb]: float16(d * sum q), Q4_1's offset term
  const int8_t* Q(int64_t r, int64_t b) const { return q.get() + (r * nb + b) * kBlock; }
  const float* D(int64_t r) const { return d.get() + r * nb; }
  const int32_t* Sum(int64_t r) const { return sum.get() + r * nb; }
  const float* S(int64_t r) const { return s.get() + r * nb; }
};

void QuantizeRows(const float* x, int64_t N, int64_t cols, QuantizedRows* out);
void RowsQ8Portable(int qtype, const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq,
                    float* y, int64_t M, int64_t m0, int64_t m1);
#ifdef TFNB_X86
// The integer dot instruction the x86 int8 code uses (Int8Dot in packed_op.cc).
enum Int8Dot : int { kInt8Maddubs = 0, kInt8AvxVnni = 1, kInt8Vnni512 = 2 };
template <int QT, int kDot>
void RowsQ8X86(const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, float* y,
               int64_t M, int64_t m0, int64_t m1);
#endif

}  // namespace packed
}  // namespace tfnb

#endif  // TFNB_KERNELS_PACKED_COMMON_H_
