#include "backend/exact_work.h"

#include <optional>

#include "backend/errors.h"

namespace cgx::backend {

ExactWork::ExactWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<GroupFailure> group)
    : c10d::Work(-1, inner->retrieveOpType()),
      inner_(std::move(inner)),
      group_(std::move(group)) {}

c10::intrusive_ptr<c10d::Work> ExactWork::running() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return inner_;
}

void ExactWork::keep_outcome_and_release(const c10::intrusive_ptr<c10d::Work>& inner, std::exception_ptr error) {
  std::vector<at::Tensor> result;
  if (!error) {
    try {
      result = inner->result();
    } catch (const std::exception&) {  // a Work without results (send, recv, barrier)
    }
  }
  // Gloo answers these only for some calls (a recv's source, a profiled call's duration).
  int source_rank = -1;
  float duration = -1;
  try {
    source_rank = inner->sourceRank();
  } catch (const std::exception&) {
  }
  try {
    duration = inner->getDuration();
  } catch (const std::exception&) {
  }
  std::optional<uint64_t> sequence;
  try {
    sequence = inner->getSequencenumber();
  } catch (const std::exception&) {
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!inner_) return;
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
  TORCH_CHECK(source_rank_ >= 0, "cgx: sourceRank() is known for a recv from any source only");
  return source_rank_;
}

float ExactWork::getDuration() const {
  auto inner = running();
  if (inner) return inner->getDuration();
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(duration_ >= 0, "cgx: the exact backend measured no duration for this call");
  return duration_;
}

uint64_t ExactWork::getSequencenumber() const {
  auto inner = running();
  if (inner) return inner->getSequencenumber();
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(sequence_.has_value(), "cgx: the exact backend numbered no sequence for this call");
  return *sequence_;
}

// A completed call's future, for a caller that asks for it only after its wait.
c10::intrusive_ptr<c10::ivalue::Future> ExactWork::completed_future() const {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  if (error_)
    future->setError(error_);
  else
    future->markCompleted(c10::IValue(result_));
  return future;
}

std::vector<at::Tensor> ExactWork::result() {
  auto inner = running();
  if (inner) return inner->result();
  std::lock_guard<std::mutex> lock(mutex_);
  return result_;
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
    const std::exception_ptr error = exact_failure(std::current_exception(), *group_);
    // Gloo's own failure ends the Work; a caller's shorter wait (c10d's "Operation timed
    // out!", not translated) does not: the call may still complete.
    if (error != std::current_exception() || inner->isCompleted()) keep_outcome_and_release(inner, error);
    std::rethrow_exception(error);
  }
  if (inner->isCompleted()) keep_outcome_and_release(inner, nullptr);
  return done;
}

c10::intrusive_ptr<c10::ivalue::Future> ExactWork::getFuture() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!future_ && inner_) {
    auto inner = inner_->getFuture();
    future_ = inner->then(
        [group = group_](c10::ivalue::Future& done) -> c10::IValue {
          if (done.hasError()) std::rethrow_exception(exact_failure(done.exception_ptr(), *group));
          return done.value();
        },
        inner->elementType());
  }
  if (!future_) future_ = completed_future();
  return future_;
}

c10::intrusive_ptr<c10::ivalue::Future> ExactWork::getFutureResult() {
  if (auto inner = running()) return inner->getFutureResult();
  return c10d::Work::getFutureResult();  // after the wait: as a Work that does not track it
}

}  // namespace cgx::backend
