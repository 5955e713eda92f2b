// transport::ShmTransport between forked processes, with a store made of files.
#include <dirent.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "common/kv_store.h"
#include "collectives/allreduce.h"
#include "fixtures.h"
#include "transport/shm_transport.h"

namespace cgx::test {
namespace {

using namespace std::chrono_literals;
using transport::Clock;
using transport::Recv;
using transport::Send;
using transport::ShmTransport;
using transport::TimeoutError;

constexpr size_t kRingBytes = 4096;

// A KeyValueStore shared by forked processes: one file per key in a directory, written
// under a temporary name and renamed into place, so that a reader sees all of it or nothing.
class DirectoryStore final : public KeyValueStore {
 public:
  DirectoryStore(std::string dir, Clock::duration timeout)
      : dir_(std::move(dir)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    const std::string path = path_of(key);
    const std::string temporary = path + ".tmp" + std::to_string(getpid());
    {
      std::ofstream out(temporary, std::ios::binary);
      out.write(reinterpret_cast<const char*>(value.data()),
                static_cast<std::streamsize>(value.size()));
      if (!out) throw std::runtime_error("store: cannot write " + temporary);
    }
    if (std::rename(temporary.c_str(), path.c_str()) != 0)
      throw std::runtime_error("store: cannot rename " + temporary);
  }

  std::vector<uint8_t> get(const std::string& key) override {
    const auto deadline = Clock::now() + timeout_;
    while (true) {
      std::ifstream in(path_of(key), std::ios::binary);
      if (in) return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
      if (Clock::now() >= deadline) throw std::runtime_error("store: no key " + key + " in time");
      std::this_thread::sleep_for(1ms);
    }
  }

 private:
  // Keys hold '/': every byte but [A-Za-z0-9-] as %XX (so no key ends in ".tmpN").
  std::string path_of(const std::string& key) const {
    std::string name;
    for (unsigned char c : key) {
      if (std::isalnum(c) || c == '-') {
        name += static_cast<char>(c);
      } else {
        char hex[4];
        std::snprintf(hex, sizeof(hex), "%%%02X", c);
        name += hex;
      }
    }
    return dir_ + "/" + name;
  }

  std::string dir_;
  Clock::duration timeout_;
};

// A name prefix no other run or test uses (the suite's own check looks at "cgx-" only).
std::string unique_prefix() {
  static int counter = 0;
  std::random_device random;
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "cgxtest-%d-%08x%08x-%d", static_cast<int>(getpid()),
                random(), random(), counter++);
  return buffer;
}

// Entries of /dev/shm whose names start with `prefix`.
std::vector<std::string> shm_entries(const std::string& prefix) {
  std::vector<std::string> found;
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* entry = readdir(dir))
      if (std::strncmp(entry->d_name, prefix.c_str(), prefix.size()) == 0)
        found.push_back(entry->d_name);
    closedir(dir);
  }
  return found;
}

void check_nothing_left(const std::string& prefix) {
  const auto left = shm_entries(prefix);
  if (!left.empty()) fail(__FILE__, __LINE__, "left in /dev/shm: " + left.front());
}

// A directory made for one test, removed with its files.
class TemporaryDirectory {
 public:
  TemporaryDirectory() {
    char path[] = "/tmp/cgx-core-tests-XXXXXX";
    if (!mkdtemp(path)) throw std::runtime_error("mkdtemp failed");
    path_ = path;
  }
  ~TemporaryDirectory() {
    if (DIR* dir = opendir(path_.c_str())) {
      while (dirent* entry = readdir(dir))
        if (entry->d_name[0] != '.') unlink((path_ + "/" + entry->d_name).c_str());
      closedir(dir);
    }
    rmdir(path_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

using RankBody = std::function<void(int rank, KeyValueStore& store, const std::string& prefix)>;

// Runs body(rank, ...) in `size` forked processes sharing a store and a name prefix. Fails
// if a rank fails (its message on stderr) or is still running after `limit` (then killed),
// and if any segment of the prefix is left in /dev/shm afterwards.
void run_ranks(int size, const RankBody& body, Clock::duration limit = 60s) {
  TemporaryDirectory dir;
  const std::string prefix = unique_prefix();
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> children;
  for (int rank = 0; rank < size; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      int status = 1;
      try {
        DirectoryStore store(dir.path(), 10s);
        body(rank, store, prefix);
        status = 0;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      } catch (...) {
        std::fprintf(stderr, "rank %d: unknown exception\n", rank);
      }
      std::fflush(stderr);
      _exit(status);  // never back into the runner, no atexit handlers
    }
    if (pid < 0) {
      for (pid_t child : children) kill(child, SIGKILL);
      for (pid_t child : children) waitpid(child, nullptr, 0);
      fail(__FILE__, __LINE__, std::string("fork failed: ") + std::strerror(errno));
    }
    children.push_back(pid);
  }
  std::string failures;
  const auto deadline = Clock::now() + limit;
  for (int rank = 0; rank < size; ++rank) {
    int status = 0;
    pid_t done = 0;
    while ((done = waitpid(children[rank], &status, WNOHANG)) == 0 && Clock::now() < deadline)
      std::this_thread::sleep_for(1ms);
    if (done == 0) {
      kill(children[rank], SIGKILL);
      waitpid(children[rank], &status, 0);
      failures += " rank " + std::to_string(rank) + " timed out;";
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failures +=
          " rank " + std::to_string(rank) + " failed (status " + std::to_string(status) + ");";
    }
  }
  if (!failures.empty()) fail(__FILE__, __LINE__, "ranks failed:" + failures);
  check_nothing_left(prefix);
}

std::vector<int> ranks_below(int size) {
  std::vector<int> ranks(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  return ranks;
}

// The bytes `from` sends `to` as message `tag`: pseudo-random, so that a chunk delivered at
// the wrong place in the stream (a ring wrapping wrongly) cannot match.
std::vector<uint8_t> message(int from, int to, int tag, size_t bytes) {
  std::mt19937 generator(static_cast<uint32_t>(from * 1000003 + to * 1009 + tag));
  std::vector<uint8_t> out(bytes);
  for (auto& b : out) b = static_cast<uint8_t>(generator() >> 24);
  return out;
}

Clock::time_point soon() { return Clock::now() + 20s; }

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
// a message rank 0 never sends. Both raise TimeoutError at their deadline, not before and
// not much after, and their transports refuse further use.
CGX_TEST(shm_times_out_when_a_peer_never_sends_or_receives) {
  run_ranks(3, [](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, {0, 1, 2}, prefix, kRingBytes, store);
    const auto wait = 300ms;
    auto expect_timeout = [&](const std::vector<Send>& sends, const std::vector<Recv>& recvs) {
      const auto start = Clock::now();
      CHECK_THROWS(transport.exchange(sends, recvs, start + wait), TimeoutError);
      const auto elapsed = Clock::now() - start;
      CHECK(elapsed >= wait);
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

// The pipelined allreduce (chunks in pieces, one on the wire while the next is encoded)
// gives the very bits of the unpipelined one, on every rank, for SRA and Ring with a
// layout of mixed layers (stochastic rounding included), and bit-identical results
// across ranks.
void allreduce_pipelined_equals_unpipelined(int size, collectives::ReductionAlgorithm algorithm) {
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    const compression::LayoutCodec codec = mixed_layout();
    const topology::HostMap hosts(std::vector<std::string>(size, "host"));
    const std::vector<float> input = random_values(codec.total(), 17 + rank);
    collectives::Scratch scratch, cross_scratch;
    collectives::AllreduceOptions options;
    options.codec = &codec;
    options.inner = algorithm;
    options.seed = 99;
    options.scratch = &scratch;
    options.cross_scratch = &cross_scratch;
    auto reduce = [&](int64_t piece_values) {
      std::vector<float> data = input;
      options.piece_values = piece_values;
      options.deadline = soon();
      collectives::allreduce(transport, rank, hosts, data.data(), options);
      return data;
    };
    const std::vector<float> whole = reduce(0);
    for (int64_t piece_values : {int64_t{1}, int64_t{100}, int64_t{1000}}) {
      const std::vector<float> pieces = reduce(piece_values);
      CHECK(std::memcmp(whole.data(), pieces.data(), whole.size() * sizeof(float)) == 0);
    }
    // Every rank's result against every other's, through the transport.
    std::vector<std::vector<float>> theirs(size, std::vector<float>(whole.size()));
    std::vector<Send> sends;
    std::vector<Recv> recvs;
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      sends.push_back({peer, whole.data(), whole.size() * sizeof(float)});
      recvs.push_back({peer, theirs[peer].data(), whole.size() * sizeof(float)});
    }
    transport.exchange(sends, recvs, soon());
    for (int peer = 0; peer < size; ++peer)
      if (peer != rank)
        CHECK(std::memcmp(whole.data(), theirs[peer].data(), whole.size() * sizeof(float)) == 0);
  });
}

CGX_TEST(allreduce_pipelined_equals_unpipelined_sra_2_ranks) {
  allreduce_pipelined_equals_unpipelined(2, collectives::ReductionAlgorithm::SRA);
}

CGX_TEST(allreduce_pipelined_equals_unpipelined_sra_3_ranks) {
  allreduce_pipelined_equals_unpipelined(3, collectives::ReductionAlgorithm::SRA);
}

CGX_TEST(allreduce_pipelined_equals_unpipelined_ring_3_ranks) {
  allreduce_pipelined_equals_unpipelined(3, collectives::ReductionAlgorithm::Ring);
}

// Error feedback's record (AllreduceOptions::residual): every quantization a rank makes
// adds what it dropped, so the ranks' residuals sum to exactly what the result lacks of
// the input sum (up to float32 rounding of the sums), both stages, on the flat and the
// hierarchical paths; raw layers drop nothing; pipelining does not change a bit of it;
// and a non-finite bucket leaves the residual finite.
void allreduce_residuals_sum_to_what_the_result_lacks(std::vector<std::string> host_names,
                                                      collectives::ReductionAlgorithm algorithm,
                                                      bool leader_form) {
  const int size = static_cast<int>(host_names.size());
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    const compression::LayoutCodec codec = mixed_layout();
    const topology::HostMap hosts(host_names);
    const std::vector<float> input = random_values(codec.total(), 31 + rank);
    collectives::Scratch scratch, cross_scratch;
    collectives::AllreduceOptions options;
    options.codec = &codec;
    options.inner = options.cross = algorithm;
    options.leader_form = leader_form;
    options.seed = 5;
    options.scratch = &scratch;
    options.cross_scratch = &cross_scratch;
    const size_t n = input.size();
    auto reduce = [&](std::vector<float> data, int64_t piece_values) {
      std::vector<float> residual(n, 0.0f);
      options.residual = residual.data();
      options.piece_values = piece_values;
      options.deadline = soon();
      collectives::allreduce(transport, rank, hosts, data.data(), options);
      return std::make_pair(data, residual);
    };
    const auto [out, residual] = reduce(input, 0);
    const auto [out_pieces, residual_pieces] = reduce(input, 100);
    CHECK(std::memcmp(out.data(), out_pieces.data(), n * sizeof(float)) == 0);
    CHECK(std::memcmp(residual.data(), residual_pieces.data(), n * sizeof(float)) == 0);

    // Every rank's input and residual, through the transport.
    std::vector<std::vector<float>> inputs(size, std::vector<float>(n)), residuals = inputs;
    inputs[rank] = input;
    residuals[rank] = residual;
    std::vector<Send> sends;
    std::vector<Recv> recvs;
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      for (auto* mine : {&input, &residual}) sends.push_back({peer, mine->data(), n * sizeof(float)});
      recvs.push_back({peer, inputs[peer].data(), n * sizeof(float)});
      recvs.push_back({peer, residuals[peer].data(), n * sizeof(float)});
    }
    transport.exchange(sends, recvs, soon());
    double dropped = 0;
    for (size_t i = 0; i < n; ++i) {
      double sum = 0, fed_back = 0, scale = std::fabs(out[i]);
      for (int r = 0; r < size; ++r) {
        sum += inputs[r][i];
        fed_back += residuals[r][i];
        scale += std::fabs(inputs[r][i]) + std::fabs(residuals[r][i]);
      }
      CHECK(std::fabs(sum - (out[i] + fed_back)) <= 1e-6 * scale + 1e-6);
      dropped += std::fabs(fed_back);
    }
    CHECK(dropped > 0);  // something was quantized: the check above could fail
    for (const auto& segment : codec.segments())
      if (segment.raw)
        for (int64_t i = segment.offset; i < segment.offset + segment.numel; ++i)
          CHECK_EQ(residual[i], 0.0f);

    std::vector<float> overflowing = input;
    overflowing[3] = std::numeric_limits<float>::infinity();
    const auto [nan_out, finite_residual] = reduce(overflowing, 0);
    CHECK(std::isnan(nan_out[3]));
    for (float r : finite_residual) CHECK(std::isfinite(r));
  });
}

CGX_TEST(allreduce_residuals_sra_2_ranks) {
  allreduce_residuals_sum_to_what_the_result_lacks({"h", "h"}, collectives::ReductionAlgorithm::SRA, false);
}

CGX_TEST(allreduce_residuals_ring_3_ranks) {
  allreduce_residuals_sum_to_what_the_result_lacks({"h", "h", "h"}, collectives::ReductionAlgorithm::Ring, false);
}

CGX_TEST(allreduce_residuals_hierarchical_2x2) {
  allreduce_residuals_sum_to_what_the_result_lacks({"a", "a", "b", "b"}, collectives::ReductionAlgorithm::SRA, false);
}

CGX_TEST(allreduce_residuals_hierarchical_leaders_ring) {
  allreduce_residuals_sum_to_what_the_result_lacks({"a", "a", "b", "b", "b"}, collectives::ReductionAlgorithm::Ring, true);
}

}  // namespace
}  // namespace cgx::test
