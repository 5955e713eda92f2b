// Multi-rank core tests: ranks as forked processes that share a store made of files and a
// shared-memory name prefix, and the checks every such test makes (no rank fails or
// hangs, nothing left in /dev/shm).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "common/kv_store.h"
#include "transport/transport.h"

namespace cgx::test {

constexpr size_t kRingBytes = 4096;  // small, so that messages wrap the shm rings

// A KeyValueStore shared by forked processes: one file per key in a directory, written
// under a temporary name and renamed into place, so that a reader sees all of it or nothing.
class DirectoryStore final : public KeyValueStore {
 public:
  DirectoryStore(std::string dir, transport::Clock::duration timeout)
      : dir_(std::move(dir)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key) override;

 private:
  std::string path_of(const std::string& key) const;

  std::string dir_;
  transport::Clock::duration timeout_;
};

// A directory made for one test, removed with its files.
class TemporaryDirectory {
 public:
  TemporaryDirectory();
  ~TemporaryDirectory();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A name prefix no other run or test uses (the suite's own check looks at "cgx-" only).
std::string unique_prefix();

// Fails if an entry of /dev/shm starts with `prefix`.
void check_nothing_left(const std::string& prefix);

using RankBody = std::function<void(int rank, KeyValueStore& store, const std::string& prefix)>;

// Runs body(rank, ...) in `size` forked processes sharing a store and a name prefix. Fails
// if a rank fails (its message on stderr) or is still running after `limit` (then killed),
// and if any segment of the prefix is left in /dev/shm afterwards.
void run_ranks(int size, const RankBody& body,
               transport::Clock::duration limit = std::chrono::seconds(60));

std::vector<int> ranks_below(int size);  // 0, 1, ..., size - 1

transport::Clock::time_point soon();  // a deadline no healthy exchange reaches

// Every rank's `mine` (all the same length), indexed by rank, through `transport`.
std::vector<std::vector<float>> from_every_rank(transport::Transport& transport, int rank, int size,
                                                const std::vector<float>& mine);

}  // namespace cgx::test
