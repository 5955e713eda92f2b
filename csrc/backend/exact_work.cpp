#include "backend/exact_work.h"

#include "backend/errors.h"

namespace cgx::backend {

ExactWork::ExactWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<GroupFailure> group)
    : c10d::Work(-1, inner->retrieveOpType()), inner_(std::move(inner)), group_(std::move(group)) {}

c10::intrusive_ptr<c10d::Work> ExactWork::running() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return inner_;
}

c10::intrusive_ptr<c10::ivalue::Future> ExactWork::future_of(c10d::Work& inner) {
  if (!future_.value && !future_.error) {
    future_ = ask([&] {
      auto future = inner.getFuture();
      return future->then(
          [group = group_](c10::ivalue::Future& done) -> c10::IValue {
            if (done.hasError()) std::rethrow_exception(exact_failure(done.exception_ptr(), *group));
            return done.value();
          },
          future->elementType());
    });
  }
  return future_.get();
}

void ExactWork::keep_outcome_and_release(const c10::intrusive_ptr<c10d::Work>& inner, std::exception_ptr error) {
  auto result = ask([&] { return inner->result(); });
  auto source_rank = ask([&] { return inner->sourceRank(); });
  auto duration = ask([&] { return inner->getDuration(); });
  auto sequence = ask([&] { return inner->getSequencenumber(); });
  std::lock_guard<std::mutex> lock(mutex_);
  if (!inner_) return;
  // Asked here, while the inner Work lives: a future asked after the wait is this one
  // (or what asking raised, raised again then).
  try {
    future_of(*inner);
  } catch (const std::exception&) {
  }
  error_ = error;
  result_ = std::move(result);
  source_rank_ = source_rank;
  duration_ = duration;
  sequence_ = sequence;
  inner_.reset();
}

bool ExactWork::isCompleted() {
  auto inner = running();
  return !inner || inner->isCompleted();
}

bool ExactWork::isSuccess() const {
  auto inner = running();
  if (inner) return inner->isSuccess();
  std::lock_guard<std::mutex> lock(mutex_);
  return !error_;
}

std::exception_ptr ExactWork::exception() const {
  auto inner = running();
  if (!inner) {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }
  const std::exception_ptr error = inner->exception();
  return error ? exact_failure(error, *group_) : error;
}

int ExactWork::sourceRank() const {
  auto inner = running();
  if (inner) return inner->sourceRank();
  std::lock_guard<std::mutex> lock(mutex_);
  return source_rank_.get();
}

std::vector<at::Tensor> ExactWork::result() {
  auto inner = running();
  if (inner) return inner->result();
  std::lock_guard<std::mutex> lock(mutex_);
  return result_.get();
}

float ExactWork::getDuration() const {
  auto inner = running();
  if (inner) return inner->getDuration();
  std::lock_guard<std::mutex> lock(mutex_);
  return duration_.get();
}

uint64_t ExactWork::getSequencenumber() const {
  auto inner = running();
  if (inner) return inner->getSequencenumber();
  std::lock_guard<std::mutex> lock(mutex_);
  return sequence_.get();
}

void ExactWork::synchronize() {
  if (auto inner = running()) inner->synchronize();
}

void ExactWork::blockCurrentStream() {
  if (auto inner = running()) inner->blockCurrentStream();
}

void ExactWork::abort() {
  if (auto inner = running()) inner->abort();
}

bool ExactWork::wait(std::chrono::milliseconds timeout) {
  auto inner = running();
  if (!inner) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  bool done = false;
  try {
    done = inner->wait(timeout);
  } catch (...) {
    const std::exception_ptr raised = std::current_exception();
    const std::exception_ptr error = exact_failure(raised, *group_);
    if (error != raised) {
      keep_outcome_and_release(inner, error);  // Gloo's own failure ends the call
    } else if (inner->isCompleted()) {
      // A caller's shorter wait (c10d's "Operation timed out!") is not the call's
      // outcome, even where the call completed just after it: keep the call's own.
      const std::exception_ptr own = inner->exception();
      keep_outcome_and_release(inner, own ? exact_failure(own, *group_) : nullptr);
    }
    std::rethrow_exception(error);
  }
  if (inner->isCompleted()) keep_outcome_and_release(inner, nullptr);
  return done;
}

c10::intrusive_ptr<c10::ivalue::Future> ExactWork::getFuture() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (inner_) return future_of(*inner_);
  return future_.get();  // asked at the release: as the inner Work answered then
}

c10::intrusive_ptr<c10::ivalue::Future> ExactWork::getFutureResult() {
  if (auto inner = running()) return inner->getFutureResult();
  return c10d::Work::getFutureResult();  // after the wait: as a Work that does not track it
}

}  // namespace cgx::backend
