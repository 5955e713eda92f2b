// Transport over a wrapped torch backend (Gloo on CPU): uint8 tensors through its
// point-to-point send/recv. It knows c10d, so it lives with the backend. Used for peers on other hosts (or all peers with
// CGX_INNER_COMMUNICATOR_TYPE=GLOO), or across hosts with
// CGX_CROSS_COMMUNICATOR_TYPE=GLOO.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <vector>

#include "transport/transport.h"

namespace cgx::backend {

// The tags of the wrapped backend's send/recv are split: below kFirstCgxTag for the
// user's own send/recv on the group, from it up for this transport.
constexpr int kFirstCgxTag = 1 << 30;


class C10dTransport final : public transport::Transport {
 public:
  // `reachable[p]`: whether this transport is used for group rank p.
  C10dTransport(c10::intrusive_ptr<c10d::Backend> backend, int rank, std::vector<bool> reachable);

  std::unique_ptr<transport::Pending> post(const std::vector<transport::Send>& sends,
                                           const std::vector<transport::Recv>& recvs) override;
  void wait(transport::Pending& pending, transport::Clock::time_point deadline) override;
  bool reaches(int peer) const override;

 private:
  int next_tag(std::vector<uint32_t>& counters, int peer);

  c10::intrusive_ptr<c10d::Backend> backend_;
  int rank_;
  std::vector<bool> reachable_;
  // Messages between two ranks are matched by a per-pair, per-direction counter, so they
  // arrive in posting order whatever else runs on the backend.
  std::vector<uint32_t> sent_;
  std::vector<uint32_t> received_;
};

}  // namespace cgx::backend
