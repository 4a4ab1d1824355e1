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
