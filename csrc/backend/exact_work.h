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

  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override;
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;
  void blockCurrentStream() override { inner_->blockCurrentStream(); }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override { return inner_->getFutureResult(); }
  float getDuration() const override { return inner_->getDuration(); }
  uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::shared_ptr<GroupFailure> group_;
  std::mutex future_mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // the inner one's, its error reported
};

}  // namespace cgx::backend
