#include "transport/routed_transport.h"

#include <stdexcept>
#include <string>

namespace cgx::transport {

RoutedTransport::RoutedTransport(std::unique_ptr<Transport> local,
                                 std::unique_ptr<AsyncTransport> remote)
    : local_(std::move(local)), remote_(std::move(remote)) {}

bool RoutedTransport::reaches(int peer) const {
  return (local_ && local_->reaches(peer)) || (remote_ && remote_->reaches(peer));
}

void RoutedTransport::exchange(const std::vector<Send>& sends, const std::vector<Recv>& recvs,
                               Clock::time_point deadline) {
  std::vector<Send> local_sends, remote_sends;
  std::vector<Recv> local_recvs, remote_recvs;
  auto is_local = [&](int peer) {
    if (local_ && local_->reaches(peer)) return true;
    if (remote_ && remote_->reaches(peer)) return false;
    throw std::invalid_argument("cgx transport: no transport reaches rank " + std::to_string(peer));
  };
  for (const auto& s : sends) (is_local(s.peer) ? local_sends : remote_sends).push_back(s);
  for (const auto& r : recvs) (is_local(r.peer) ? local_recvs : remote_recvs).push_back(r);

  std::unique_ptr<Pending> pending;
  if (!remote_sends.empty() || !remote_recvs.empty()) {
    pending = remote_->post(remote_sends, remote_recvs);
    for (const auto& s : remote_sends) cross_host_bytes_ += s.bytes;
  }
  if (!local_sends.empty() || !local_recvs.empty()) {
    try {
      local_->exchange(local_sends, local_recvs, deadline);
    } catch (...) {
      // The posted ops point into the caller's buffers: settle them before unwinding.
      if (pending) remote_->abandon(*pending, deadline);
      throw;
    }
  }
  if (pending) remote_->wait(*pending, deadline);
}

}  // namespace cgx::transport
