// Transport over a wrapped torch backend (Gloo on CPU): uint8 tensors through its
// point-to-point send/recv. Used for peers on other hosts (or all peers with
// CGX_INNER_COMMUNICATOR_TYPE=GLOO).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <vector>

#include "transport/transport.h"

namespace cgx::transport {

class C10dTransport final : public Transport {
 public:
  // `reachable[p]`: whether this transport is used for group rank p.
  C10dTransport(c10::intrusive_ptr<c10d::Backend> backend, int rank, std::vector<bool> reachable);

  // The operations of one exchange, posted and not yet waited for.
  struct Posted {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
  };
  // Posts every op without waiting, so that another transport can progress meanwhile.
  Posted post(const std::vector<Send>& sends, const std::vector<Recv>& recvs);
  // Waits for every posted op (all of them, even after one fails), then throws
  // TimeoutError with the first failure.
  void wait(Posted& posted, Clock::time_point deadline);
  // wait() for a caller that is already failing: swallows the errors.
  void abandon(Posted& posted, Clock::time_point deadline) noexcept;

  void exchange(const std::vector<Send>& sends, const std::vector<Recv>& recvs,
                Clock::time_point deadline) override;
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
