// What tfnb's XLA custom calls share (packed_op.cc, attention.cc): running a loop on XLA's own
// thread pool, row-major shapes for a custom call's operands and result, and registering an
// op's XLA kernel after TF has made its own.
#ifndef TFNB_KERNELS_XLA_HOST_H_
#define TFNB_KERNELS_XLA_HOST_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "xla/ffi/api/ffi.h"
#include "xla/shape_util.h"

namespace tfnb {
namespace xla_host {

// fn(m0, m1) over [0, M) on XLA's own intra-op pool, the calling thread taking a share.
// (A pool of our own beside XLA's made a 2-core worker slower than a 1-core one: the two pools'
// threads competed for the cores on every one of the ~120 calls per token.)
// The caller is often a thread of that same pool (XLA runs the next thunks on the thread that
// finished the last parallel loop), so it must never wait for a shard that no thread has taken:
// with two computations at once on a 2-thread pool (two lanes of a split on one worker), both
// threads waited for shards queued behind themselves and spun for ever. So every thread, the
// caller included, claims shards from one counter until none is left, and the caller then waits
// only for shards that other threads are running. A task that starts after that finds nothing
// to claim; it holds the counters by shared_ptr and never touches fn.
struct ShardCounters {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename Fn>
void ParallelRows(xla::ffi::ThreadPool& pool, int64_t M, int64_t cost_per_row, const Fn& fn) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t shards = std::min<int64_t>(threads, M);
  if (shards <= 1 || M * cost_per_row < 200000) {
    fn(0, M);
    return;
  }
  auto counters = std::make_shared<ShardCounters>();
  const Fn* body = &fn;
  auto work = [counters, body, M, shards] {
    for (int64_t s; (s = counters->next.fetch_add(1, std::memory_order_acq_rel)) < shards;) {
      (*body)(M * s / shards, M * (s + 1) / shards);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t s = 1; s < shards; ++s) pool.Schedule(decltype(work)(work));  // a copy each
  work();
  while (counters->done.load(std::memory_order_acquire) < shards) std::this_thread::yield();
}

inline xla::Shape RowMajor(xla::PrimitiveType type, std::vector<int64_t> dims) {
  return xla::ShapeUtil::MakeShapeWithDescendingLayout(type, dims);
}

template <typename K>
tensorflow::OpKernel* Create(tensorflow::OpKernelConstruction* ctx) { return new K(ctx); }

// TF turns the XLA registrations (REGISTER_XLA_OP) into kernels of the XLA_CPU_JIT device once
// per process. If that has not happened yet, the first call below does it (ours included); if
// it has, op's was missed and is registered here, as kernel K. This cannot run while the
// library loads (TF registers a library's ops only after its static initializers):
// tfnb_register_xla_kernels (packed_op.cc), which tfnb.kernels calls right after loading,
// does.
template <typename K>
void RegisterXlaKernelLate(const char* op, const char* kernel) {
  tensorflow::XlaOpRegistry::RegisterCompilationKernels();
  if (tensorflow::KernelsRegisteredForOp(op).find("XLA_CPU_JIT") != std::string::npos) return;
  new tensorflow::kernel_factory::OpKernelRegistrar(
      tensorflow::register_kernel::Name(op).Device(tensorflow::DEVICE_CPU_XLA_JIT).Build(),
      kernel, &Create<K>);
}

}  // namespace xla_host

namespace attention {
void RegisterXlaKernelLate();  // attention.cc's, called by tfnb_register_xla_kernels
}  // namespace attention
}  // namespace tfnb

#endif  // TFNB_KERNELS_XLA_HOST_H_
