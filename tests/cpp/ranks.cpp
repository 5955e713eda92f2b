// The process harness of the multi-rank core tests (ranks.h).
#include "ranks.h"

#include <dirent.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>
#include <thread>

#include "check.h"

namespace cgx::test {

using namespace std::chrono_literals;
using transport::Clock;

void DirectoryStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  const std::string path = path_of(key);
  const std::string temporary = path + ".tmp" + std::to_string(getpid());
  {
    std::ofstream out(temporary, std::ios::binary);
    out.write(reinterpret_cast<const char*>(value.data()), static_cast<std::streamsize>(value.size()));
    if (!out) throw std::runtime_error("store: cannot write " + temporary);
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0)
    throw std::runtime_error("store: cannot rename " + temporary);
}

std::vector<uint8_t> DirectoryStore::get(const std::string& key) {
  const auto deadline = Clock::now() + timeout_;
  while (true) {
    std::ifstream in(path_of(key), std::ios::binary);
    if (in) return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    if (Clock::now() >= deadline) throw std::runtime_error("store: no key " + key + " in time");
    std::this_thread::sleep_for(1ms);
  }
}

// Keys hold '/': every byte but [A-Za-z0-9-] as %XX (so no key ends in ".tmpN").
std::string DirectoryStore::path_of(const std::string& key) const {
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

std::string unique_prefix() {
  static int counter = 0;
  std::random_device random;
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "cgxtest-%d-%08x%08x-%d", static_cast<int>(getpid()),
                random(), random(), counter++);
  return buffer;
}

namespace {

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

}  // namespace

void check_nothing_left(const std::string& prefix) {
  const auto left = shm_entries(prefix);
  if (!left.empty()) fail(__FILE__, __LINE__, "left in /dev/shm: " + left.front());
}

TemporaryDirectory::TemporaryDirectory() {
  char path[] = "/tmp/cgx-core-tests-XXXXXX";
  if (!mkdtemp(path)) throw std::runtime_error("mkdtemp failed");
  path_ = path;
}

TemporaryDirectory::~TemporaryDirectory() {
  if (DIR* dir = opendir(path_.c_str())) {
    while (dirent* entry = readdir(dir))
      if (entry->d_name[0] != '.') unlink((path_ + "/" + entry->d_name).c_str());
    closedir(dir);
  }
  rmdir(path_.c_str());
}

void run_ranks(int size, const RankBody& body, Clock::duration limit) {
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

transport::Clock::time_point soon() { return Clock::now() + 20s; }

std::vector<std::vector<float>> from_every_rank(transport::Transport& transport, int rank, int size,
                                                const std::vector<float>& mine) {
  std::vector<std::vector<float>> all(size, std::vector<float>(mine.size()));
  all[rank] = mine;
  std::vector<transport::Send> sends;
  std::vector<transport::Recv> recvs;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    sends.push_back({peer, mine.data(), mine.size() * sizeof(float)});
    recvs.push_back({peer, all[peer].data(), mine.size() * sizeof(float)});
  }
  transport.exchange(sends, recvs, soon());
  return all;
}

}  // namespace cgx::test
