#include "transport/mpi_transport.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <thread>

namespace cgx::transport {

namespace {

constexpr int kTag = 1;
// MPI counts are ints: larger messages go in pieces, cut the same way on both sides.
constexpr size_t kMaxPiece = size_t{1} << 30;

struct PostedRequests final : Pending {
  std::vector<MPI_Request> requests;
  std::vector<bool> is_recv;
};

}  // namespace

MpiTransport::MpiTransport(std::shared_ptr<mpi::Communicator> comm, int rank,
                           std::vector<bool> reachable)
    : comm_(std::move(comm)), rank_(rank), reachable_(std::move(reachable)) {}

bool MpiTransport::reaches(int peer) const {
  return peer != rank_ && peer >= 0 && peer < static_cast<int>(reachable_.size()) &&
         reachable_[peer];
}

std::unique_ptr<Pending> MpiTransport::post(const std::vector<Send>& sends,
                                            const std::vector<Recv>& recvs) {
  auto posted = std::make_unique<PostedRequests>();
  const MPI_Comm comm = comm_->get();
  auto fail = [&](const std::string& why) {
    abandon(*posted, Clock::now());
    throw TimeoutError("cgx transport over MPI failed: " + why);
  };
  if (comm == MPI_COMM_NULL) fail("MPI was finalized");
  for (const auto& r : recvs) {
    if (!reaches(r.peer)) fail("rank " + std::to_string(r.peer) + " is not reachable over MPI");
    for (size_t done = 0; done < r.bytes; done += kMaxPiece) {
      MPI_Request request;
      const int n = static_cast<int>(std::min(kMaxPiece, r.bytes - done));
      const int code = MPI_Irecv(static_cast<char*>(r.data) + done, n, MPI_BYTE, r.peer, kTag,
                                 comm, &request);
      if (code != MPI_SUCCESS) fail(mpi::error_string(code));
      posted->requests.push_back(request);
      posted->is_recv.push_back(true);
    }
  }
  for (const auto& s : sends) {
    if (!reaches(s.peer)) fail("rank " + std::to_string(s.peer) + " is not reachable over MPI");
    for (size_t done = 0; done < s.bytes; done += kMaxPiece) {
      MPI_Request request;
      const int n = static_cast<int>(std::min(kMaxPiece, s.bytes - done));
      const int code = MPI_Isend(static_cast<const char*>(s.data) + done, n, MPI_BYTE, s.peer,
                                 kTag, comm, &request);
      if (code != MPI_SUCCESS) fail(mpi::error_string(code));
      posted->requests.push_back(request);
      posted->is_recv.push_back(false);
    }
  }
  return posted;
}

void MpiTransport::wait(Pending& pending, Clock::time_point deadline) {
  auto& posted = static_cast<PostedRequests&>(pending);
  auto& requests = posted.requests;
  std::string error;
  auto backoff = std::chrono::microseconds(0);
  while (!requests.empty()) {
    int done = 0;
    const int code = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                                 MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS) {
      error = mpi::error_string(code);
      break;
    }
    if (done) {
      requests.clear();
      return;
    }
    if (Clock::now() >= deadline) {
      error = "timed out waiting for peers (dead, stuck, or out of step)";
      break;
    }
    // Spin briefly (latency), then sleep in growing steps up to 1 ms (oversubscription).
    if (backoff.count() == 0) {
      std::this_thread::yield();
      backoff = std::chrono::microseconds(1);
    } else {
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::microseconds(1000));
    }
  }
  // Failure: receives that never matched are cancelled; sends are left to MPI (a send to
  // a dead peer cannot be recalled). The group is unusable afterwards either way.
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i] == MPI_REQUEST_NULL) continue;
    if (posted.is_recv[i]) MPI_Cancel(&requests[i]);
    MPI_Request_free(&requests[i]);
  }
  requests.clear();
  if (!error.empty()) throw TimeoutError("cgx transport over MPI failed: " + error);
}

}  // namespace cgx::transport
