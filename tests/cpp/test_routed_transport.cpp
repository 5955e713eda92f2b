// transport::RoutedTransport: peers on this host through the local transport, the others
// through the remote one, in one exchange; only the remote bytes count as cross-host. Two
// "hosts" of two forked ranks each, with a ShmTransport standing in for each side.
#include <cstdint>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "ranks.h"
#include "transport/routed_transport.h"
#include "transport/shm_transport.h"

namespace cgx::test {
namespace {

using transport::Recv;
using transport::RoutedTransport;
using transport::Send;
using transport::ShmTransport;

std::vector<uint8_t> bytes_from(int from, int to, size_t n) {
  std::mt19937 generator(static_cast<uint32_t>(from * 7919 + to));
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(generator() >> 24);
  return out;
}

CGX_TEST(routed_transport_sends_each_peer_through_the_transport_that_reaches_it) {
  const int size = 4;
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    const int host = rank / 2;
    const int mate = rank ^ 1;
    // Local: this host's two ranks. Remote: one rank of each host pairs with the same
    // position on the other (0-2, 1-3), as leaders would.
    auto local = std::make_unique<ShmTransport>(rank, std::vector<int>{2 * host, 2 * host + 1},
                                                prefix + "l" + std::to_string(host), kRingBytes, store);
    auto remote = std::make_unique<ShmTransport>(rank, std::vector<int>{rank % 2, rank % 2 + 2},
                                                 prefix + "r" + std::to_string(rank % 2), kRingBytes, store);
    RoutedTransport routed(std::move(local), std::move(remote));
    const int across = (rank + 2) % size;
    const int unreachable = (mate + 2) % size;
    CHECK(routed.reaches(mate) && routed.reaches(across) && !routed.reaches(unreachable));

    const size_t local_bytes = 3 * kRingBytes + 1, remote_bytes = 5 * kRingBytes + 3;
    const std::vector<uint8_t> to_mate = bytes_from(rank, mate, local_bytes);
    const std::vector<uint8_t> to_across = bytes_from(rank, across, remote_bytes);
    std::vector<uint8_t> from_mate(local_bytes), from_across(remote_bytes);
    routed.exchange({{mate, to_mate.data(), local_bytes}, {across, to_across.data(), remote_bytes}},
                    {{mate, from_mate.data(), local_bytes}, {across, from_across.data(), remote_bytes}}, soon());
    CHECK(from_mate == bytes_from(mate, rank, local_bytes));
    CHECK(from_across == bytes_from(across, rank, remote_bytes));
    CHECK_EQ(routed.cross_host_bytes(), uint64_t{remote_bytes});

    uint8_t byte = 0;
    CHECK_THROWS(routed.post({{unreachable, &byte, 1}}, {}), std::invalid_argument);
    CHECK_EQ(routed.cross_host_bytes(), uint64_t{remote_bytes});  // the refused post counted nothing
  });
}

}  // namespace
}  // namespace cgx::test
