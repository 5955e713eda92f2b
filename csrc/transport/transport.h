// Moves byte buffers between the ranks of one group. Algorithms (csrc/collectives) see
// only this interface; concrete transports never see an algorithm.
#pragma once

#include <chrono>
#include <cstddef>
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
};

// A wait passed its deadline: a peer is dead, stuck or out of step. The transport is
// unusable afterwards (messages may be half delivered).
class TimeoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // Delivers every send to its peer and fills every recv from its peer, making progress
  // on all of them at once (so that two ranks sending each other large messages cannot
  // deadlock). Messages between two ranks arrive in the order they were posted, across
  // calls too; the receiver names the exact size. Returns when all are done; throws
  // TimeoutError at `deadline`. A rank never sends to itself.
  virtual void exchange(const std::vector<Send>& sends, const std::vector<Recv>& recvs,
                        Clock::time_point deadline) = 0;

  // Whether exchange() can reach `peer` (group rank).
  virtual bool reaches(int peer) const = 0;
};

// The operations of one exchange, posted and not yet waited for (transport specific).
class Pending {
 public:
  virtual ~Pending() = default;
};

// A transport whose operations progress in the background once posted, so that another
// transport can run meanwhile (RoutedTransport posts the cross-host part first).
class AsyncTransport : public Transport {
 public:
  virtual std::unique_ptr<Pending> post(const std::vector<Send>& sends,
                                        const std::vector<Recv>& recvs) = 0;
  // Waits for every posted op (all of them, even after one fails; none outlives this
  // call), then throws TimeoutError with the first failure.
  virtual void wait(Pending& pending, Clock::time_point deadline) = 0;
  // wait() for a caller that is already failing: swallows the errors.
  void abandon(Pending& pending, Clock::time_point deadline) noexcept {
    try {
      wait(pending, deadline);
    } catch (const std::exception&) {
      // The caller is already failing with its own cause.
    }
  }
  void exchange(const std::vector<Send>& sends, const std::vector<Recv>& recvs,
                Clock::time_point deadline) override {
    auto pending = post(sends, recvs);
    wait(*pending, deadline);
  }
};

}  // namespace cgx::transport
