#include "transport/mpi_runtime.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <stdexcept>

namespace cgx::transport::mpi {

namespace {

std::mutex& runtime_mutex() {
  static std::mutex m;
  return m;
}
bool& initialized_by_cgx() {
  static bool value = false;
  return value;
}
// Live communicators, freed before MPI_Finalize.
std::set<Communicator*>& live() {
  static std::set<Communicator*> set;
  return set;
}

// Running transport calls, and whether finalize() has begun (guarded by runtime_mutex).
int& uses() {
  static int count = 0;
  return count;
}
std::condition_variable& uses_ended() {
  static std::condition_variable cv;
  return cv;
}
std::atomic<bool> finalize_begun{false};

bool finalized() {
  int done = 0;
  MPI_Finalized(&done);
  return done != 0;
}

void check(int code, const char* what) {
  if (code != MPI_SUCCESS)
    throw std::runtime_error(std::string("cgx MPI: ") + what + " failed: " + error_string(code));
}

}  // namespace

std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "error " + std::to_string(code);
  return std::string(text, length);
}

void ensure_initialized() {
  std::lock_guard<std::mutex> lock(runtime_mutex());
  if (finalized()) throw std::runtime_error("cgx MPI: MPI was already finalized in this process");
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = 0;
  if (initialized) {
    MPI_Query_thread(&provided);
  } else {
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    initialized_by_cgx() = true;
  }
  if (provided < MPI_THREAD_MULTIPLE)
    throw std::runtime_error(
        "cgx MPI: MPI was initialized without MPI_THREAD_MULTIPLE (cgx calls MPI from its "
        "worker threads); initialize it with that level (mpi4py does by default) or let cgx "
        "initialize it");
}

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

std::vector<std::string> allgather(const std::string& mine) {
  const int size = world_size();
  int length = static_cast<int>(mine.size());
  std::vector<int> lengths(size), offsets(size, 0);
  check(MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, MPI_COMM_WORLD),
        "MPI_Allgather");
  for (int r = 1; r < size; ++r) offsets[r] = offsets[r - 1] + lengths[r - 1];
  std::string all(offsets[size - 1] + lengths[size - 1], '\0');
  check(MPI_Allgatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(),
                       MPI_CHAR, MPI_COMM_WORLD),
        "MPI_Allgatherv");
  std::vector<std::string> out;
  for (int r = 0; r < size; ++r) out.push_back(all.substr(offsets[r], lengths[r]));
  return out;
}

std::string broadcast_from_root(const std::string& value) {
  int length = static_cast<int>(value.size());
  check(MPI_Bcast(&length, 1, MPI_INT, 0, MPI_COMM_WORLD), "MPI_Bcast");
  std::string out = world_rank() == 0 ? value : std::string(length, '\0');
  check(MPI_Bcast(out.data(), length, MPI_CHAR, 0, MPI_COMM_WORLD), "MPI_Bcast");
  return out;
}

Communicator::~Communicator() { release(); }

void Communicator::release() {
  std::lock_guard<std::mutex> lock(runtime_mutex());
  live().erase(this);
  release_locked();
}

void Communicator::release_locked() {
  MPI_Comm comm = comm_.exchange(MPI_COMM_NULL);
  if (comm != MPI_COMM_NULL && !finalized()) MPI_Comm_free(&comm);
}

std::shared_ptr<Communicator> create_communicator(const std::vector<int>& world_ranks) {
  ensure_initialized();
  MPI_Group world_group, group;
  check(MPI_Comm_group(MPI_COMM_WORLD, &world_group), "MPI_Comm_group");
  const int code = MPI_Group_incl(world_group, static_cast<int>(world_ranks.size()),
                                  world_ranks.data(), &group);
  MPI_Group_free(&world_group);
  check(code, "MPI_Group_incl");
  MPI_Comm comm = MPI_COMM_NULL;
  // Groups are created in program order on the main thread: one tag suffices.
  const int created = MPI_Comm_create_group(MPI_COMM_WORLD, group, /*tag=*/0x6367, &comm);
  MPI_Group_free(&group);
  check(created, "MPI_Comm_create_group");
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  auto communicator = std::make_shared<Communicator>(comm);
  std::lock_guard<std::mutex> lock(runtime_mutex());
  live().insert(communicator.get());
  return communicator;
}

Use::Use() {
  std::lock_guard<std::mutex> lock(runtime_mutex());
  ok_ = !finalize_begun;
  if (ok_) ++uses();
}

Use::~Use() {
  if (!ok_) return;
  std::lock_guard<std::mutex> lock(runtime_mutex());
  if (--uses() == 0) uses_ended().notify_all();
}

bool finalizing() { return finalize_begun; }

void finalize() {
  std::unique_lock<std::mutex> lock(runtime_mutex());
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized || finalized()) return;
  finalize_begun = true;
  // Running calls notice within one poll (at most 1 ms of sleep). One stuck inside MPI
  // itself for longer leaves MPI as it is: finalising under it would be worse.
  if (!uses_ended().wait_for(lock, std::chrono::seconds(5), [] { return uses() == 0; })) return;
  for (auto* c : live()) c->release_locked();
  live().clear();
  if (initialized_by_cgx()) MPI_Finalize();
}

}  // namespace cgx::transport::mpi
