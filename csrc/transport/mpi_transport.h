// Transport over MPI point-to-point (MPI_Isend / MPI_Irecv) on a communicator of the
// group's ranks that only cgx uses; rank p of the communicator is group rank p. MPI keeps
// messages between two ranks in order, so one tag serves every call. Waits poll with
// MPI_Testsome, backing off to short sleeps while nothing progresses, so that
// oversubscribed ranks leave the cores to their peers, and give up at the deadline
// (pending receives are cancelled).
#pragma once

#include <memory>
#include <vector>

#include "transport/mpi_runtime.h"
#include "transport/transport.h"

namespace cgx::transport {

class MpiTransport final : public Transport {
 public:
  // `reachable[p]`: whether this transport is used for group rank p.
  MpiTransport(std::shared_ptr<mpi::Communicator> comm, int rank, std::vector<bool> reachable);

  std::unique_ptr<Pending> post(const std::vector<Send>& sends,
                                const std::vector<Recv>& recvs) override;
  void wait(Pending& pending, Clock::time_point deadline) override;
  bool reaches(int peer) const override;

 private:
  std::shared_ptr<mpi::Communicator> comm_;
  int rank_;
  std::vector<bool> reachable_;
};

}  // namespace cgx::transport
