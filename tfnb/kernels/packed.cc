// tfnb's kernels for GGUF weights kept packed: y = x @ dequantize(w).T without ever
// materialising the float matrix, and a row dequantizer for embedding lookups.
//
// A packed matrix is a uint8 tensor [rows, row_bytes]: each row is one output channel stored
// as the GGUF file holds it (ggml blocks of 32 values for the quantized types). Types (ggml
// ids): F32 0, F16 1, Q4_0 2, Q4_1 3, Q8_0 8.
//
// By default the multiply dequantizes one block of 32 weights into registers and multiplies it
// with the float32 activations, so results equal the float32 path up to summation order. The
// op's `activations = "int8"` instead rounds the activations to int8 blocks (as llama.cpp's Q8
// activations) and uses integer dot products for Q4_0, Q4_1 and Q8_0 weights: on a Zen 3 core
// a SmolLM2 step's matmuls ran 1.4x (batch 1) to 2x (batch 2) faster, but the rounding moved
// its logits by about 4% of their spread and flipped a near-tie greedy token, so it is opt-in
// (benchmarks/results/kernel.md). Where the float route runs its AVX-512 code, the int8 route
// (AVX2 code only) was no faster on a Zen 5 core (10.9 against 10.7 ms at batch 1); on a KVM
// Xeon core with AVX-512 it was 1.05x the float route at batch 1 (12.7 against 13.3 ms) and
// slower from batch 4 (21.5 against 16.6 ms), once the float route decoded through a table.
// Rows are sharded over the process's intra-op threads. The code is chosen at run time:
// AVX-512 (F, BW, VL) for up to 8 activation rows on the float route when the CPU has it,
// AVX2+FMA+F16C for the rest, portable C++ on other CPUs.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/ffi/api/ffi.h"
#include "xla/shape_util.h"

#include "xla_host.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TFNB_X86 1
#endif

namespace tfnb {
namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;

enum QType : int { kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };
constexpr int kBlock = 32;

// Bytes per row of `cols` values, or -1 for a type or width the kernels do not take.
int64_t RowBytes(int qtype, int64_t cols) {
  switch (qtype) {
    case kF32: return cols * 4;
    case kF16: return cols * 2;
    case kQ4_0: return cols % kBlock ? -1 : cols / kBlock * 18;
    case kQ4_1: return cols % kBlock ? -1 : cols / kBlock * 20;
    case kQ8_0: return cols % kBlock ? -1 : cols / kBlock * 34;
    default: return -1;
  }
}

float HalfToFloat(uint16_t h) {
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

uint16_t LoadU16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// ---- portable: one row into floats -------------------------------------------------------

void DequantRow(int qtype, const uint8_t* row, int64_t cols, float* out) {
  switch (qtype) {
    case kF32: std::memcpy(out, row, cols * 4); return;
    case kF16:
      for (int64_t j = 0; j < cols; ++j) out[j] = HalfToFloat(LoadU16(row + 2 * j));
      return;
    case kQ4_0:
      for (int64_t b = 0; b < cols / kBlock; ++b, row += 18, out += kBlock) {
        const float d = HalfToFloat(LoadU16(row));
        for (int j = 0; j < 16; ++j) {
          out[j] = ((row[2 + j] & 0x0f) - 8) * d;
          out[j + 16] = ((row[2 + j] >> 4) - 8) * d;
        }
      }
      return;
    case kQ4_1:
      for (int64_t b = 0; b < cols / kBlock; ++b, row += 20, out += kBlock) {
        const float d = HalfToFloat(LoadU16(row)), m = HalfToFloat(LoadU16(row + 2));
        for (int j = 0; j < 16; ++j) {
          out[j] = (row[4 + j] & 0x0f) * d + m;
          out[j + 16] = (row[4 + j] >> 4) * d + m;
        }
      }
      return;
    case kQ8_0:
      for (int64_t b = 0; b < cols / kBlock; ++b, row += 34, out += kBlock) {
        const float d = HalfToFloat(LoadU16(row));
        for (int j = 0; j < kBlock; ++j) out[j] = static_cast<int8_t>(row[2 + j]) * d;
      }
      return;
  }
}

// Weights stream from memory once per step: each row loop asks for the bytes kPrefetchAhead
// past the row it works on. Hardware prefetchers stop at the end of a 4 KB page, and TF's
// buffers sit on 4 KB pages. Probed on a 2-core KVM Xeon (AVX-512, AMX), SmolLM2's Q4_1
// matmuls in one XLA function (84 MB), one core, 1 / 4 / 8 activation rows: 23-34 / 36-39 /
// 37-39 ms per step without, 13-15 / 18-19 / 27-28 with 2 KB ahead (about as fast with 1.4 to
// 23 KB). The lines a loop then reads cost one instruction each to ask for.
constexpr int64_t kPrefetchAhead = 2048;

inline void PrefetchRow(const uint8_t* row, int64_t row_bytes, const uint8_t* end) {
  const uint8_t* stop = std::min(row + kPrefetchAhead + row_bytes, end);
  for (const uint8_t* p = row + kPrefetchAhead; p < stop; p += 64) __builtin_prefetch(p, 0, 3);
}

// y[n] = dot(row, x[n]) for n < N; `scratch` holds `cols` floats.
void DotRowPortable(int qtype, const uint8_t* row, int64_t cols, const float* x, int64_t N,
                    float* y, int64_t y_stride, float* scratch) {
  DequantRow(qtype, row, cols, scratch);
  for (int64_t n = 0; n < N; ++n) {
    const float* xn = x + n * cols;
    float acc = 0.f;
    for (int64_t j = 0; j < cols; ++j) acc += scratch[j] * xn[j];
    y[n * y_stride] = acc;
  }
}

// ---- AVX2: blocks dequantized in registers -----------------------------------------------

#ifdef TFNB_X86
#define TFNB_AVX2 __attribute__((target("avx2,fma,f16c")))

TFNB_AVX2 float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

TFNB_AVX2 float HalfToFloatF16C(const uint8_t* p) {
  return _cvtsh_ss(LoadU16(p));
}

// 32 unsigned nibbles of a Q4 block (16 bytes) as four vectors of 8 floats, in value order:
// byte j holds value j in its low nibble and value j + 16 in its high one. Each half of the
// bytes is widened once, straight from memory, and gives two vectors (its low nibbles masked,
// its high ones shifted down), the same values as widening four shifted copies of the bytes
// in fewer instructions. Probed on a Zen 3 core, SmolLM2's Q4_1 matrices in a standalone loop
// (fastest of 15 passes, alternated 3 times): 9.8-10.7 against 12.9-14.4 ms at 1 row, 12.1-13.5
// against 15.6-17.2 at 2, 15.2-16.5 against 18.0-18.4 at 3, 19.9-20.0 against 21.4-27.5 at 4.
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

template <int QT>
constexpr int BlockBytes() { return QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34; }

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
// row's single chain ran about 25% slower at one activation row). Probed on a Zen 3 core,
// SmolLM2's Q4_1 matrices, against one row with two or four accumulators per output (the
// order this replaced): 13.2 against 13.7 ms at 1 row, 15.8 against 16.9 at 2, 18.6 against
// 19.3 at 3, 20.6 against 21.4 at 4; at 5 rows (one weight row) 25.5-26.0 against 26.0-26.2.
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

// $TFNB_PACKED_ISA (read once) caps the code this CPU runs: "avx2" keeps an AVX-512 CPU on
// the AVX2 code, "portable" (or $TFNB_PACKED_PORTABLE=1) runs the portable code on any CPU.
// Tests compare each with the best code the CPU has.
bool IsaCapped(const char* cap) {
  static const char* isa = std::getenv("TFNB_PACKED_ISA");
  return isa != nullptr && std::strcmp(isa, cap) == 0;
}

bool HaveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c") && !std::getenv("TFNB_PACKED_PORTABLE")
                           && !IsaCapped("portable");
  return have;
}

bool HaveAvx512() {
  static const bool have = HaveAvx2() && __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && !IsaCapped("avx2");
  return have;
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
// activation row is read once per 4 weight rows. Probed on SmolLM2's matrices, one core, 48
// rows: 312 ms when every weight row read all 48 activation rows (110 KB, out of L1) once per
// group of 8; 173 ms so (and 322 ms at 96 rows, where dequantizing the matrices for XLA's dot
// took 748 ms). On a Zen 5 core these tiles run SmolLM2's 121 matmuls at 48 rows in 125-130 ms
// (about 100 GFLOP/s); the same tiles at AVX-512 width (8 weight rows x 3 activation rows of
// zmm accumulators) took 135-145 ms, and 44-60 against 52-56 ms at 16 rows: each output's
// horizontal sum costs twice as much at 16 lanes. An AVX-512 CPU runs RowsAvx512's groups
// instead, which were faster than these tiles on the KVM Xeon (below).
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

// ---- AVX-512: a block is two vectors of 16 ----------------------------------------------
// The same weights as DecodeBlock (w = q * d + offset, bit for bit those of the AVX2 and
// portable code) in fewer instructions: a Q4 block's 16 possible values are computed once as
// a table (one FMA) and its 32 codes look them up (vpermps), and Q4_1's two halves d and m
// convert in one instruction. A block of 32 is two zmm vectors, and with 32 registers up to 8
// activation rows keep their accumulators in registers. SmolLM2's matmuls (one XLA function,
// Q4_1, one core): see benchmarks/results/kernel.md. Below 8 activation rows the loops take
// each Q4_1 block's scales of a row of 32 blocks or more from a float copy made before them
// (BlockScales512, DecodeBlockScaled512), as does a lone weight row of any type
// (DotRowAvx512). Probed on the KVM Xeon, SmolLM2's matmuls and head in one XLA function, one
// core, CPU ms, alternated 3 times: 13.0-13.4 against 13.7-13.9 at 1 row, 14.3-14.9 against
// 15.8-16.0 at 3, 16.3-16.7 against 17.4-17.6 at 4, 19.9-20.0 against 20.7-20.9 at 6; at 8
// rows 25.2-25.5 against 25.0-25.3, so 8 rows keep this decode.
#define TFNB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

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

// The scales of `n` (<= 64) consecutive blocks of a quantized row as float32, 16 blocks per
// conversion: Q4_1 as pairs (d, m) in `out[2b]`, `out[2b + 1]`; Q4_0 and Q8_0 as d in
// `out[b]`. Nothing past the n blocks is read. A gather did this before; on the Zen 4 machine
// its instruction held 12% of the 4-row kernel's profile samples. Q4_1's heads (dword 5b of a
// run of 16 blocks) are now picked out of five plain loads by permutes, the other types' d
// (at 18b or 34b bytes, not dword-aligned) read one by one. Zen 4, one core, one XLA function,
// alternated processes: SmolLM2's Q4_1 matmuls and a Q4_1 head at 4 rows 17.9 ms against
// 19.4-20.2; its Q8_0 head alone at 1 row, one weight row at a time, 2.7-2.8 against 3.1.
// Served on two one-core replicas, 8 clients gave 251.6 against 246.0 tokens/s (medians of 5
// rounds).
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
  if constexpr (QT == kF32 || QT == kF16) {
    for (int64_t j = 0; j < cols; j += 16) {
      const __m512 w = QT == kF32
          ? _mm512_loadu_ps(reinterpret_cast<const float*>(row) + j)
          : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * j)));
      const int a = static_cast<int>((j / 16) % A);
      for (int n = 0; n < NN; ++n)
        acc[n][a] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + n * cols + j), acc[n][a]);
    }
  } else {
    static_assert(NN == 1, "quantized rows against 2 or more activation rows: DotRowsAvx512");
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
// register as they halve. `sums[k]` is v[k]'s. A 2-to-8-row call ends with 4 to 16 sums, and
// SmolLM2's rows are 18 blocks: on the Zen 4, alternated twice, its matmuls and Q8_0 head in
// one XLA function took 15.6-16.2 against 16.1-17.1 ms at 4 rows and 26.4-26.9 against
// 28.5-28.8 at 8 (the kernel's code alone, 576 columns: 12.1 against 12.7 cycles per weight
// row and block at 4 rows, 20.0 against 21.9 at 8).
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
// loaded feeds MR FMAs. Probed on the KVM Xeon (one core): a 512-bit load from L1 issued about
// once per cycle, so at one weight row the loads, not the FMAs, set the pace; two rows took
// SmolLM2's matmuls at 8 activation rows from 25-27 to 21-23 ms (four rows at 4 activation
// rows ran no faster than two). One activation row goes two weight rows at a time too: on the
// Zen 4, SmolLM2's matmuls and Q8_0 head in one XLA function took 10.3-10.4 ms at 1 row
// against 11.1-11.3 one weight row at a time (DotRowAvx512; alternated 3 times), and each
// output then sums in the order it does at any other row count. Q4_1's block scales of rows
// of 32 blocks or more are converted 64 blocks at a time before their codes (BlockScales512,
// kMinPrepass below): on the KVM Xeon a block's conversion and broadcasts inside the loop
// took the shuffle port that the codes' lookups and half the FMAs need.
template <int QT, int NN, int MR>
TFNB_AVX512 void DotRowsAvx512(const uint8_t* row, int64_t row_bytes, int64_t cols,
                               const float* x, float* out) {
  constexpr int kS = QT == kQ4_1 ? 2 : 1;  // scale floats per block
  constexpr int64_t kSpan = 64;            // blocks per scale conversion
  // At 8 rows the prepass measured no faster; Q4_0 and Q8_0 read their one scale per block
  // (on the Zen 4 SmolLM2's Q8_0 head at 4 rows took 3.8-3.9 ms so, 4.4-4.9 with a prepass)
  constexpr bool kScaled = NN < kMaxN512 && QT == kQ4_1;
  __m512 acc[MR][NN];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NN; ++n) acc[r][n] = _mm512_setzero_ps();
  alignas(64) float scales[MR][kSpan * kS];
  const int64_t nb = cols / kBlock;
  // A row of fewer than kMinPrepass blocks reads its scales per block: its prepass ends in
  // a span of a few blocks whose masks are computed one by one (SmolLM2's 576 columns are 16
  // blocks and 2). The kernel's code compiled alone, one Zen 4 core, 576 weight rows in L2,
  // cycles per weight row and block on rows of 18 blocks: 12.8-13.2 at 4 activation rows
  // against 13.8-14.0 with the prepass, 7.3 against 8.1 at 1, 16.8 against 18.7-20.5 at 6; on
  // rows of 48 blocks within 3% either way (11.75 against 11.71-11.73 at 4).
  constexpr int64_t kMinPrepass = 32;
  auto blocks = [&](auto prepass) TFNB_AVX512 {
    for (int64_t b0 = 0; b0 < nb; b0 += kSpan) {
      const int64_t b1 = std::min(nb, b0 + kSpan);
      for (int r = 0; r < MR && prepass; ++r)
        BlockScales512<QT>(row + r * row_bytes + b0 * BlockBytes<QT>(), b1 - b0, scales[r]);
      const uint8_t* blk = row + b0 * BlockBytes<QT>();
      for (int64_t b = b0; b < b1; ++b, blk += BlockBytes<QT>()) {
        __m512 w[MR][2];
        for (int r = 0; r < MR; ++r) {
          if constexpr (decltype(prepass)::value)
            DecodeBlockScaled512<QT>(blk + r * row_bytes, scales[r] + (b - b0) * kS, w[r]);
          else
            DecodeBlock512<QT>(blk + r * row_bytes, w[r]);
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
  if constexpr (QT != kF32 && QT != kF16) {
    if (g == 1) {  // one activation row: two weight rows at once, or DotRowAvx512 for one
      if (mr == 2)
        DotRowsAvx512<QT, 1, 2>(row, row_bytes, cols, x, out);
      else
        DotRowAvx512<QT, 1>(row, cols, x, out);
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
// the weights stream from memory once. Probed on the KVM Xeon (one core, SmolLM2's 120 block
// matmuls, Q4_1, one XLA function, CPU ms, two processes each): 48 rows 91-101 ms against
// 107-111 in TiledRowsAvx2, 16 rows 32-34 against 42-43, 24 rows 49-50 against 58-64, 96
// rows 187 against 208-222, 384 rows 756-757 against 833-881 (chunks of 8 to 256 weight rows
// all within 91-106 ms at 48 rows). A served prompt of 37 tokens (48 padded) then prefilled
// in 115-117 ms against 125-129 on a one-core worker.
constexpr int64_t kChunk512 = 32;

template <int QT>
void RowsAvx512(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, int64_t N,
                float* y, int64_t M, int64_t m0, int64_t m1) {
  constexpr bool kQuantized = QT != kF32 && QT != kF16;
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
#endif  // TFNB_X86

// ---- int8 activations (opt-in: the op's `activations = "int8"`) --------------------------
// Each activation row is quantized once per call into blocks of 32 int8 q with a float scale
// d = max|x| / 127 (q = x / d rounded to nearest even) and s = d * sum(q). A weight block's dot
// is then an integer dot of its 32 codes with q, scaled by d_w * d_x; the offset of a Q4 block
// (Q4_0: -8 d_w, Q4_1: m) multiplies s. The result is exactly dequantize(w) . dequantize(q(x))
// up to float rounding: the only approximation is the activations' rounding, at most d_x / 2
// per value. Portable and AVX2 code quantize identically, so machines agree up to summation
// order. A block holding an inf or NaN gets scale NaN (its row's outputs are NaN).

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
#endif  // TFNB_X86

void RowsQ8(int qtype, const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, float* y,
            int64_t M, int64_t m0, int64_t m1) {
#ifdef TFNB_X86
  if (HaveAvx2()) {
    switch (qtype) {
      case kQ4_0: return RowsQ8Avx2<kQ4_0>(w, row_bytes, xq, y, M, m0, m1);
      case kQ4_1: return RowsQ8Avx2<kQ4_1>(w, row_bytes, xq, y, M, m0, m1);
      case kQ8_0: return RowsQ8Avx2<kQ8_0>(w, row_bytes, xq, y, M, m0, m1);
    }
  }
#endif
  RowsQ8Portable(qtype, w, row_bytes, xq, y, M, m0, m1);
}

bool TakesInt8(int qtype) { return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0; }

// y[:, m0:m1] for x [N, cols] and packed w [M, row_bytes]; y is [N, M].
void Rows(int qtype, const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x,
          int64_t N, float* y, int64_t M, int64_t m0, int64_t m1) {
#ifdef TFNB_X86
  if (HaveAvx512() && (TakesInt8(qtype) || cols % 16 == 0)) {
    switch (qtype) {
      case kF32: return RowsAvx512<kF32>(w, row_bytes, cols, x, N, y, M, m0, m1);
      case kF16: return RowsAvx512<kF16>(w, row_bytes, cols, x, N, y, M, m0, m1);
      case kQ4_0: return RowsAvx512<kQ4_0>(w, row_bytes, cols, x, N, y, M, m0, m1);
      case kQ4_1: return RowsAvx512<kQ4_1>(w, row_bytes, cols, x, N, y, M, m0, m1);
      case kQ8_0: return RowsAvx512<kQ8_0>(w, row_bytes, cols, x, N, y, M, m0, m1);
    }
  }
  if (HaveAvx2() && cols % 8 == 0) {
    switch (qtype) {
      case kF32: return RowsAvx2<kF32>(w, row_bytes, cols, x, N, y, M, m0, m1);
      case kF16: return RowsAvx2<kF16>(w, row_bytes, cols, x, N, y, M, m0, m1);
      case kQ4_0: return RowsAvx2<kQ4_0>(w, row_bytes, cols, x, N, y, M, m0, m1);
      case kQ4_1: return RowsAvx2<kQ4_1>(w, row_bytes, cols, x, N, y, M, m0, m1);
      case kQ8_0: return RowsAvx2<kQ8_0>(w, row_bytes, cols, x, N, y, M, m0, m1);
    }
  }
#endif
  std::unique_ptr<float[]> scratch(new float[cols]);
  for (int64_t m = m0; m < m1; ++m) {
    PrefetchRow(w + m * row_bytes, row_bytes, w + m1 * row_bytes);
    DotRowPortable(qtype, w + m * row_bytes, cols, x, N, y + m, M, scratch.get());
  }
}

// y = x @ dequantize(w).T, rows of w split by `parallel_for(fn)`, which calls fn(m0, m1) on
// disjoint ranges covering [0, M).
// With `int8`, block types multiply int8-quantized activations (quantized once, here).
//
// Rows of x that are all zeros get zero outputs without being multiplied: the runtime zeroes
// the rows nobody reads (a prompt's left padding, a lane's free rows), and the rest are
// multiplied packed together, so a prompt of 37 tokens padded to 48 costs 5 groups of 8 rows,
// not 6. (Weights holding inf or NaN would give NaN for such a row where this gives 0.)
template <typename ParallelFor>
void PackedMatMul(int qtype, const uint8_t* w, int64_t rb, int64_t cols, const float* x,
                  int64_t N, float* y, int64_t M, bool int8, ParallelFor&& parallel_for) {
  const auto read = [&](int64_t n) {
    return std::any_of(x + n * cols, x + (n + 1) * cols, [](float v) { return v != 0.f; });
  };
  int64_t first_zero = 0;  // most calls have none: nothing allocated for them
  while (first_zero < N && read(first_zero)) ++first_zero;
  if (first_zero < N) {
    std::vector<int64_t> live;
    for (int64_t n = 0; n < N; ++n)
      if (n < first_zero || (n > first_zero && read(n))) live.push_back(n);
    std::fill(y, y + N * M, 0.f);
    const int64_t L = static_cast<int64_t>(live.size());
    if (L == 0) return;
    std::unique_ptr<float[]> xs(new float[L * cols]), ys(new float[L * M]);
    for (int64_t i = 0; i < L; ++i) std::copy_n(x + live[i] * cols, cols, xs.get() + i * cols);
    PackedMatMul(qtype, w, rb, cols, xs.get(), L, ys.get(), M, int8, parallel_for);
    for (int64_t i = 0; i < L; ++i) std::copy_n(ys.get() + i * M, M, y + live[i] * M);
    return;
  }
  if (int8 && TakesInt8(qtype)) {
    QuantizedRows xq;
    QuantizeRows(x, N, cols, &xq);
    parallel_for([&](int64_t m0, int64_t m1) { RowsQ8(qtype, w, rb, xq, y, M, m0, m1); });
    return;
  }
  parallel_for([&](int64_t m0, int64_t m1) { Rows(qtype, w, rb, cols, x, N, y, M, m0, m1); });
}

// ---- the ops -----------------------------------------------------------------------------

tensorflow::Status CheckPacked(OpKernelContext* ctx, const Tensor& w, int qtype, int64_t cols) {
  const int64_t row_bytes = RowBytes(qtype, cols);
  if (row_bytes < 0)
    return InvalidArgument("tfnb packed weights: qtype ", qtype, " with ", cols,
                           " columns is not supported (expected F32 0, F16 1, Q4_0 2, Q4_1 3 or "
                           "Q8_0 8, and a multiple of 32 columns for the block types)");
  if (w.dims() != 2 || w.dim_size(1) != row_bytes)
    return InvalidArgument("tfnb packed weights: shape ", w.shape().DebugString(),
                           " does not hold rows of ", cols, " values of qtype ", qtype,
                           " (expected [rows, ", row_bytes, "])");
  return tensorflow::OkStatus();
}

// The op's `activations` attribute: "float32" (default) or "int8".
bool Int8Activations(OpKernelConstruction* ctx) {
  std::string activations;
  if (!ctx->GetAttr("activations", &activations).ok()) return false;
  return activations == "int8";
}

class PackedMatMulOp : public OpKernel {
 public:
  explicit PackedMatMulOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("qtype", &qtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cols", &cols_));
    int8_ = Int8Activations(ctx);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& w = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckPacked(ctx, w, qtype_, cols_));
    OP_REQUIRES(ctx, x.dims() == 2 && x.dim_size(1) == cols_,
                InvalidArgument("TfnbPackedMatMul: x has shape ", x.shape().DebugString(),
                                ", expected [N, ", cols_, "]"));
    const int64_t N = x.dim_size(0), M = w.dim_size(0), row_bytes = w.dim_size(1);
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({N, M}), &y));
    if (N == 0 || M == 0) return;
    const float* xp = x.flat<float>().data();
    const uint8_t* wp = w.flat<uint8_t>().data();
    float* yp = y->flat<float>().data();
    const int qtype = qtype_;
    const int64_t cols = cols_;
    const auto& threads = *ctx->device()->tensorflow_cpu_worker_threads();
    PackedMatMul(qtype, wp, row_bytes, cols, xp, N, yp, M, int8_, [&](auto&& fn) {
      tensorflow::Shard(threads.num_threads, threads.workers, M, /*cost_per_unit=*/N * cols * 2,
                        fn);
    });
  }

 private:
  int qtype_;
  int64_t cols_;
  bool int8_ = false;
};

class PackedDequantizeOp : public OpKernel {
 public:
  explicit PackedDequantizeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("qtype", &qtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cols", &cols_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& w = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckPacked(ctx, w, qtype_, cols_));
    const int64_t M = w.dim_size(0), row_bytes = w.dim_size(1);
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({M, cols_}), &y));
    const uint8_t* wp = w.flat<uint8_t>().data();
    float* yp = y->flat<float>().data();
    for (int64_t m = 0; m < M; ++m) DequantRow(qtype_, wp + m * row_bytes, cols_, yp + m * cols_);
  }

 private:
  int qtype_;
  int64_t cols_;
};


// ---- inside XLA: the same kernels as custom calls ----------------------------------------
// A segment that holds packed weights stays one XLA computation: XLA compiles the norms,
// rotary embedding and attention around `tfnb_packed_matmul` / `tfnb_packed_dequantize` calls.
// They are typed-FFI handlers (the API XLA:CPU runs) with the qtype and width as attributes.

namespace ffi = xla::ffi;
using xla_host::ParallelRows;
using xla_host::RowMajor;

template <bool kInt8>
ffi::Error PackedMatMulFfi(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                           ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t cols) {
  const int64_t N = x.dimensions()[0], M = w.dimensions()[0];
  const int64_t rb = RowBytes(static_cast<int>(qtype), cols);
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  float* yp = y->typed_data();
  PackedMatMul(static_cast<int>(qtype), wp, rb, cols, xp, N, yp, M, kInt8, [&](auto&& fn) {
    ParallelRows(pool, M, N * cols, fn);
  });
  return ffi::Error::Success();
}

ffi::Error PackedDequantizeFfi(ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y,
                               int64_t qtype, int64_t cols) {
  const int64_t M = w.dimensions()[0];
  const int64_t rb = RowBytes(static_cast<int>(qtype), cols);
  for (int64_t m = 0; m < M; ++m)
    DequantRow(static_cast<int>(qtype), w.typed_data() + m * rb, cols, y->typed_data() + m * cols);
  return ffi::Error::Success();
}

#define TFNB_MATMUL_BINDING                  \
  ffi::Ffi::Bind()                           \
      .Ctx<ffi::ThreadPool>()                \
      .Arg<ffi::Buffer<ffi::F32>>()          \
      .Arg<ffi::Buffer<ffi::U8>>()           \
      .Ret<ffi::Buffer<ffi::F32>>()          \
      .Attr<int64_t>("qtype")                \
      .Attr<int64_t>("cols")
XLA_FFI_DEFINE_HANDLER(kPackedMatMul, PackedMatMulFfi<false>, TFNB_MATMUL_BINDING);
XLA_FFI_DEFINE_HANDLER(kPackedMatMulInt8, PackedMatMulFfi<true>, TFNB_MATMUL_BINDING);
#undef TFNB_MATMUL_BINDING
XLA_FFI_DEFINE_HANDLER(kPackedDequantize, PackedDequantizeFfi,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::U8>>()
                           .Ret<ffi::Buffer<ffi::F32>>()
                           .Attr<int64_t>("qtype")
                           .Attr<int64_t>("cols"));
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), "tfnb_packed_matmul", "Host", kPackedMatMul);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), "tfnb_packed_matmul_int8", "Host", kPackedMatMulInt8);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), "tfnb_packed_dequantize", "Host", kPackedDequantize);

// The handlers' attributes, as XLA's typed FFI reads a custom call's backend config.
std::string Attrs(int qtype, int64_t cols) {
  return "{qtype = " + std::to_string(qtype) + " : i64, cols = " + std::to_string(cols) +
         " : i64}";
}

class PackedMatMulXla : public tensorflow::XlaOpKernel {
 public:
  explicit PackedMatMulXla(OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("qtype", &qtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cols", &cols_));
    int8_ = Int8Activations(ctx);
  }
  void Compile(tensorflow::XlaOpKernelContext* ctx) override {
    const TensorShape xs = ctx->InputShape(0), ws = ctx->InputShape(1);
    const int64_t rb = RowBytes(qtype_, cols_);
    OP_REQUIRES(ctx, rb > 0 && ws.dims() == 2 && ws.dim_size(1) == rb && xs.dims() == 2 &&
                         xs.dim_size(1) == cols_,
                InvalidArgument("TfnbPackedMatMul: x ", xs.DebugString(), ", w ",
                                ws.DebugString(), " do not match qtype ", qtype_, ", cols ",
                                cols_));
    const int64_t N = xs.dim_size(0), M = ws.dim_size(0);
    ctx->SetOutput(0, xla::CustomCallWithLayout(
        ctx->builder(), int8_ ? "tfnb_packed_matmul_int8" : "tfnb_packed_matmul",
        {ctx->Input(0), ctx->Input(1)},
        RowMajor(xla::F32, {N, M}), {RowMajor(xla::F32, {N, cols_}), RowMajor(xla::U8, {M, rb})},
        Attrs(qtype_, cols_), false, {}, nullptr, xla::CustomCallSchedule::SCHEDULE_NONE,
        xla::CustomCallApiVersion::API_VERSION_TYPED_FFI));
  }

 private:
  int qtype_;
  int64_t cols_;
  bool int8_ = false;
};

class PackedDequantizeXla : public tensorflow::XlaOpKernel {
 public:
  explicit PackedDequantizeXla(OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("qtype", &qtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cols", &cols_));
  }
  void Compile(tensorflow::XlaOpKernelContext* ctx) override {
    const TensorShape ws = ctx->InputShape(0);
    const int64_t rb = RowBytes(qtype_, cols_);
    OP_REQUIRES(ctx, rb > 0 && ws.dims() == 2 && ws.dim_size(1) == rb,
                InvalidArgument("TfnbPackedDequantize: w ", ws.DebugString(),
                                " does not match qtype ", qtype_, ", cols ", cols_));
    const int64_t M = ws.dim_size(0);
    ctx->SetOutput(0, xla::CustomCallWithLayout(
        ctx->builder(), "tfnb_packed_dequantize", {ctx->Input(0)}, RowMajor(xla::F32, {M, cols_}),
        {RowMajor(xla::U8, {M, rb})}, Attrs(qtype_, cols_), false, {}, nullptr,
        xla::CustomCallSchedule::SCHEDULE_NONE, xla::CustomCallApiVersion::API_VERSION_TYPED_FFI));
  }

 private:
  int qtype_;
  int64_t cols_;
};

}  // namespace

REGISTER_XLA_OP(Name("TfnbPackedMatMul").Device(tensorflow::DEVICE_CPU_XLA_JIT), PackedMatMulXla);
REGISTER_XLA_OP(Name("TfnbPackedDequantize").Device(tensorflow::DEVICE_CPU_XLA_JIT),
                PackedDequantizeXla);

// The code the matmuls run on this CPU: "avx512", "avx2" or "portable" (tfnb.kernels.isa()).
extern "C" const char* tfnb_packed_isa() {
#ifdef TFNB_X86
  if (HaveAvx512()) return "avx512";
  if (HaveAvx2()) return "avx2";
#endif
  return "portable";
}

// Every XLA kernel of the library, registered late if need be (xla_host.h): tfnb.kernels calls
// it right after loading.
extern "C" int tfnb_register_xla_kernels() {
  using tfnb::xla_host::RegisterXlaKernelLate;
  RegisterXlaKernelLate<PackedMatMulXla>("TfnbPackedMatMul", "PackedMatMulXla");
  RegisterXlaKernelLate<PackedDequantizeXla>("TfnbPackedDequantize", "PackedDequantizeXla");
  tfnb::attention::RegisterXlaKernelLate();
  return 1;
}

using tensorflow::shape_inference::InferenceContext;

REGISTER_OP("TfnbPackedMatMul")
    .Input("x: float")
    .Input("w: uint8")
    .Attr("qtype: int")
    .Attr("cols: int")
    .Attr("activations: {'float32', 'int8'} = 'float32'")
    .Output("y: float")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Matrix(c->Dim(c->input(0), 0), c->Dim(c->input(1), 0)));
      return tensorflow::OkStatus();
    })
    .Doc("y = x @ dequantize(w).T for float32 x [N, cols] and packed GGUF rows w [M, bytes]; "
         "activations='int8' quantizes x to int8 blocks first for Q4_0, Q4_1 and Q8_0 weights.");

REGISTER_OP("TfnbPackedDequantize")
    .Input("w: uint8")
    .Attr("qtype: int")
    .Attr("cols: int")
    .Output("y: float")
    .SetShapeFn([](InferenceContext* c) {
      int64_t cols;
      TF_RETURN_IF_ERROR(c->GetAttr("cols", &cols));
      c->set_output(0, c->Matrix(c->Dim(c->input(0), 0), cols));
      return tensorflow::OkStatus();
    })
    .Doc("float32 [M, cols] values of packed GGUF rows w [M, bytes].");

REGISTER_KERNEL_BUILDER(Name("TfnbPackedMatMul").Device(tensorflow::DEVICE_CPU), PackedMatMulOp);
REGISTER_KERNEL_BUILDER(Name("TfnbPackedDequantize").Device(tensorflow::DEVICE_CPU),
                        PackedDequantizeOp);

}  // namespace tfnb
