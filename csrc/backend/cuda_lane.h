// The CUDA side of a group's compressed calls.
//
// A call on CUDA tensors runs on the group's own stream of the group's device (one device
// per rank and group, fixed by the group's first CUDA call; a stream of cgx's own, not
// one of torch's pool that others share), after the work its caller had
// queued on the current stream when it made the call (an event, never a device-wide
// sync). The caller's stream waits for the result in Work::wait() or when it reads the
// Work's future, which records where the group's stream was when the call finished. The tensors are recorded as used on
// the group's stream, so the caching allocator cannot give their memory to another stream
// while the call still writes it. The cross-host phases of a pipelined hierarchical
// allreduce get a second stream. Compressed bytes move through pinned host memory.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "collectives/allreduce.h"
#include "compression/executor.h"

namespace cgx::backend {

// Where a compressed call's values are processed, and its compressed bytes kept.
struct Lane {
  compression::Executor* executor;        // the calling (worker) thread's
  compression::Executor* cross_executor;  // the hierarchical cross phases'
  collectives::Scratch* scratch;
  collectives::Scratch* cross_scratch;
};

// A call admitted to the lane: the point on its caller's stream it must follow.
struct CudaTicket;

class CudaLane {
 public:
  CudaLane();
  ~CudaLane();

  // Caller's thread, when the call is queued. Throws c10::Error naming the problem for
  // tensors on several devices, on another device than the group's, or in a build
  // without CUDA.
  std::shared_ptr<CudaTicket> admit(const std::vector<at::Tensor>& tensors);
  // Worker thread: runs `fn` with the group's device and stream current, ordered after
  // the ticket's point.
  void run(CudaTicket& ticket, const std::function<void(const Lane&)>& fn);
  // Worker thread, after run(): a stream whose work so far ends where the group's stream
  // is now (an event). A call's future is settled on it, so that its waiters wait for
  // this call and not for the calls queued after it.
  c10::Stream finished();

 private:
  struct State;
  mutable std::mutex mutex_;  // admit() (callers' threads) creates the state once
  std::unique_ptr<State> state_;
};

}  // namespace cgx::backend
