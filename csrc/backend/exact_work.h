// The Work of a call cgx hands to its exact backend (Gloo; NCCL reports its own), with
// that backend's failures reported as every other path reports them: a lost peer as
// PeerError, a wait past the timeout as CollectiveTimeoutError (errors.h). Gloo raises a
// plain error naming the socket ("Connection closed by peer"), at the call or at its wait;
// ProcessGroupCGX::exact_call wraps the call, this its wait and its future. Such a failure
// also fails the group (GroupFailure), as a failed compressed call does.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <mutex>

#include "backend/errors.h"

namespace cgx::backend {

class ExactWork final : public c10d::Work {
 public:
  ExactWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<GroupFailure> group);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;
  void blockCurrentStream() override;
  void abort() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override;
  float getDuration() const override;
  uint64_t getSequencenumber() const override;

 private:
  // The inner Work while it runs; null once a wait saw it end. Gloo's Work holds the
  // group's connections (its context) while it lives: a handle the caller keeps after the
  // wait must not keep them open once the group shut down (peers learn of a shut-down
  // rank from its connections closing). What it answers is kept instead: asked once, at
  // the release, only where Gloo's Work of that kind answers (its collectives have results
  // and a future, a receive has a source rank; none measures a duration). The rest answer
  // as c10d's Work does, which is what Gloo's did. So no query raises on a call's path.
  c10::intrusive_ptr<c10d::Work> running() const;
  void keep_outcome_and_release(const c10::intrusive_ptr<c10d::Work>& inner, std::exception_ptr error);
  bool point_to_point() const;

  mutable std::mutex mutex_;
  c10::intrusive_ptr<c10d::Work> inner_;
  std::shared_ptr<GroupFailure> group_;
  std::exception_ptr error_;  // the call's failure, reported as the backend reports failures
  struct Kept {
    std::vector<at::Tensor> result;
    c10::intrusive_ptr<c10::ivalue::Future> future;  // Gloo's
    int source_rank = -1;
    uint64_t sequence = 0;
    std::exception_ptr no_result, no_future, no_sequence;  // what asking raised
  } kept_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // the inner one's, its error reported
};

}  // namespace cgx::backend
