// The process's MPI library: initialised once, with the thread level cgx needs (every
// group's worker thread calls MPI), and finalised once at interpreter exit.
//
// Whoever initialises MPI finalises it. If the user's code (mpi4py) initialised it first,
// cgx only checks the thread level and never finalises; if cgx did, a later mpi4py import
// finds MPI initialised and leaves finalisation to cgx. Either way cgx frees its own
// communicators before MPI_Finalize runs.
#pragma once

#include <mpi.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

namespace cgx::transport::mpi {

// Initialises MPI with MPI_THREAD_MULTIPLE unless already initialised; throws
// std::runtime_error if MPI was finalised, or initialised with a lower thread level.
void ensure_initialized();

int world_rank();
int world_size();
// Collectives over MPI_COMM_WORLD (rendezvous only): every rank's string, rank 0's string.
std::vector<std::string> allgather(const std::string& mine);
std::string broadcast_from_root(const std::string& value);

// A communicator owned by cgx (errors return codes; nothing else posts on it).
class Communicator {
 public:
  explicit Communicator(MPI_Comm comm) : comm_(comm) {}
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // MPI_COMM_NULL once MPI was finalised (read by worker threads, cleared at exit).
  MPI_Comm get() const { return comm_.load(); }
  void release();  // frees it (idempotent)

 private:
  friend void finalize();
  void release_locked();

  std::atomic<MPI_Comm> comm_;
};

// A communicator of the given MPI_COMM_WORLD ranks; rank i in it is world_ranks[i].
// Collective over those ranks only.
std::shared_ptr<Communicator> create_communicator(const std::vector<int>& world_ranks);

// Transports bracket their MPI calls with a Use, so that finalize() never frees a
// communicator or finalises MPI under a running call. A Use taken once finalize() has
// begun is refused (`ok()` false); long waits poll `finalizing()` and give up.
class Use {
 public:
  Use();
  ~Use();
  Use(const Use&) = delete;
  Use& operator=(const Use&) = delete;
  bool ok() const { return ok_; }

 private:
  bool ok_;
};
bool finalizing();

// Frees every live cgx communicator and finalises MPI if cgx initialised it, after the
// transports' running calls have ended (they see finalizing() and stop within a poll).
// Safe to call when MPI was never initialised, or already finalised by someone else.
void finalize();

// MPI's message for an error code.
std::string error_string(int code);

}  // namespace cgx::transport::mpi
