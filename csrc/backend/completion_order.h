// Orders a group's completions without blocking a thread: barrier() must complete only
// after the collectives queued before it have completed (their futures' callbacks run on
// callback threads, in any order). Waiting for them on a thread instead could
// deadlock: a callback may itself wait for a collective queued after the barrier.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

namespace cgx::backend {

class CompletionOrder {
 public:
  // A completion that later ones may wait for; returns its ticket for end().
  uint64_t begin();
  void end(uint64_t ticket);
  // The bound covering every completion begun so far, for after().
  uint64_t mark();
  // Runs `action` once every completion begun before `bound` has ended: now, on this
  // thread, or on the thread that ends the last of them.
  void after(uint64_t bound, std::function<void()> action);

 private:
  std::mutex mutex_;
  uint64_t next_ = 0;
  std::set<uint64_t> open_;
  std::vector<std::pair<uint64_t, std::function<void()>>> waiting_;  // (bound, action)
};

}  // namespace cgx::backend
