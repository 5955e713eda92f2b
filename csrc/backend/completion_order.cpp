#include "backend/completion_order.h"

namespace cgx::backend {

uint64_t CompletionOrder::begin() {
  std::lock_guard<std::mutex> lock(mutex_);
  open_.insert(next_);
  return next_++;
}

uint64_t CompletionOrder::mark() {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_;
}

void CompletionOrder::end(uint64_t ticket) {
  std::vector<std::function<void()>> ready;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    open_.erase(ticket);
    const uint64_t oldest_open = open_.empty() ? next_ : *open_.begin();
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (it->first <= oldest_open) {
        ready.push_back(std::move(it->second));
        it = waiting_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& action : ready) action();  // outside the lock: actions may begin others
}

void CompletionOrder::after(uint64_t bound, std::function<void()> action) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!open_.empty() && *open_.begin() < bound) {
      waiting_.emplace_back(bound, std::move(action));
      return;
    }
  }
  action();
}

}  // namespace cgx::backend
