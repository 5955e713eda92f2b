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
  const mpi::Use use;
  if (!use.ok()) throw TransportError("cgx transport over MPI failed: MPI is being finalized");
  const MPI_Comm comm = comm_->get();
  auto fail = [&](const std::string& why) {
    abandon(*posted, Clock::now());
    throw TransportError("cgx transport over MPI failed: " + why);
  };
  if (comm == MPI_COMM_NULL) fail("MPI was finalized");
  for (const auto& r : recvs) {
    if (!reaches(r.peer)) fail("rank " + std::to_string(r.peer) + " is not reachable over MPI");
    // A receive of a stated length (up_to) takes a shorter message as one MPI receive does.
    if (r.up_to && r.bytes > kMaxPiece) fail("a receive of a stated length above " + std::to_string(kMaxPiece) + " bytes");
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
  const mpi::Use use;
  if (!use.ok()) {
    requests.clear();  // MPI finalises with them: nothing may touch them any more
    throw TransportError("cgx transport over MPI failed: MPI is being finalized");
  }
  if (requests.empty()) return;  // nothing posted (empty messages are not sent): done
  std::vector<int> indices(requests.size());
  std::string error;
  bool timed_out = false;
  auto backoff = std::chrono::microseconds(0);
  while (!requests.empty()) {
    int completed = 0;
    const int code = MPI_Testsome(static_cast<int>(requests.size()), requests.data(), &completed,
                                  indices.data(), MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS) {
      error = mpi::error_string(code);
      break;
    }
    if (completed == MPI_UNDEFINED) {  // every request is done (MPI_REQUEST_NULL)
      requests.clear();
      return;
    }
    if (Clock::now() >= deadline) {
      error = "timed out waiting for peers (dead, stuck, or out of step)";
      timed_out = true;
      break;
    }
    if (mpi::finalizing()) {
      error = "MPI is being finalized (interpreter exit)";
      break;
    }
    // Progress: poll again at once. None: yield, then sleep in growing steps up to 1 ms
    // (oversubscribed ranks leave the cores to their peers).
    if (completed > 0) {
      backoff = std::chrono::microseconds(0);
    } else if (backoff.count() == 0) {
      std::this_thread::yield();
      backoff = std::chrono::microseconds(1);
    } else {
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::microseconds(1000));
    }
  }
  // Failure: receives that never matched are cancelled and given a moment to settle, so
  // that MPI does not write into buffers after this call. A receive already under way
  // from a stuck peer, or a send to a dead one, cannot be recalled: those are released
  // to MPI. The group is unusable afterwards either way.
  for (size_t i = 0; i < requests.size(); ++i)
    if (requests[i] != MPI_REQUEST_NULL && posted.is_recv[i]) MPI_Cancel(&requests[i]);
  const auto settle_until = Clock::now() + std::chrono::seconds(1);
  for (auto& request : requests) {
    int done = 0;
    while (request != MPI_REQUEST_NULL && !done && Clock::now() < settle_until) {
      MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (request != MPI_REQUEST_NULL && !done) MPI_Request_free(&request);
  }
  requests.clear();
  if (timed_out) throw TimeoutError("cgx transport over MPI failed: " + error);
  throw TransportError("cgx transport over MPI failed: " + error);
}

}  // namespace cgx::transport
