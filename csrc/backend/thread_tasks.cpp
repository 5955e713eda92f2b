#include "backend/thread_tasks.h"

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace cgx::backend::thread_tasks {
namespace {

struct PendingTasks {
  std::mutex mutex;
  std::condition_variable cv;
  uint64_t pending = 0;
};

// Never destroyed: threads may still release tasks while the process exits.
PendingTasks& pending_tasks() {
  static PendingTasks* const instance = new PendingTasks;
  return *instance;
}

}  // namespace

void queued() {
  std::lock_guard<std::mutex> lock(pending_tasks().mutex);
  ++pending_tasks().pending;
}

void released() {
  {
    std::lock_guard<std::mutex> lock(pending_tasks().mutex);
    --pending_tasks().pending;
  }
  pending_tasks().cv.notify_all();
}

bool wait_released(std::chrono::milliseconds bound) {
  std::unique_lock<std::mutex> lock(pending_tasks().mutex);
  return pending_tasks().cv.wait_for(lock, bound, [] { return pending_tasks().pending == 0; });
}

}  // namespace cgx::backend::thread_tasks
