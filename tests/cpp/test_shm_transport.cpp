// transport::ShmTransport between forked processes, with a store made of files.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "ranks.h"
#include "transport/shm_transport.h"

namespace cgx::test {
namespace {

using namespace std::chrono_literals;
using transport::Clock;
using transport::Recv;
using transport::Send;
using transport::ShmTransport;
using transport::TimeoutError;

// The bytes `from` sends `to` as message `tag`: pseudo-random, so that a chunk delivered at
// the wrong place in the stream (a ring wrapping wrongly) cannot match.
std::vector<uint8_t> message(int from, int to, int tag, size_t bytes) {
  std::mt19937 generator(static_cast<uint32_t>(from * 1000003 + to * 1009 + tag));
  std::vector<uint8_t> out(bytes);
  for (auto& b : out) b = static_cast<uint8_t>(generator() >> 24);
  return out;
}

// Each rank sends every peer messages of `sizes` (tags tag0, tag0 + 1, ...) in one
// exchange and receives as many, then checks each byte.
void exchange_all_to_all(ShmTransport& transport, int rank, int size,
                         const std::vector<size_t>& sizes, int tag0) {
  std::vector<std::vector<uint8_t>> outgoing, incoming;
  std::vector<Send> sends;
  std::vector<Recv> recvs;
  outgoing.reserve(size * sizes.size());
  incoming.reserve(size * sizes.size());
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    for (size_t m = 0; m < sizes.size(); ++m) {
      outgoing.push_back(message(rank, peer, tag0 + static_cast<int>(m), sizes[m]));
      incoming.emplace_back(sizes[m], 0xee);
      sends.push_back({peer, outgoing.back().data(), sizes[m]});
      recvs.push_back({peer, incoming.back().data(), sizes[m]});
    }
  }
  transport.exchange(sends, recvs, soon());
  size_t k = 0;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    for (size_t m = 0; m < sizes.size(); ++m, ++k)
      if (incoming[k] != message(peer, rank, tag0 + static_cast<int>(m), sizes[m]))
        fail(__FILE__, __LINE__,
             "rank " + std::to_string(rank) + ": message " + std::to_string(tag0 + m) +
                 " from rank " + std::to_string(peer) + " (" + std::to_string(sizes[m]) +
                 " bytes) arrived wrong");
  }
}

void exchange_large_messages(int size) {
  run_ranks(size, [size](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    for (int peer = 0; peer < size; ++peer) CHECK_EQ(transport.reaches(peer), peer != rank);
    CHECK(!transport.reaches(size));
    // Misaddressed operations are refused before anything moves.
    uint8_t byte = 0;
    CHECK_THROWS(transport.exchange({{rank, &byte, 1}}, {}, soon()), std::invalid_argument);
    CHECK_THROWS(transport.exchange({}, {{size + 3, &byte, 1}}, soon()), std::invalid_argument);
    transport.exchange({}, {}, soon());

    // 1 MiB, 256 times the ring, to and from every peer at once.
    exchange_all_to_all(transport, rank, size, {1 << 20}, 0);
    // Several messages to one peer in one call arrive in order; zero bytes among them.
    exchange_all_to_all(transport, rank, size, {0, 1000, 0, 3 * kRingBytes + 5, 1, 0}, 10);
    exchange_all_to_all(transport, rank, size, {0}, 20);

    // Across calls: two sends that fit in the ring complete before the peer receives;
    // the peer then reads them in the order they were sent.
    std::vector<std::vector<uint8_t>> first, second;
    for (int peer = 0; peer < size; ++peer) {
      first.push_back(message(rank, peer, 30, 1000));
      second.push_back(message(rank, peer, 31, 1500));
    }
    for (auto* batch : {&first, &second}) {
      std::vector<Send> sends;
      for (int peer = 0; peer < size; ++peer)
        if (peer != rank) sends.push_back({peer, (*batch)[peer].data(), (*batch)[peer].size()});
      transport.exchange(sends, {}, soon());
    }
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      std::vector<uint8_t> a(1000), b(1500);
      transport.exchange({}, {{peer, a.data(), a.size()}}, soon());
      transport.exchange({}, {{peer, b.data(), b.size()}}, soon());
      CHECK(a == message(peer, rank, 30, 1000));
      CHECK(b == message(peer, rank, 31, 1500));
    }
    // And the streams are still in step.
    exchange_all_to_all(transport, rank, size, {kRingBytes, 7}, 40);
  });
}

CGX_TEST(shm_exchanges_messages_larger_than_the_ring_2_ranks) { exchange_large_messages(2); }

CGX_TEST(shm_exchanges_messages_larger_than_the_ring_3_ranks) { exchange_large_messages(3); }

// Rank 0 sends rank 1 more than the ring holds and rank 1 never receives; rank 2 waits for
// a message rank 0 never sends. Both raise TimeoutError at their deadline, not much after
// (rank 2 maybe a little before, told by rank 0 that it timed out), and their transports
// refuse further use.
// Recv::up_to: a message that states its length is taken whole into a larger receive,
// and the one right behind it in the stream (past the ring's size) arrives intact; a
// message longer than the receive fails the exchange.
CGX_TEST(shm_takes_a_shorter_message_of_a_stated_length) {
  run_ranks(2, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, ranks_below(2), prefix, kRingBytes, store);
    const int peer = 1 - rank;
    for (const uint64_t length : {uint64_t{8}, uint64_t{100}, uint64_t{3 * kRingBytes + 5}}) {
      std::vector<uint8_t> stated = message(rank, peer, static_cast<int>(length), length);
      std::memcpy(stated.data(), &length, sizeof length);
      const std::vector<uint8_t> behind = message(rank, peer, 7, 2 * kRingBytes);
      std::vector<uint8_t> got_stated(length + 5 * kRingBytes), got_behind(behind.size());
      transport.exchange({{peer, stated.data(), stated.size()}, {peer, behind.data(), behind.size()}},
                         {{peer, got_stated.data(), got_stated.size(), /*up_to=*/true},
                          {peer, got_behind.data(), got_behind.size()}},
                         Clock::now() + 10s);
      std::vector<uint8_t> expected = message(peer, rank, static_cast<int>(length), length);
      std::memcpy(expected.data(), &length, sizeof length);
      CHECK(std::equal(expected.begin(), expected.end(), got_stated.begin()));
      CHECK(got_behind == message(peer, rank, 7, 2 * kRingBytes));
    }
    uint64_t too_long[4] = {sizeof too_long, 1, 2, 3};
    uint64_t room[2] = {};
    bool failed = false;
    try {
      transport.exchange({{peer, too_long, sizeof too_long}}, {{peer, room, sizeof room, /*up_to=*/true}},
                         Clock::now() + 10s);
    } catch (const transport::TransportError& e) {
      failed = std::string(e.what()).find("a message of 32 bytes for a receive of at most 16") != std::string::npos;
    }
    CHECK(failed);
  });
}

CGX_TEST(shm_times_out_when_a_peer_never_sends_or_receives) {
  run_ranks(3, [](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, {0, 1, 2}, prefix, kRingBytes, store);
    const auto wait = 300ms;
    auto expect_timeout = [&](const std::vector<Send>& sends, const std::vector<Recv>& recvs) {
      const auto start = Clock::now();
      CHECK_THROWS(transport.exchange(sends, recvs, start + wait), TimeoutError);
      const auto elapsed = Clock::now() - start;
      CHECK(elapsed >= wait - 100ms);
      CHECK(elapsed < wait + 2s);
      CHECK_THROWS(transport.exchange({}, {}, soon()), std::runtime_error);
    };
    if (rank == 0) {
      const std::vector<uint8_t> big(1 << 20, 1);
      expect_timeout({{1, big.data(), big.size()}}, {});
    } else if (rank == 2) {
      std::vector<uint8_t> small(100);
      expect_timeout({}, {{0, small.data(), small.size()}});
    }
    // Nobody leaves before both timeouts are seen.
    store.set(prefix + "/done/" + std::to_string(rank), {1});
    for (int peer = 0; peer < 3; ++peer) store.get(prefix + "/done/" + std::to_string(peer));
  });
}

// Rank 2 starts sending rank 0 more than the ring holds and exits; rank 1 waits for a
// message of rank 0's that never comes. Rank 0 finds rank 2's process gone, and rank 1
// finds rank 0 failed: both raise TransportError (not a timeout) long before the deadline.
// (Rank 0 stays alive until rank 1 is done: without the flag rank 1 would wait out its
// deadline.)
CGX_TEST(shm_a_dead_local_peer_fails_the_exchanges_that_wait_for_it_at_once) {
  run_ranks(3, [](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, {0, 1, 2}, prefix, kRingBytes, store);
    std::vector<uint8_t> big(1 << 20, 1);
    if (rank == 2) {
      auto pending = transport.post({{0, big.data(), big.size()}}, {});
      _exit(0);
    }
    const auto start = Clock::now();
    bool timed_out = false;
    std::string message;
    try {
      if (rank == 0) {
        transport.exchange({}, {{2, big.data(), big.size()}}, start + 20s);
      } else {
        transport.exchange({}, {{0, big.data(), 8}}, start + 20s);
      }
    } catch (const TimeoutError& e) {
      timed_out = true;
      message = e.what();
    } catch (const transport::TransportError& e) {
      message = e.what();
    }
    CHECK(!timed_out);
    CHECK(Clock::now() - start < 2s);
    CHECK(message.find(rank == 0 ? "local rank 2" : "local rank 0") != std::string::npos);
    CHECK(message.find(rank == 0 ? "exited" : "failed") != std::string::npos);
    CHECK_THROWS(transport.exchange({}, {}, soon()), transport::TransportError);
    store.set(prefix + "/done/" + std::to_string(rank), {1});
    for (int peer = 0; peer < 2; ++peer) store.get(prefix + "/done/" + std::to_string(peer));
  });
}

CGX_TEST(shm_set_up_fails_cleanly_when_a_peer_never_comes) {
  TemporaryDirectory dir;
  DirectoryStore store(dir.path(), 300ms);
  const std::string prefix = unique_prefix();
  const auto start = Clock::now();
  CHECK_THROWS(ShmTransport(0, {0, 1}, prefix, kRingBytes, store), std::runtime_error);
  CHECK(Clock::now() - start < 5s);
  check_nothing_left(prefix);
}

CGX_TEST(shm_rejects_bad_arguments) {
  TemporaryDirectory dir;
  DirectoryStore store(dir.path(), 300ms);
  const std::string prefix = unique_prefix();
  CHECK_THROWS(ShmTransport(0, {0, 1}, prefix, 0, store), std::invalid_argument);
  CHECK_THROWS(ShmTransport(0, {1, 0}, prefix, kRingBytes, store), std::invalid_argument);
  CHECK_THROWS(ShmTransport(0, {0, 0, 1}, prefix, kRingBytes, store), std::invalid_argument);
  CHECK_THROWS(ShmTransport(2, {0, 1}, prefix, kRingBytes, store), std::invalid_argument);
  check_nothing_left(prefix);
}

}  // namespace
}  // namespace cgx::test
