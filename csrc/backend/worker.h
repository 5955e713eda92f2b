// The thread a process group runs its compressed collectives on, in submission order.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace cgx::backend {

class Worker {
 public:
  Worker();
  // Runs the tasks still queued, then joins.
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Tasks must not throw (they report failure through their Work).
  void enqueue(std::function<void()> task);
  // Runs what is queued, then stops the thread. Idempotent.
  void stop();

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace cgx::backend
