#include "backend/callback_threads.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>

#include "backend/thread_tasks.h"

namespace cgx::backend {
namespace {

// How long a thread waits for work before it ends.
constexpr std::chrono::seconds kIdleLifetime{2};

class CallbackThreads {
 public:
  void run(std::function<void()> task) {
    std::unique_lock<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
    thread_tasks::queued();
    if (idle_ >= tasks_.size()) {
      cv_.notify_one();
      return;
    }
    // Every thread is busy (or promised to a task already queued): one more.
    try {
      std::thread([this] { loop(); }).detach();
      ++threads_;
    } catch (const std::system_error&) {
      // No thread to be had (a process limit): a running one takes the task when it is
      // free; with none running, the caller runs it.
      if (threads_ > 0) return;
      std::function<void()> mine = std::move(tasks_.back());
      tasks_.pop_back();
      lock.unlock();
      mine();
      mine = nullptr;
      thread_tasks::released();
    }
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (tasks_.empty()) {
        ++idle_;
        const bool woken =
            cv_.wait_for(lock, kIdleLifetime, [this] { return !tasks_.empty(); });
        --idle_;
        if (!woken) {
          --threads_;
          return;
        }
      }
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      task = nullptr;
      thread_tasks::released();
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  size_t idle_ = 0;
  size_t threads_ = 0;
};

}  // namespace

void run_on_callback_thread(std::function<void()> task) {
  // Never destroyed: detached threads may still wait on it while the process exits.
  static CallbackThreads* const threads = new CallbackThreads;
  threads->run(std::move(task));
}

}  // namespace cgx::backend
