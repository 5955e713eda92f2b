// The Work handed back for a collective that runs on the group's worker thread. Its
// future completes with the output tensors (DDP and comm hooks read it) or the error.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace cgx::backend {

class CGXWork final : public c10d::Work {
 public:
  CGXWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs);

  void complete();
  void fail(std::exception_ptr error);

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace cgx::backend
