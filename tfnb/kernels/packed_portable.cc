// The packed kernels in plain C++, for CPUs without AVX2 (and $TFNB_PACKED_ISA=portable): a
// row is dequantized into floats, then dotted with each activation row in column order. The
// SIMD files agree with it up to summation order. Its DequantRow is the dequantize op's code
// on every CPU (embedding lookups, and long prefills that multiply with XLA's dot instead).

#include <cstdint>
#include <cstring>
#include <memory>

#include "packed_common.h"

namespace tfnb {
namespace packed {
namespace {

// Group `g` (0-7) of a K-quant block as 32 floats.
void KGroupPortable(int qtype, const uint8_t* blk, int g, float* out) {
  if (qtype == kQ6_K) {
    const int h = g / 4, k = g % 4;
    const uint8_t* ql = blk + 64 * h + 32 * (k % 2);
    const uint8_t* qh = blk + 128 + 32 * h;
    const float d = HalfToFloat(LoadU16(blk + 208));
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192 + 2 * g);
    for (int j = 0; j < kBlock; ++j) {
      const int q = ((ql[j] >> (4 * (k / 2))) & 0x0f) | (((qh[j] >> (2 * k)) & 3) << 4);
      out[j] = (q - 32) * (d * sc[j / 16]);
    }
    return;
  }
  int sc, m;
  KScaleMin(blk + 4, g, &sc, &m);
  const float dsc = HalfToFloat(LoadU16(blk)) * sc, dm = HalfToFloat(LoadU16(blk + 2)) * m;
  const uint8_t* qh = blk + 16;  // Q5_K's fifth bits
  const uint8_t* qs = blk + (qtype == kQ5_K ? 48 : 16) + 32 * (g / 2);
  for (int j = 0; j < kBlock; ++j) {
    int q = (qs[j] >> (4 * (g % 2))) & 0x0f;
    if (qtype == kQ5_K) q |= ((qh[j] >> g) & 1) << 4;
    out[j] = q * dsc - dm;
  }
}

}  // namespace

void DequantRow(int qtype, const uint8_t* row, int64_t cols, float* out) {
  switch (qtype) {
    case kF32: std::memcpy(out, row, cols * 4); return;
    case kF16:
      for (int64_t j = 0; j < cols; ++j) out[j] = HalfToFloat(LoadU16(row + 2 * j));
      return;
    case kBF16:
      for (int64_t j = 0; j < cols; ++j) out[j] = BF16ToFloat(LoadU16(row + 2 * j));
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
    case kQ5_0:
    case kQ5_1: {
      const bool q51 = qtype == kQ5_1;
      for (int64_t b = 0; b < cols / kBlock; ++b, row += q51 ? 24 : 22, out += kBlock) {
        const float d = HalfToFloat(LoadU16(row)), m = q51 ? HalfToFloat(LoadU16(row + 2)) : 0.f;
        const uint32_t qh = LoadU32(row + (q51 ? 4 : 2));
        const uint8_t* qs = row + (q51 ? 8 : 6);
        for (int j = 0; j < kBlock; ++j) {
          const int q = ((qs[j % 16] >> (j < 16 ? 0 : 4)) & 0x0f) | (((qh >> j) & 1) << 4);
          out[j] = q51 ? q * d + m : (q - 16) * d;
        }
      }
      return;
    }
    case kQ4_K:
    case kQ5_K:
    case kQ6_K:
      for (int64_t b = 0; b < cols / 256; ++b, row += BlockBytesOf(qtype))
        for (int g = 0; g < 8; ++g, out += kBlock) KGroupPortable(qtype, row, g, out);
      return;
  }
}

namespace {

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

}  // namespace

void RowsPortable(int qtype, const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x,
                  int64_t N, float* y, int64_t M, int64_t m0, int64_t m1) {
  std::unique_ptr<float[]> scratch(new float[cols]);
  for (int64_t m = m0; m < m1; ++m) {
    PrefetchRow(w + m * row_bytes, row_bytes, w + m1 * row_bytes);
    DotRowPortable(qtype, w + m * row_bytes, cols, x, N, y + m, M, scratch.get());
  }
}

}  // namespace packed
}  // namespace tfnb
