#include "backend/cgx_work.h"

#include <ATen/core/ivalue.h>
#include <c10/core/StreamGuard.h>

#include "backend/callback_threads.h"

namespace cgx::backend {

CGXWork::CGXWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs,
                 std::vector<c10::Device> devices)
    : c10d::Work(rank, op_type),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()), std::move(devices))) {}

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

c10::intrusive_ptr<c10::ivalue::Future> CGXWork::getFuture() {
  std::lock_guard<std::mutex> lock(future_mutex_);
  future_taken_ = true;
  return future_;
}

void CGXWork::settle_async(c10::intrusive_ptr<CGXWork> work, std::exception_ptr error,
                           std::optional<c10::Stream> stream, std::function<void()> then) {
  {
    // Under the lock, a getFuture() waits for the settling and gets a completed future.
    std::unique_lock<std::mutex> lock(work->future_mutex_);
    if (!work->future_taken_) {
      {
        const c10::OptionalStreamGuard guard(stream);
        work->settle(error);
      }
      lock.unlock();
      if (then) then();
      return;
    }
  }
  run_on_callback_thread([work = std::move(work), error, stream, then = std::move(then)] {
    {
      const c10::OptionalStreamGuard guard(stream);
      work->settle(error);
    }
    if (then) then();
  });
}

bool CGXWork::wait(std::chrono::milliseconds timeout) {
  const bool done = c10d::Work::wait(timeout);  // throws the collective's error
  // On a GPU the caller's stream waits for the one the future recorded.
  if (!future_->devices().empty()) future_->wait();
  return done;
}

}  // namespace cgx::backend
