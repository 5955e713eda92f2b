#include "backend/exact_work.h"

#include "backend/errors.h"

namespace cgx::backend {

ExactWork::ExactWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<GroupFailure> group)
    : c10d::Work(-1, inner->retrieveOpType()), inner_(std::move(inner)), group_(std::move(group)) {}

c10::intrusive_ptr<c10d::Work> ExactWork::running() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return inner_;
}

bool ExactWork::point_to_point() const {
  const auto type = retrieveOpType();
  return type == c10d::OpType::SEND || type == c10d::OpType::RECV || type == c10d::OpType::RECVANYSOURCE;
}

void ExactWork::keep_outcome_and_release(const c10::intrusive_ptr<c10d::Work>& inner, std::exception_ptr error) {
  Kept kept;
  // Each asked where Gloo's Work of this kind answers; a Work of c10d's own making (not
  // Gloo's) may still raise, and raises the same when asked after the release.
  auto ask = [](auto&& query, auto& value, std::exception_ptr& raised) {
    try {
      value = query();
    } catch (const std::exception&) {
      raised = std::current_exception();
    }
  };
  if (!point_to_point()) {
    ask([&] { return inner->result(); }, kept.result, kept.no_result);
    ask([&] { return inner->getFuture(); }, kept.future, kept.no_future);
  }
  const auto type = retrieveOpType();
  if (type == c10d::OpType::RECV || type == c10d::OpType::RECVANYSOURCE) kept.source_rank = inner->sourceRank();
  ask([&] { return inner->getSequencenumber(); }, kept.sequence, kept.no_sequence);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!inner_) return;
  error_ = error;
  kept_ = std::move(kept);
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
  const auto type = retrieveOpType();
  if (type != c10d::OpType::RECV && type != c10d::OpType::RECVANYSOURCE) return c10d::Work::sourceRank();
  std::lock_guard<std::mutex> lock(mutex_);
  return kept_.source_rank;
}

std::vector<at::Tensor> ExactWork::result() {
  auto inner = running();
  if (inner) return inner->result();
  if (point_to_point()) return c10d::Work::result();
  std::lock_guard<std::mutex> lock(mutex_);
  if (kept_.no_result) std::rethrow_exception(kept_.no_result);
  return kept_.result;
}

float ExactWork::getDuration() const {
  auto inner = running();
  return inner ? inner->getDuration() : c10d::Work::getDuration();
}

uint64_t ExactWork::getSequencenumber() const {
  auto inner = running();
  if (inner) return inner->getSequencenumber();
  std::lock_guard<std::mutex> lock(mutex_);
  if (kept_.no_sequence) std::rethrow_exception(kept_.no_sequence);
  return kept_.sequence;
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
  if (!future_) {
    c10::intrusive_ptr<c10::ivalue::Future> inner;
    if (inner_)
      inner = inner_->getFuture();  // raises where Gloo's Work has none (send, recv)
    else if (point_to_point())
      return c10d::Work::getFuture();
    else if (kept_.no_future)
      std::rethrow_exception(kept_.no_future);
    else
      inner = kept_.future;
    future_ = inner->then(
        [group = group_](c10::ivalue::Future& done) -> c10::IValue {
          if (done.hasError()) std::rethrow_exception(exact_failure(done.exception_ptr(), *group));
          return done.value();
        },
        inner->elementType());
  }
  return future_;
}

c10::intrusive_ptr<c10::ivalue::Future> ExactWork::getFutureResult() {
  if (auto inner = running()) return inner->getFutureResult();
  return c10d::Work::getFutureResult();  // after the wait: as a Work that does not track it
}

}  // namespace cgx::backend
