// Routes each peer to the transport that reaches it: the inner transport (shared memory,
// MPI or Gloo) for peers on this host, the cross transport (MPI or Gloo) for the others.
// Both progress during one exchange. Counts the bytes sent across hosts.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "transport/transport.h"

namespace cgx::transport {

class RoutedTransport final : public Transport {
 public:
  // `local` may be null (no local peers); `remote` may be null (no remote peers).
  RoutedTransport(std::unique_ptr<Transport> local, std::unique_ptr<Transport> remote);

  std::unique_ptr<Pending> post(const std::vector<Send>& sends,
                                const std::vector<Recv>& recvs) override;
  void wait(Pending& pending, Clock::time_point deadline) override;
  bool reaches(int peer) const override;

  // Bytes this rank has sent to peers on other hosts (any thread may read it).
  uint64_t cross_host_bytes() const { return cross_host_bytes_.load(); }

 private:
  std::unique_ptr<Transport> local_;
  std::unique_ptr<Transport> remote_;
  std::atomic<uint64_t> cross_host_bytes_{0};
};

}  // namespace cgx::transport
