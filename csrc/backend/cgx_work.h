// The Work handed back for a collective that cgx completes itself. Its future completes
// with the output tensors (DDP and comm hooks read it) or with the error.
#pragma once

#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <functional>
#include <mutex>
#include <optional>

namespace cgx::backend {

class CGXWork final : public c10d::Work {
 public:
  // `devices`: the GPU the outputs are on, if any. The future then records the stream
  // current where it is settled, and whoever waits for it (Work::wait, the future's wait
  // or value) has its current stream wait for that one.
  CGXWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs,
          std::vector<c10::Device> devices = {});

  // Completes the future first (running its callbacks), then the Work, so that once
  // wait() returns the future is done too. `error` null means success.
  void settle(std::exception_ptr error);
  // The same on a callback thread (callback_threads.h): future callbacks may then start,
  // or wait for, collectives of the group without blocking the group's worker thread or
  // other completions. Where nobody has taken the future yet (so no callback can be on
  // it: a plain wait()), settles on this thread instead, saving a hand-over between
  // threads (a wake-up, which a VM's idle vCPUs can take milliseconds to serve).
  // `stream`: the stream the results are complete on (current while the future is
  // settled). `then` runs once the Work is complete.
  static void settle_async(c10::intrusive_ptr<CGXWork> work, std::exception_ptr error,
                           std::optional<c10::Stream> stream = std::nullopt,
                           std::function<void()> then = {});

  // Blocks until the collective is done; on a GPU, also makes the caller's current
  // stream wait for it.
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // Whether CGX_COMPRESSION_AUTO sent the call with every value raw (set before it
  // completes): what it put on the wire is then its values in float32, not its layout's
  // compressed size.
  bool sent_exactly() const { return sent_exactly_; }
  void mark_sent_exactly() { sent_exactly_ = true; }

 private:
  std::atomic<bool> sent_exactly_{false};
  std::mutex future_mutex_;   // settle_async's choice against getFuture
  bool future_taken_ = false;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace cgx::backend
