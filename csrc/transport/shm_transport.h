// Shared-memory transport between the ranks of one group that share a host.
//
// Each rank creates one POSIX shared-memory segment (mode 0600, name = an unguessable
// per-group prefix agreed through the store + the rank) holding one single-producer /
// single-consumer byte ring per local peer it sends to, plus a doorbell word that peers
// bump (and futex-wake) when they move data to or from this rank. Segments are unlinked as
// soon as every local peer has attached, so nothing is left in /dev/shm even if a process
// dies later. Every wait is bounded by the exchange deadline, and ends sooner when a peer
// it waits for has exited (watched through a pidfd, where the peers share a pid
// namespace) or has given up on an exchange of its own (a flag in its segment, which a
// failing rank sets): a dead local peer is a TransportError on every survivor within
// about 50 ms of a sleep, not a timeout.
//
// The caller's thread moves the bytes: post() fills the rings as far as they have room,
// wait() moves the rest (exchanges complete in posting order).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/kv_store.h"
#include "transport/transport.h"

namespace cgx::transport {

class ShmTransport final : public Transport {
 public:
  // `local_ranks`: the group ranks on this host, including `rank`, in increasing order.
  // `name_prefix`: unguessable, identical on all local ranks of this group (the caller
  // agrees it through the store). `ring_bytes`: capacity of each ring. Blocks until every
  // local peer has attached (store waits, bounded by the store's own timeout) and throws
  // std::runtime_error on failure.
  ShmTransport(int rank, std::vector<int> local_ranks, const std::string& name_prefix,
               size_t ring_bytes, KeyValueStore& store);
  ~ShmTransport() override;

  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  std::unique_ptr<Pending> post(const std::vector<Send>& sends,
                                const std::vector<Recv>& recvs) override;
  void wait(Pending& pending, Clock::time_point deadline) override;
  bool reaches(int peer) const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cgx::transport
