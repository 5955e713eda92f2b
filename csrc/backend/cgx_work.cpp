#include "backend/cgx_work.h"

#include <ATen/Parallel.h>
#include <ATen/core/ivalue.h>

namespace cgx::backend {

CGXWork::CGXWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, op_type),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

void CGXWork::settle(std::exception_ptr error) {
  try {
    if (error)
      future_->setError(error);
    else
      future_->markCompleted(c10::IValue(outputs_));
  } catch (...) {
    // A raw callback threw: its failure belongs to whoever registered it, not to this
    // collective, which did complete.
  }
  finish(error);
}

void CGXWork::settle_async(c10::intrusive_ptr<CGXWork> work, std::exception_ptr error) {
  at::launch([work = std::move(work), error] { work->settle(error); });
}

}  // namespace cgx::backend
