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
// as the GGUF file holds it. Types by ggml id. The block types hold 32 values per block, a
// float16 scale d first: Q4_0 (18 bytes) then 16 bytes of 4-bit codes q, value (q - 8) d; Q4_1
// (20) a float16 m, then codes, value q d + m; Q8_0 (34) 32 int8 codes, value q d. A Q4
// block's byte j holds value j in its low nibble and value j + 16 in its high one.
enum QType : int { kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };
constexpr int kBlock = 32;

template <int QT>
constexpr int BlockBytes() { return QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34; }

// Bytes per row of `cols` values, or -1 for a type or width the kernels do not take.
inline int64_t RowBytes(int qtype, int64_t cols) {
  switch (qtype) {
    case kF32: return cols * 4;
    case kF16: return cols * 2;
    case kQ4_0: return cols % kBlock ? -1 : cols / kBlock * 18;
    case kQ4_1: return cols % kBlock ? -1 : cols / kBlock * 20;
    case kQ8_0: return cols % kBlock ? -1 : cols / kBlock * 34;
    default: return -1;
  }
}

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

// packed_int8.cc: activation rows rounded to int8 blocks once per call, then integer dot
// products with Q4_0, Q4_1 and Q8_0 rows (the op's `activations = "int8"`).
struct QuantizedRows {
  int64_t n = 0, nb = 0;  // rows, blocks per row
  int64_t n8 = 0;               // n rounded up to a multiple of 8
  std::unique_ptr<int8_t[]> q;  // [nb, n, 32]: block-major, a group of rows' block is contiguous
  std::unique_ptr<float[]> d;   // [n, nb]
  std::unique_ptr<float[]> s;   // [n, nb]
  std::unique_ptr<float[]> dt;  // d transposed, [nb, n8] (zero past n): a group's side by side
  const int8_t* Q(int64_t b, int64_t r) const { return q.get() + (b * n + r) * kBlock; }
  const float* D(int64_t r) const { return d.get() + r * nb; }
  const float* S(int64_t r) const { return s.get() + r * nb; }
};

void QuantizeRows(const float* x, int64_t N, int64_t cols, QuantizedRows* out);
void RowsQ8Portable(int qtype, const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq,
                    float* y, int64_t M, int64_t m0, int64_t m1);
#ifdef TFNB_X86
template <int QT>
void RowsQ8Avx2(const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, float* y,
                int64_t M, int64_t m0, int64_t m1);
#endif

}  // namespace packed
}  // namespace tfnb

#endif  // TFNB_KERNELS_PACKED_COMMON_H_
