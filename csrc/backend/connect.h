// Builds a group's transports from its settings: which ranks share a host, the inner
// transport between them (shared memory, MPI or Gloo) and the cross transport to the
// others (MPI or Gloo), routed as one.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>

#include "backend/settings.h"
#include "topology/host_map.h"
#include "transport/routed_transport.h"

namespace cgx::backend {

struct Connection {
  topology::HostMap hosts;
  std::unique_ptr<transport::RoutedTransport> transport;
};

// Collective over the group (store rendezvous; an MPI communicator when MPI is used).
// `exact` is the group's Gloo backend, which carries the GLOO transports.
Connection connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   const c10::intrusive_ptr<c10d::Backend>& exact, const Settings& settings);

}  // namespace cgx::backend
