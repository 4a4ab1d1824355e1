// tfnb's decode attention: one new token per row attends the KV caches where they lie.
//
// Inside an XLA segment, attention over a window of the cache variables needs the window as a
// tensor of its own: XLA gathers (or slices) B x K x S x E floats out of every cache, every
// layer, every step, then multiplies. This op reads the visible slots of each row in place
// instead, from the cache buffers XLA has just updated, and skips the masked ones.
//
// q [B, H, E] float32 (rotated), caches [Bc, K, Smax, E] float32 (Bc >= B: the first B rows
// are the batch), pad [B] int32, slot int32; attribute window (S <= Smax). Row b's query head h
// reads KV head h / (H / K) over slots pad[b] <= s <= min(slot, S - 1); the result is
// [B, H * E] (heads in order). A row that sees no slot gets zeros.
//
// Where the CPU has AVX-512 and a head is 64 or 128 values wide, one row and KV head keeps its
// query and output vectors in registers and reads each key and value once. Other shapes and
// CPUs run portable loops written so that the compiler vectorizes them without reassociating
// a float sum (partial sums in a 16-lane array), built for AVX-512, AVX2 and the baseline
// behind one function the dynamic loader picks (GCC's target_clones).
//
// Without the gather, a step's attention streams the keys and values about as fast as one core
// reads memory, where the gathered window cost about as much again (docs/kernels.md).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "xla/ffi/api/ffi.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/shape_util.h"

#include "xla_host.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tfnb {
namespace attention {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;

constexpr int kLanes = 16;

struct Dims {
  int64_t B, H, K, E, Smax, S;
};

// exp(x) for x <= 0 (a score minus its row's maximum), to about 2 ulp: Cephes' expf
// polynomial on x - n ln2, scaled by 2^n through the exponent bits. Branch-free, so a loop
// of it vectorizes.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const int n = static_cast<int>(t - 0.5f);  // nearest integer, t <= 0
  const float fn = static_cast<float>(n);
  float r = x - fn * 0.693359375f;
  r = r + fn * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// scores[g * n + s] (G rows of n) turned into softmax probabilities, row by row.
inline void Softmax(float* scores, int64_t G, int64_t n) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    float top = sg[0];
    for (int64_t s = 1; s < n; ++s) top = std::max(top, sg[s]);
    for (int64_t s = 0; s < n; ++s) sg[s] = ExpNonPositive(sg[s] - top);  // vectorized
    float total = 0.0f;
    for (int64_t s = 0; s < n; ++s) total += sg[s];
    const float inv = 1.0f / total;
    for (int64_t s = 0; s < n; ++s) sg[s] *= inv;
  }
}

// Where unit u = b * K + k works: its G query and output heads of E values, and the first
// key and value of the n slots its row attends (pad[b] <= s <= slot). With none, the output
// is zeros and n = 0.
struct Unit {
  const float* q;
  float* out;
  const float* k;
  const float* v;
  int64_t n;
};

inline Unit Locate(const float* q, const float* kc, const float* vc, const int32_t* pad,
                   int32_t slot, const Dims& d, int64_t u, int64_t G, int64_t E, float* out) {
  const int64_t b = u / d.K, k = u % d.K;
  const int64_t lo = std::max<int64_t>(0, pad[b]);
  const int64_t hi = std::min<int64_t>(slot, d.S - 1) + 1;
  const int64_t first = ((b * d.K + k) * d.Smax + lo) * E;
  Unit unit{q + (b * d.H + k * G) * E, out + (b * d.H + k * G) * E, kc, vc,
            std::max<int64_t>(0, hi - lo)};
  if (unit.n == 0) {
    std::fill(unit.out, unit.out + G * E, 0.0f);
  } else {
    unit.k += first;
    unit.v += first;
  }
  return unit;
}

// One row and KV head (unit u = b * K + k) in portable loops: see the top of the file.
__attribute__((target_clones("avx512f", "arch=haswell", "default")))
void AttendUnit(const float* q, const float* kc, const float* vc, const int32_t* pad,
                int32_t slot, const Dims& d, int64_t u, float* scores, float* out) {
  const int64_t G = d.H / d.K, E = d.E, E16 = E / kLanes * kLanes;
  const float scale = 1.0f / std::sqrt(static_cast<float>(E));
  const Unit unit = Locate(q, kc, vc, pad, slot, d, u, G, E, out);
  const int64_t n = unit.n;
  if (n == 0) return;
  const float *qg = unit.q, *kr = unit.k, *vr = unit.v;
  float* og = unit.out;
  std::fill(og, og + G * E, 0.0f);
  for (int64_t s = 0; s < n; ++s, kr += E) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qv = qg + g * E;
      float acc[kLanes] = {};
      for (int64_t e = 0; e < E16; e += kLanes)
        for (int j = 0; j < kLanes; ++j) acc[j] += qv[e + j] * kr[e + j];
      for (int64_t e = E16; e < E; ++e) acc[e - E16] += qv[e] * kr[e];
      for (int w = kLanes / 2; w > 0; w /= 2)
        for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
      scores[g * n + s] = acc[0] * scale;
    }
  }
  Softmax(scores, G, n);
  for (int64_t s = 0; s < n; ++s, vr += E)
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + s];
      float* o = og + g * E;
      for (int64_t e = 0; e < E; ++e) o[e] += p * vr[e];
    }
}

#if defined(__x86_64__)
#define TFNB_ATTN512 __attribute__((target("avx512f,avx2,fma")))

// The same for G query heads per KV head and heads of C x 16 values, with the G x C query
// and output vectors in registers: one pass over the keys, one over the values.
template <int G, int C>
TFNB_ATTN512 void AttendUnitAvx512(const float* q, const float* kc, const float* vc,
                                   const int32_t* pad, int32_t slot, const Dims& d, int64_t u,
                                   float* scores, float* out) {
  constexpr int E = C * 16;
  const float scale = 1.0f / std::sqrt(static_cast<float>(E));
  const Unit unit = Locate(q, kc, vc, pad, slot, d, u, G, E, out);
  const int64_t n = unit.n;
  if (n == 0) return;
  const float *qg = unit.q, *kr = unit.k, *vr = unit.v;
  float* og = unit.out;
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_loadu_ps(qg + g * E + c * 16);
  for (int64_t s = 0; s < n; ++s, kr += E) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) {
      const __m512 kv = _mm512_loadu_ps(kr + c * 16);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(qv[g][c], kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) scores[g * n + s] = _mm512_reduce_add_ps(acc[g]) * scale;
  }
  Softmax(scores, G, n);
  __m512 o[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) o[g][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; ++s, vr += E) {
    __m512 p[G];
    for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(scores[g * n + s]);
    for (int c = 0; c < C; ++c) {
      const __m512 vv = _mm512_loadu_ps(vr + c * 16);
      for (int g = 0; g < G; ++g) o[g][c] = _mm512_fmadd_ps(p[g], vv, o[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(og + g * E + c * 16, o[g][c]);
}

using UnitFn = void (*)(const float*, const float*, const float*, const int32_t*, int32_t,
                        const Dims&, int64_t, float*, float*);

// The register-resident version for this shape on this CPU, or null.
UnitFn Avx512Unit(int64_t G, int64_t E) {
  static const bool have = __builtin_cpu_supports("avx512f");
  if (!have) return nullptr;
  switch (E == 64 ? G : E == 128 ? 10 + G : 0) {
    case 1: return AttendUnitAvx512<1, 4>;
    case 2: return AttendUnitAvx512<2, 4>;
    case 3: return AttendUnitAvx512<3, 4>;
    case 4: return AttendUnitAvx512<4, 4>;
    case 11: return AttendUnitAvx512<1, 8>;
    case 12: return AttendUnitAvx512<2, 8>;
    default: return nullptr;
  }
}
#endif

// Rows and KV heads [u0, u1) of the batch (unit u = b * K + k).
void AttendUnits(const float* q, const float* kc, const float* vc, const int32_t* pad,
                 int32_t slot, Dims d, int64_t u0, int64_t u1, float* out) {
  const int64_t G = d.H / d.K;
  std::vector<float> scores(G * d.S);
#if defined(__x86_64__)
  if (UnitFn fn = Avx512Unit(G, d.E)) {
    for (int64_t u = u0; u < u1; ++u) fn(q, kc, vc, pad, slot, d, u, scores.data(), out);
    return;
  }
#endif
  for (int64_t u = u0; u < u1; ++u) AttendUnit(q, kc, vc, pad, slot, d, u, scores.data(), out);
}

// ---- outside XLA: a TensorFlow op --------------------------------------------------------

tensorflow::Status CheckDims(const TensorShape& q, const TensorShape& kc, const TensorShape& vc,
                             const TensorShape& pad, int64_t window, Dims* d) {
  if (q.dims() != 3 || kc.dims() != 4 || kc != vc || pad.dims() != 1 ||
      pad.dim_size(0) != q.dim_size(0) || kc.dim_size(0) < q.dim_size(0) ||
      kc.dim_size(3) != q.dim_size(2) || kc.dim_size(1) < 1 ||
      q.dim_size(1) % kc.dim_size(1) != 0 || window < 1 || window > kc.dim_size(2))
    return InvalidArgument("TfnbDecodeAttention: q ", q.DebugString(), ", caches ",
                           kc.DebugString(), " and ", vc.DebugString(), ", pad ",
                           pad.DebugString(), ", window ", window,
                           ": expected q [B, H, E], caches [>=B, K, S, E] with K dividing H, "
                           "pad [B] and 1 <= window <= S");
  *d = {q.dim_size(0), q.dim_size(1), kc.dim_size(1), q.dim_size(2), kc.dim_size(2), window};
  return tensorflow::OkStatus();
}

class DecodeAttentionOp : public OpKernel {
 public:
  explicit DecodeAttentionOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("window", &window_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor &q = ctx->input(0), &kc = ctx->input(1), &vc = ctx->input(2);
    const Tensor &pad = ctx->input(3), &slot = ctx->input(4);
    Dims d;
    OP_REQUIRES_OK(ctx, CheckDims(q.shape(), kc.shape(), vc.shape(), pad.shape(), window_, &d));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({d.B, d.H * d.E}), &y));
    const float *qp = q.flat<float>().data(), *kp = kc.flat<float>().data(),
                *vp = vc.flat<float>().data();
    const int32_t* pp = pad.flat<int32_t>().data();
    const int32_t s = slot.scalar<int32_t>()();
    float* yp = y->flat<float>().data();
    const auto& threads = *ctx->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(
        threads.num_threads, threads.workers, d.B * d.K, d.H / d.K * d.S * d.E * 4,
        [&](int64_t u0, int64_t u1) { AttendUnits(qp, kp, vp, pp, s, d, u0, u1, yp); });
  }

 private:
  int64_t window_;
};

// ---- inside XLA: the same loops as a custom call ---------------------------------------------

namespace ffi = xla::ffi;
using xla_host::RowMajor;

ffi::Error DecodeAttentionFfi(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> kc, ffi::Buffer<ffi::F32> vc,
                              ffi::Buffer<ffi::S32> pad, ffi::Buffer<ffi::S32> slot,
                              ffi::ResultBuffer<ffi::F32> y, int64_t window) {
  const auto qd = q.dimensions(), cd = kc.dimensions();
  const Dims d{qd[0], qd[1], cd[1], qd[2], cd[2], window};
  const float *qp = q.typed_data(), *kp = kc.typed_data(), *vp = vc.typed_data();
  const int32_t* pp = pad.typed_data();
  const int32_t s = *slot.typed_data();
  float* yp = y->typed_data();
  // the rows of the pool's split are the batch's (row, KV head) units
  xla_host::ParallelRows(
      pool, d.B * d.K, d.H / d.K * d.S * d.E * 4,
      [&](int64_t u0, int64_t u1) { AttendUnits(qp, kp, vp, pp, s, d, u0, u1, yp); });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kDecodeAttention, DecodeAttentionFfi,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::F32>>()
                           .Attr<int64_t>("window"));
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), "tfnb_decode_attention", "Host", kDecodeAttention);

std::vector<int64_t> DimsOf(const TensorShape& s) {
  std::vector<int64_t> dims;
  for (int i = 0; i < s.dims(); ++i) dims.push_back(s.dim_size(i));
  return dims;
}

class DecodeAttentionXla : public tensorflow::XlaOpKernel {
 public:
  explicit DecodeAttentionXla(OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("window", &window_));
  }
  void Compile(tensorflow::XlaOpKernelContext* ctx) override {
    const TensorShape qs = ctx->InputShape(0), ks = ctx->InputShape(1), vs = ctx->InputShape(2),
                      ps = ctx->InputShape(3);
    Dims d;
    OP_REQUIRES_OK(ctx, CheckDims(qs, ks, vs, ps, window_, &d));
    ctx->SetOutput(0, xla::CustomCallWithLayout(
        ctx->builder(), "tfnb_decode_attention",
        {ctx->Input(0), ctx->Input(1), ctx->Input(2), ctx->Input(3), ctx->Input(4)},
        RowMajor(xla::F32, {d.B, d.H * d.E}),
        {RowMajor(xla::F32, DimsOf(qs)), RowMajor(xla::F32, DimsOf(ks)),
         RowMajor(xla::F32, DimsOf(vs)), RowMajor(xla::S32, {d.B}), RowMajor(xla::S32, {})},
        "{window = " + std::to_string(window_) + " : i64}", false, {}, nullptr,
        xla::CustomCallSchedule::SCHEDULE_NONE, xla::CustomCallApiVersion::API_VERSION_TYPED_FFI));
  }

 private:
  int64_t window_;
};

void RegisterXlaKernelLate() {
  xla_host::RegisterXlaKernelLate<DecodeAttentionXla>("TfnbDecodeAttention", "DecodeAttentionXla");
}

}  // namespace attention
}  // namespace tfnb

REGISTER_XLA_OP(Name("TfnbDecodeAttention").Device(tensorflow::DEVICE_CPU_XLA_JIT),
                tfnb::attention::DecodeAttentionXla);

REGISTER_OP("TfnbDecodeAttention")
    .Input("q: float")
    .Input("k_cache: float")
    .Input("v_cache: float")
    .Input("pad: int32")
    .Input("slot: int32")
    .Attr("window: int")
    .Output("y: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      auto q = c->input(0);
      tensorflow::shape_inference::DimensionHandle he;
      TF_RETURN_IF_ERROR(c->Multiply(c->Dim(q, 1), c->Dim(q, 2), &he));
      c->set_output(0, c->Matrix(c->Dim(q, 0), he));
      return tensorflow::OkStatus();
    })
    .Doc("Attention of one new token per row (q [B, H, E]) over KV caches [>=B, K, S, E], "
         "read in place: slots pad[b] <= s <= min(slot, window - 1); y [B, H * E].");

REGISTER_KERNEL_BUILDER(Name("TfnbDecodeAttention").Device(tensorflow::DEVICE_CPU),
                        tfnb::attention::DecodeAttentionOp);
