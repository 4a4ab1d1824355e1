// tfnb's packed-weight ops: TfnbPackedMatMul (y = x @ dequantize(w).T for GGUF rows kept
// packed, never materialising the float matrix) and TfnbPackedDequantize (rows into float32),
// as TF kernels and as XLA custom calls, and the choice of kernel code for this CPU. The
// arithmetic lives in one file per instruction set (packed_common.h lists them), so this file
// is the only one of them that includes TensorFlow. docs/kernels.md describes the whole.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
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

#include "packed_common.h"
#include "xla_host.h"

namespace tfnb {
namespace packed {

// ---- which code runs ---------------------------------------------------------------------

namespace {

// $TFNB_PACKED_ISA (read once) caps the code this CPU runs: "avx2" keeps an AVX-512 CPU on
// the AVX2 code, "portable" (or $TFNB_PACKED_PORTABLE=1) runs the portable code on any CPU.
// Tests compare each with the best code the CPU has.
bool IsaCapped(const char* cap) {
  static const char* isa = std::getenv("TFNB_PACKED_ISA");
  return isa != nullptr && std::strcmp(isa, cap) == 0;
}

}  // namespace

bool HaveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c") && !std::getenv("TFNB_PACKED_PORTABLE")
                           && !IsaCapped("portable");
  return have;
}

bool HaveAvx512() {
  static const bool have = HaveAvx2() && __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && !IsaCapped("avx2") &&
                           !IsaCapped("avxvnni");
  return have;
}

namespace {

// The int8 route's dot instruction on this CPU, or -1 for the portable code:
// $TFNB_PACKED_ISA=avx2 caps it at maddubs, =avxvnni at AVX-VNNI (what a CPU with AVX2 and
// AVX-VNNI but no AVX-512 runs).
int Int8DotKind() {
#ifdef TFNB_X86
  static const int kind = !HaveAvx2() ? -1
      : HaveAvx512() && __builtin_cpu_supports("avx512vnni") ? kInt8Vnni512
      : !IsaCapped("avx2") && __builtin_cpu_supports("avxvnni") ? kInt8AvxVnni
      : kInt8Maddubs;
  return kind;
#else
  return -1;
#endif
}

}  // namespace

namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;

void RowsQ8(int qtype, const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, float* y,
            int64_t M, int64_t m0, int64_t m1) {
#ifdef TFNB_X86
#define TFNB_INT8_CASES(DOT)                                                  \
  switch (qtype) {                                                            \
    case kQ4_0: return RowsQ8X86<kQ4_0, DOT>(w, row_bytes, xq, y, M, m0, m1); \
    case kQ4_1: return RowsQ8X86<kQ4_1, DOT>(w, row_bytes, xq, y, M, m0, m1); \
    case kQ8_0: return RowsQ8X86<kQ8_0, DOT>(w, row_bytes, xq, y, M, m0, m1); \
  }
  switch (Int8DotKind()) {
    case kInt8Vnni512: TFNB_INT8_CASES(kInt8Vnni512) break;
    case kInt8AvxVnni: TFNB_INT8_CASES(kInt8AvxVnni) break;
    case kInt8Maddubs: TFNB_INT8_CASES(kInt8Maddubs) break;
  }
#undef TFNB_INT8_CASES
#endif
  RowsQ8Portable(qtype, w, row_bytes, xq, y, M, m0, m1);
}

// The int8 route's weight types; the others (float, Q5, K-quants) stay on the float route.
bool TakesInt8(int qtype) { return IsLegacyBlock(qtype); }

// y[:, m0:m1] for x [N, cols] and packed w [M, row_bytes]; y is [N, M]. The AVX-512 code takes
// every block type and float rows of a multiple of 16 values, the AVX2 code rows of a multiple
// of 8; the portable code takes any width.
void Rows(int qtype, const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x,
          int64_t N, float* y, int64_t M, int64_t m0, int64_t m1) {
#ifdef TFNB_X86
#define TFNB_CASES(ROWS)                                                                \
  switch (qtype) {                                                                      \
    case kF32: return ROWS<kF32>(w, row_bytes, cols, x, N, y, M, m0, m1);               \
    case kF16: return ROWS<kF16>(w, row_bytes, cols, x, N, y, M, m0, m1);               \
    case kBF16: return ROWS<kBF16>(w, row_bytes, cols, x, N, y, M, m0, m1);             \
    case kQ4_0: return ROWS<kQ4_0>(w, row_bytes, cols, x, N, y, M, m0, m1);             \
    case kQ4_1: return ROWS<kQ4_1>(w, row_bytes, cols, x, N, y, M, m0, m1);             \
    case kQ5_0: return ROWS<kQ5_0>(w, row_bytes, cols, x, N, y, M, m0, m1);             \
    case kQ5_1: return ROWS<kQ5_1>(w, row_bytes, cols, x, N, y, M, m0, m1);             \
    case kQ8_0: return ROWS<kQ8_0>(w, row_bytes, cols, x, N, y, M, m0, m1);             \
    case kQ4_K: return ROWS<kQ4_K>(w, row_bytes, cols, x, N, y, M, m0, m1);             \
    case kQ5_K: return ROWS<kQ5_K>(w, row_bytes, cols, x, N, y, M, m0, m1);             \
    case kQ6_K: return ROWS<kQ6_K>(w, row_bytes, cols, x, N, y, M, m0, m1);             \
  }
  if (HaveAvx512() && (!IsFloatType(qtype) || cols % 16 == 0)) TFNB_CASES(RowsAvx512)
  if (HaveAvx2() && cols % 8 == 0) TFNB_CASES(RowsAvx2)
#undef TFNB_CASES
#endif
  RowsPortable(qtype, w, row_bytes, cols, x, N, y, M, m0, m1);
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
                           " columns is not supported (expected F32 0, F16 1, Q4_0 2, Q4_1 3, "
                           "Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14 or BF16 30, and a "
                           "multiple of 32 columns for the block types, 256 for the K-quants)");
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

// The int8 route's dot instruction on this CPU: "vnni512", "avxvnni", "avx2" (maddubs) or
// "portable" (tfnb.kernels.int8_isa()).
extern "C" const char* tfnb_int8_isa() {
  switch (Int8DotKind()) {
#ifdef TFNB_X86
    case kInt8Vnni512: return "vnni512";
    case kInt8AvxVnni: return "avxvnni";
    case kInt8Maddubs: return "avx2";
#endif
    default: return "portable";
  }
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

}  // namespace packed
}  // namespace tfnb
