// A view of some ranks of a group as a group of their own: rank i of the view is
// members[i] of the underlying transport. The hierarchical allreduce runs its phases on
// views (the ranks of one host; one rank of each host).
#pragma once

#include <vector>

#include "transport/transport.h"

namespace cgx::transport {

class SubsetTransport final : public Transport {
 public:
  SubsetTransport(Transport& base, std::vector<int> members)
      : base_(base), members_(std::move(members)) {}

  int size() const { return static_cast<int>(members_.size()); }

  std::unique_ptr<Pending> post(const std::vector<Send>& sends,
                                const std::vector<Recv>& recvs) override {
    std::vector<Send> mapped_sends(sends);
    std::vector<Recv> mapped_recvs(recvs);
    for (auto& s : mapped_sends) s.peer = members_.at(s.peer);
    for (auto& r : mapped_recvs) r.peer = members_.at(r.peer);
    return base_.post(mapped_sends, mapped_recvs);
  }
  void wait(Pending& pending, Clock::time_point deadline) override {
    base_.wait(pending, deadline);
  }
  bool reaches(int peer) const override {
    return peer >= 0 && peer < size() && base_.reaches(members_[peer]);
  }

 private:
  Transport& base_;
  std::vector<int> members_;
};

}  // namespace cgx::transport
