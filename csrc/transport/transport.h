// Moves byte buffers between the ranks of one group. Algorithms (csrc/collectives) see
// only this interface; concrete transports never see an algorithm.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace cgx::transport {

using Clock = std::chrono::steady_clock;

struct Send {
  int peer;
  const void* data;
  size_t bytes;
};

struct Recv {
  int peer;
  void* data;
  size_t bytes;
  // The message may be shorter than `bytes`: its sender wrote its whole length (a
  // uint64_t of at least kLengthBytes, in this machine's order) in its first kLengthBytes
  // bytes, and exactly that many arrive. A longer message fails the transport.
  bool up_to = false;
};

// The length field that starts a message received with Recv::up_to.
constexpr size_t kLengthBytes = sizeof(uint64_t);

// A transport failed: a peer closed its connection, MPI is being finalized, a send was
// refused. The transport is unusable afterwards (messages may be half delivered).
class TransportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A wait passed its deadline: a peer is dead, stuck or out of step.
class TimeoutError : public TransportError {
 public:
  using TransportError::TransportError;
};

// The operations of one exchange, posted and not yet waited for (transport specific).
class Pending {
 public:
  virtual ~Pending() = default;
};

// Every transport is non-blocking: post() starts an exchange and returns, wait() finishes
// it. Algorithms keep one exchange on the wire while they encode the next and decode the
// last (collectives/pipeline.h).
class Transport {
 public:
  virtual ~Transport() = default;

  // Starts delivering every send to its peer and filling every recv from its peer. All
  // of them make progress together (two ranks sending each other large messages cannot
  // deadlock). Messages between two ranks arrive in the order they were posted, across
  // exchanges too; the receiver names the exact size (or, Recv::up_to, the most it takes);
  // a rank never sends to itself. The buffers must stay valid, the sends unchanged, until wait() returns. How much moves
  // before wait() is the transport's affair (Gloo and MPI move everything in the
  // background; shared memory moves what its rings hold and the rest in wait()).
  virtual std::unique_ptr<Pending> post(const std::vector<Send>& sends,
                                        const std::vector<Recv>& recvs) = 0;
  // Returns when every op of `pending` is done. Callers wait in posting order (shared
  // memory completes exchanges in that order). Waits for every op even after one fails
  // (none outlives this call), then throws TimeoutError at `deadline` or TransportError
  // for any other failure.
  virtual void wait(Pending& pending, Clock::time_point deadline) = 0;

  // Whether the transport can reach `peer` (group rank).
  virtual bool reaches(int peer) const = 0;

  // wait() for a caller that is already failing: swallows the errors.
  void abandon(Pending& pending, Clock::time_point deadline) noexcept {
    try {
      wait(pending, deadline);
    } catch (const std::exception&) {
      // The caller is already failing with its own cause.
    }
  }
  // post() then wait().
  void exchange(const std::vector<Send>& sends, const std::vector<Recv>& recvs,
                Clock::time_point deadline) {
    auto pending = post(sends, recvs);
    wait(*pending, deadline);
  }
};

}  // namespace cgx::transport
