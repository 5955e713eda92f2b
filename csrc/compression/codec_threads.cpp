#include "compression/codec_threads.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>

namespace cgx::compression {
namespace {

// How long an idle worker watches for the next call before it sleeps.
constexpr std::chrono::microseconds kSpin{200};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// One call's parts: what is left to start and to finish.
struct Call {
  const std::function<void(int)>* part;
  int next = 1;  // part 0 is the caller's
  int parts = 0;
  int unfinished = 0;
  std::exception_ptr error;
  std::condition_variable finished;
};

class Pool {
 public:
  static Pool& instance() { return *current().load(); }

  void run(int parts, int threads, const std::function<void(int)>& part) {
    Call call;
    call.part = &part;
    call.parts = parts;
    call.unfinished = parts;
    // Up to threads - 1 workers may join in (as many as there are, should starting more
    // have failed); each takes parts until none is left.
    int helpers = 0;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      helpers = std::min(grow(std::min(threads, parts) - 1), std::min(threads, parts) - 1);
      for (int i = 0; i < helpers; ++i) queue_.push_back(&call);
      queued_.store(static_cast<int>(queue_.size()), std::memory_order_relaxed);
    }
    // One worker a ticket: the pool may hold more (another group's larger count).
    for (int i = 0; i < helpers; ++i) ready_.notify_one();
    work_through(call, 0);
    std::unique_lock<std::mutex> lock(mutex_);
    // Every part has started. Drop the tickets no worker took, then wait for the parts in
    // progress.
    queue_.erase(std::remove(queue_.begin(), queue_.end(), &call), queue_.end());
    queued_.store(static_cast<int>(queue_.size()), std::memory_order_relaxed);
    call.finished.wait(lock, [&] { return call.unfinished == 0; });
    if (call.error) std::rethrow_exception(call.error);
  }

 private:
  // fork() copies no threads: the child would hold the parent's workers as waiters of
  // ready_ that never wake (a broadcast could wait on them for ever). Each side holds the
  // lock across it, so that the parent's pool stays consistent, and the child leaves the
  // copy behind for a new pool whose workers start when it is next asked.
  static std::atomic<Pool*>& current() {
    static std::atomic<Pool*> pool{[] {
      pthread_atfork([] { instance().mutex_.lock(); }, [] { instance().mutex_.unlock(); },
                     [] { current().store(new Pool()); });
      return new Pool();  // never destroyed: workers may outlive static destructors
    }()};
    return pool;
  }

  // With mutex_ held: at least `count` workers where the system lets it start them;
  // returns how many there are.
  int grow(int count) {
    try {
      for (; workers_ < count; ++workers_) std::thread([this] { serve(); }).detach();
    } catch (const std::system_error&) {
      // Out of threads or memory for their stacks: the caller runs the parts left over.
    }
    return workers_;
  }

  void serve() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (queue_.empty()) {
        // A codec call comes every piece of a collective (a fraction of a millisecond apart);
        // waking from the condition variable costs tens of microseconds, more in a VM.
        lock.unlock();
        const auto until = std::chrono::steady_clock::now() + kSpin;
        while (queued_.load(std::memory_order_relaxed) == 0 && std::chrono::steady_clock::now() < until)
          cpu_relax();
        lock.lock();
      }
      ready_.wait(lock, [&] { return !queue_.empty(); });
      Call& call = *queue_.front();
      queue_.pop_front();
      queued_.store(static_cast<int>(queue_.size()), std::memory_order_relaxed);
      if (call.next == call.parts) continue;
      const int index = call.next++;
      lock.unlock();
      work_through(call, index);
      lock.lock();
    }
  }

  // Runs part `index`, then the call's next unstarted part, until none is left (mutex_ not
  // held). The next part is taken before the last one counts as finished, so that `call`
  // (on its caller's stack) outlives every use here.
  void work_through(Call& call, int index) {
    for (;;) {
      std::exception_ptr error;
      try {
        (*call.part)(index);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      if (error && !call.error) call.error = error;
      const bool more = call.next < call.parts;
      if (more) index = call.next++;
      if (--call.unfinished == 0) call.finished.notify_all();
      if (!more) return;
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Call*> queue_;  // one ticket per worker a call may use
  std::atomic<int> queued_{0};  // queue_.size(), for the workers' spin
  int workers_ = 0;
};

}  // namespace

void run_parts(int parts, int threads, const std::function<void(int)>& part) {
  if (parts <= 0) return;
  if (threads <= 1 || parts == 1) {
    for (int i = 0; i < parts; ++i) part(i);
    return;
  }
  Pool::instance().run(parts, threads, part);
}

}  // namespace cgx::compression
