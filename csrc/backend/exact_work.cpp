#include "backend/exact_work.h"

#include "backend/errors.h"

namespace cgx::backend {

ExactWork::ExactWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<GroupFailure> group)
    : c10d::Work(-1, inner->retrieveOpType()), inner_(std::move(inner)), group_(std::move(group)) {}

std::exception_ptr ExactWork::exception() const {
  const std::exception_ptr error = inner_->exception();
  return error ? exact_failure(error, *group_) : error;
}

bool ExactWork::wait(std::chrono::milliseconds timeout) {
  try {
    return inner_->wait(timeout);
  } catch (...) {
    std::rethrow_exception(exact_failure(std::current_exception(), *group_));
  }
}

c10::intrusive_ptr<c10::ivalue::Future> ExactWork::getFuture() {
  std::lock_guard<std::mutex> lock(future_mutex_);
  if (!future_) {
    auto inner = inner_->getFuture();
    future_ = inner->then(
        [group = group_](c10::ivalue::Future& done) -> c10::IValue {
          if (done.hasError()) std::rethrow_exception(exact_failure(done.exception_ptr(), *group));
          return done.value();
        },
        inner->elementType());
  }
  return future_;
}

}  // namespace cgx::backend
