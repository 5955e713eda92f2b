#include "backend/c10d_transport.h"

#include <stdexcept>
#include <string>

#include "backend/errors.h"

namespace cgx::backend {

using transport::Clock;
using transport::Pending;
using transport::Recv;
using transport::Send;

namespace {
constexpr uint32_t kTagSpan = 1u << 30;

at::Tensor as_bytes(const void* data, size_t bytes) {
  return at::from_blob(const_cast<void*>(data), {static_cast<int64_t>(bytes)},
                       at::TensorOptions().dtype(at::kByte));
}
}  // namespace

C10dTransport::C10dTransport(c10::intrusive_ptr<c10d::Backend> backend, int rank,
                             std::vector<bool> reachable)
    : backend_(std::move(backend)),
      rank_(rank),
      reachable_(std::move(reachable)),
      sent_(reachable_.size(), 0),
      received_(reachable_.size(), 0) {}

bool C10dTransport::reaches(int peer) const {
  return peer != rank_ && peer >= 0 && peer < static_cast<int>(reachable_.size()) &&
         reachable_[peer];
}

int C10dTransport::next_tag(std::vector<uint32_t>& counters, int peer) {
  if (!reaches(peer))
    throw std::invalid_argument("cgx transport: rank " + std::to_string(peer) +
                                " is not reachable over the wrapped backend");
  return kFirstCgxTag + static_cast<int>(counters[peer]++ % kTagSpan);
}

namespace {
struct PostedWorks final : Pending {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
};
}  // namespace

std::unique_ptr<Pending> C10dTransport::post(const std::vector<Send>& sends,
                                             const std::vector<Recv>& recvs) {
  auto posted = std::make_unique<PostedWorks>();
  try {
    // Zero-byte messages are skipped on both sides (both know the size). Gloo takes a
    // shorter message into a larger receive as it is, so Recv::up_to needs nothing more.
    for (const auto& r : recvs) {
      if (r.bytes == 0) continue;
      std::vector<at::Tensor> t{as_bytes(r.data, r.bytes)};
      posted->works.push_back(backend_->recv(t, r.peer, next_tag(received_, r.peer)));
    }
    for (const auto& s : sends) {
      if (s.bytes == 0) continue;
      std::vector<at::Tensor> t{as_bytes(s.data, s.bytes)};
      posted->works.push_back(backend_->send(t, s.peer, next_tag(sent_, s.peer)));
    }
  } catch (const std::exception& e) {
    // Settle what was posted before its buffers go away.
    abandon(*posted, Clock::now());
    throw transport::TransportError("cgx transport over the wrapped backend failed: " + message_of(e));
  }
  return posted;
}

void C10dTransport::wait(Pending& pending, Clock::time_point deadline) {
  auto& works = static_cast<PostedWorks&>(pending).works;
  std::string first_error;
  for (auto& work : works) {
    // Every op is waited for, also after one failed, so none outlives this call.
    try {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) left = std::chrono::milliseconds(1);
      if (!work->wait(left) && first_error.empty()) first_error = "operation aborted";
    } catch (const std::exception& e) {
      if (first_error.empty()) first_error = message_of(e);
    }
  }
  works.clear();
  if (first_error.empty()) return;
  const std::string message = "cgx transport over the wrapped backend failed: " + first_error;
  if (Clock::now() >= deadline) throw transport::TimeoutError(message);
  throw transport::TransportError(message);
}

}  // namespace cgx::backend
