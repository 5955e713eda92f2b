#include "backend/worker.h"

#include <stdexcept>

#include "backend/thread_tasks.h"

namespace cgx::backend {

Worker::Worker() : thread_([this] { loop(); }) {}

Worker::~Worker() { stop(); }

void Worker::enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw std::runtime_error("cgx: the process group has been shut down");
    tasks_.push_back(std::move(task));
    thread_tasks::queued();
  }
  cv_.notify_one();
}

void Worker::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (!thread_.joinable()) return;
  // From a task of its own (the group dropped inside its last collective): cannot join.
  if (thread_.get_id() == std::this_thread::get_id())
    thread_.detach();
  else
    thread_.join();
}

void Worker::loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
    task = nullptr;
    thread_tasks::released();
  }
}

}  // namespace cgx::backend
