#include "backend/cgx_work.h"

#include <ATen/core/ivalue.h>

namespace cgx::backend {

CGXWork::CGXWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, op_type),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

void CGXWork::complete() {
  finish();
  future_->markCompleted(c10::IValue(outputs_));
}

void CGXWork::fail(std::exception_ptr error) {
  finish(error);
  future_->setError(error);
}

}  // namespace cgx::backend
