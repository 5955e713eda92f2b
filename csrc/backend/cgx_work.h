// The Work handed back for a collective that cgx completes itself. Its future completes
// with the output tensors (DDP and comm hooks read it) or with the error.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace cgx::backend {

class CGXWork final : public c10d::Work {
 public:
  CGXWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs);

  // Completes the future first (running its callbacks), then the Work, so that once
  // wait() returns the future is done too. `error` null means success.
  void settle(std::exception_ptr error);
  // The same on torch's inter-op thread pool: future callbacks may then start, or wait
  // for, collectives of the group without blocking the group's worker thread.
  static void settle_async(c10::intrusive_ptr<CGXWork> work, std::exception_ptr error);

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace cgx::backend
