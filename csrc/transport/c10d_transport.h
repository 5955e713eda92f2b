// Transport over a wrapped torch backend (Gloo on CPU): uint8 tensors through its
// point-to-point send/recv. Used for peers on other hosts (or all peers with
// CGX_INNER_COMMUNICATOR_TYPE=GLOO), or across hosts with
// CGX_CROSS_COMMUNICATOR_TYPE=GLOO.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <vector>

#include "transport/transport.h"

namespace cgx::transport {

class C10dTransport final : public AsyncTransport {
 public:
  // `reachable[p]`: whether this transport is used for group rank p.
  C10dTransport(c10::intrusive_ptr<c10d::Backend> backend, int rank, std::vector<bool> reachable);

  std::unique_ptr<Pending> post(const std::vector<Send>& sends,
                                const std::vector<Recv>& recvs) override;
  void wait(Pending& pending, Clock::time_point deadline) override;
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

}  // namespace cgx::transport
