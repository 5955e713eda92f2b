#include "transport/routed_transport.h"

#include <stdexcept>
#include <string>

namespace cgx::transport {

RoutedTransport::RoutedTransport(std::unique_ptr<Transport> local,
                                 std::unique_ptr<Transport> remote)
    : local_(std::move(local)), remote_(std::move(remote)) {}

bool RoutedTransport::reaches(int peer) const {
  return (local_ && local_->reaches(peer)) || (remote_ && remote_->reaches(peer));
}

namespace {
// The parts of one exchange on each transport (either may be absent).
struct RoutedPending final : Pending {
  std::unique_ptr<Pending> remote;
  std::unique_ptr<Pending> local;
};
}  // namespace

std::unique_ptr<Pending> RoutedTransport::post(const std::vector<Send>& sends,
                                               const std::vector<Recv>& recvs) {
  std::vector<Send> local_sends, remote_sends;
  std::vector<Recv> local_recvs, remote_recvs;
  auto is_local = [&](int peer) {
    if (local_ && local_->reaches(peer)) return true;
    if (remote_ && remote_->reaches(peer)) return false;
    throw std::invalid_argument("cgx transport: no transport reaches rank " + std::to_string(peer));
  };
  for (const auto& s : sends) (is_local(s.peer) ? local_sends : remote_sends).push_back(s);
  for (const auto& r : recvs) (is_local(r.peer) ? local_recvs : remote_recvs).push_back(r);

  // The cross-host part first: it moves in the background while the local one is posted.
  auto pending = std::make_unique<RoutedPending>();
  if (!remote_sends.empty() || !remote_recvs.empty()) {
    pending->remote = remote_->post(remote_sends, remote_recvs);
    for (const auto& s : remote_sends) cross_host_bytes_ += s.bytes;
  }
  if (!local_sends.empty() || !local_recvs.empty()) {
    try {
      pending->local = local_->post(local_sends, local_recvs);
    } catch (...) {
      // The posted ops point into the caller's buffers: settle them before unwinding.
      if (pending->remote) remote_->abandon(*pending->remote, Clock::now());
      throw;
    }
  }
  return pending;
}

void RoutedTransport::wait(Pending& pending, Clock::time_point deadline) {
  auto& routed = static_cast<RoutedPending&>(pending);
  if (routed.local) {
    try {
      local_->wait(*routed.local, deadline);
    } catch (...) {
      if (routed.remote) remote_->abandon(*routed.remote, deadline);
      throw;
    }
  }
  if (routed.remote) remote_->wait(*routed.remote, deadline);
}

}  // namespace cgx::transport
