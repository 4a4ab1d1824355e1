// tfnb's kernels for GGUF weights kept packed: y = x @ dequantize(w).T without ever
// materialising the float matrix, and a row dequantizer for embedding lookups.
//
// A packed matrix is a uint8 tensor [rows, row_bytes]: each row is one output channel stored
// as the GGUF file holds it (ggml blocks of 32 values for the quantized types). Types (ggml
// ids): F32 0, F16 1, Q4_0 2, Q4_1 3, Q8_0 8.
//
// The multiply dequantizes one block of 32 weights into registers and multiplies it with the
// float32 activations, so results equal the float32 path up to summation order. (Quantizing the
// activations to int8 blocks as llama.cpp does made SmolLM2's matmuls about 1.3x faster here
// but moved every output by about 0.5%; not taken.) Rows are sharded over the process's
// intra-op threads. AVX2+FMA+F16C code is chosen at run time when the CPU has it; otherwise
// portable C++ runs.

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>

#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/ffi/api/ffi.h"
#include "xla/shape_util.h"

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

// 32 unsigned nibbles of a Q4 block (16 bytes) as four vectors of 8 floats, in value order.
TFNB_AVX2 inline void Nibbles(const uint8_t* qs, __m256* q) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

// Dot products of one packed row with NN activation rows at once, so the row's bytes are
// decoded once per group. Each block's 32 weights become four vectors w = q * d + offset
// (Q4_0: offset -8d, Q4_1: m); independent accumulators keep the FMA units busy instead of
// waiting on one dependency chain (a single chain ran at a third of the speed).
constexpr int kMaxN = 4;

template <int QT, int NN>
TFNB_AVX2 void DotRowAvx2(const uint8_t* row, int64_t cols, const float* x, int64_t x_stride,
                          float* out) {
  constexpr int A = NN == 1 ? 4 : 2;  // accumulators per activation row
  __m256 acc[NN][A];
  for (int n = 0; n < NN; ++n)
    for (int a = 0; a < A; ++a) acc[n][a] = _mm256_setzero_ps();
  if (QT == kF32 || QT == kF16) {
    for (int64_t j = 0; j < cols; j += 8) {
      const __m256 w = QT == kF32
          ? _mm256_loadu_ps(reinterpret_cast<const float*>(row) + j)
          : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * j)));
      const int a = static_cast<int>((j / 8) % A);
      for (int n = 0; n < NN; ++n)
        acc[n][a] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + n * x_stride + j), acc[n][a]);
    }
  } else {
    constexpr int bytes = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;
    for (int64_t b = 0; b < cols / kBlock; ++b, row += bytes) {
      __m256 w[4];
      const float d = HalfToFloatF16C(row);
      const __m256 dv = _mm256_set1_ps(d);
      if (QT == kQ8_0) {
        for (int k = 0; k < 4; ++k)
          w[k] = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 2 + 8 * k)))));
      } else {
        Nibbles(row + (QT == kQ4_1 ? 4 : 2), w);
        const __m256 off = _mm256_set1_ps(QT == kQ4_1 ? HalfToFloatF16C(row + 2) : -8.f * d);
        for (int k = 0; k < 4; ++k) w[k] = _mm256_fmadd_ps(w[k], dv, off);
      }
      for (int n = 0; n < NN; ++n) {
        const float* xb = x + n * x_stride + b * kBlock;
        for (int k = 0; k < 4; ++k)
          acc[n][k % A] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xb + 8 * k), acc[n][k % A]);
      }
    }
  }
  for (int n = 0; n < NN; ++n) {
    __m256 s = acc[n][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[n][a]);
    out[n] = HSum(s);
  }
}

bool HaveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  return have;
}

template <int QT>
void RowsAvx2(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, int64_t N,
              float* y, int64_t M, int64_t m0, int64_t m1) {
  float out[kMaxN];
  for (int64_t m = m0; m < m1; ++m) {
    const uint8_t* row = w + m * row_bytes;
    int64_t n0 = 0;
    for (; n0 + kMaxN <= N; n0 += kMaxN) {
      DotRowAvx2<QT, kMaxN>(row, cols, x + n0 * cols, cols, out);
      for (int n = 0; n < kMaxN; ++n) y[(n0 + n) * M + m] = out[n];
    }
    for (; n0 < N; ++n0) {
      DotRowAvx2<QT, 1>(row, cols, x + n0 * cols, cols, out);
      y[n0 * M + m] = out[0];
    }
  }
}
#endif  // TFNB_X86

// y[:, m0:m1] for x [N, cols] and packed w [M, row_bytes]; y is [N, M].
void Rows(int qtype, const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x,
          int64_t N, float* y, int64_t M, int64_t m0, int64_t m1) {
#ifdef TFNB_X86
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
  for (int64_t m = m0; m < m1; ++m)
    DotRowPortable(qtype, w + m * row_bytes, cols, x, N, y + m, M, scratch.get());
}

// y = x @ dequantize(w).T, rows of w split by `parallel_for(fn)`, which calls fn(m0, m1) on
// disjoint ranges covering [0, M).
template <typename ParallelFor>
void PackedMatMul(int qtype, const uint8_t* w, int64_t rb, int64_t cols, const float* x,
                  int64_t N, float* y, int64_t M, ParallelFor&& parallel_for) {
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

class PackedMatMulOp : public OpKernel {
 public:
  explicit PackedMatMulOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("qtype", &qtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cols", &cols_));
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
    PackedMatMul(qtype, wp, row_bytes, cols, xp, N, yp, M, [&](auto&& fn) {
      tensorflow::Shard(threads.num_threads, threads.workers, M, /*cost_per_unit=*/N * cols * 2,
                        fn);
    });
  }

 private:
  int qtype_;
  int64_t cols_;
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

// fn(m0, m1) over [0, M) on XLA's own intra-op pool, the calling thread taking the first share.
// (A pool of our own beside XLA's made a 2-core worker slower than a 1-core one: the two pools'
// threads competed for the cores on every one of the ~120 calls per token.)
template <typename Fn>
void ParallelRows(ffi::ThreadPool& pool, int64_t M, int64_t cost_per_row, const Fn& fn) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t shards = std::min<int64_t>(threads, M);
  if (shards <= 1 || M * cost_per_row < 200000) {
    fn(0, M);
    return;
  }
  std::atomic<int64_t> pending(shards - 1);
  for (int64_t s = 1; s < shards; ++s) {
    pool.Schedule([&, s] {
      fn(M * s / shards, M * (s + 1) / shards);
      pending.fetch_sub(1, std::memory_order_release);
    });
  }
  fn(0, M / shards);
  while (pending.load(std::memory_order_acquire) > 0) std::this_thread::yield();
}

ffi::Error PackedMatMulFfi(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                           ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t cols) {
  const int64_t N = x.dimensions()[0], M = w.dimensions()[0];
  const int64_t rb = RowBytes(static_cast<int>(qtype), cols);
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  float* yp = y->typed_data();
  PackedMatMul(static_cast<int>(qtype), wp, rb, cols, xp, N, yp, M, [&](auto&& fn) {
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

XLA_FFI_DEFINE_HANDLER(kPackedMatMul, PackedMatMulFfi,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::U8>>()
                           .Ret<ffi::Buffer<ffi::F32>>()
                           .Attr<int64_t>("qtype")
                           .Attr<int64_t>("cols"));
XLA_FFI_DEFINE_HANDLER(kPackedDequantize, PackedDequantizeFfi,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::U8>>()
                           .Ret<ffi::Buffer<ffi::F32>>()
                           .Attr<int64_t>("qtype")
                           .Attr<int64_t>("cols"));
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), "tfnb_packed_matmul", "Host", kPackedMatMul);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), "tfnb_packed_dequantize", "Host", kPackedDequantize);

// The handlers' attributes, as XLA's typed FFI reads a custom call's backend config.
std::string Attrs(int qtype, int64_t cols) {
  return "{qtype = " + std::to_string(qtype) + " : i64, cols = " + std::to_string(cols) +
         " : i64}";
}

xla::Shape RowMajor(xla::PrimitiveType type, std::vector<int64_t> dims) {
  return xla::ShapeUtil::MakeShapeWithDescendingLayout(type, dims);
}

class PackedMatMulXla : public tensorflow::XlaOpKernel {
 public:
  explicit PackedMatMulXla(OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("qtype", &qtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cols", &cols_));
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
        ctx->builder(), "tfnb_packed_matmul", {ctx->Input(0), ctx->Input(1)},
        RowMajor(xla::F32, {N, M}), {RowMajor(xla::F32, {N, cols_}), RowMajor(xla::U8, {M, rb})},
        Attrs(qtype_, cols_), false, {}, nullptr, xla::CustomCallSchedule::SCHEDULE_NONE,
        xla::CustomCallApiVersion::API_VERSION_TYPED_FFI));
  }

 private:
  int qtype_;
  int64_t cols_;
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

// TF turns the XLA registrations into kernels of the XLA_CPU_JIT device once per process. If
// that has not happened yet, the call below does it (ours included); if it has, ours were
// missed and are registered here. This cannot run while the library loads (TF registers a
// library's ops only after its static initializers): tfnb.kernels calls it right after loading.
template <typename K>
tensorflow::OpKernel* Create(OpKernelConstruction* ctx) { return new K(ctx); }

extern "C" int tfnb_register_xla_kernels() {
  static const bool done = [] {
    tensorflow::XlaOpRegistry::RegisterCompilationKernels();
    if (tensorflow::KernelsRegisteredForOp("TfnbPackedMatMul").find("XLA_CPU_JIT") ==
        std::string::npos) {
      using tensorflow::register_kernel::Name;
      new tensorflow::kernel_factory::OpKernelRegistrar(
          Name("TfnbPackedMatMul").Device(tensorflow::DEVICE_CPU_XLA_JIT).Build(),
          "PackedMatMulXla", &Create<PackedMatMulXla>);
      new tensorflow::kernel_factory::OpKernelRegistrar(
          Name("TfnbPackedDequantize").Device(tensorflow::DEVICE_CPU_XLA_JIT).Build(),
          "PackedDequantizeXla", &Create<PackedDequantizeXla>);
    }
    return true;
  }();
  return done ? 1 : 0;
}

namespace {
}  // namespace

using tensorflow::shape_inference::InferenceContext;

REGISTER_OP("TfnbPackedMatMul")
    .Input("x: float")
    .Input("w: uint8")
    .Attr("qtype: int")
    .Attr("cols: int")
    .Output("y: float")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Matrix(c->Dim(c->input(0), 0), c->Dim(c->input(1), 0)));
      return tensorflow::OkStatus();
    })
    .Doc("y = x @ dequantize(w).T for float32 x [N, cols] and packed GGUF rows w [M, bytes].");

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
