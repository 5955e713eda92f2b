// Routes each peer to the transport that reaches it: shared memory for peers on this
// host, the wrapped backend for the others. Both progress during one exchange.
#pragma once

#include <memory>

#include "transport/c10d_transport.h"

namespace cgx::transport {

class RoutedTransport final : public Transport {
 public:
  // `local` may be null (no local peers); `remote` may be null (no remote peers).
  RoutedTransport(std::unique_ptr<Transport> local, std::unique_ptr<C10dTransport> remote);

  void exchange(const std::vector<Send>& sends, const std::vector<Recv>& recvs,
                Clock::time_point deadline) override;
  bool reaches(int peer) const override;

 private:
  std::unique_ptr<Transport> local_;
  std::unique_ptr<C10dTransport> remote_;
};

}  // namespace cgx::transport
