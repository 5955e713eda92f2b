#include "transport/shm_names.h"

#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace cgx::transport {
namespace {

constexpr std::array<int, 2> kSignals{SIGTERM, SIGHUP};

// Fixed storage the handler can read without locks or allocation.
struct Slot {
  std::atomic<bool> used{false};
  pid_t owner = 0;      // a child forked meanwhile inherits the slots, not the names
  char path[256] = {};  // "/dev/shm/cgx-..."
};
std::array<Slot, 64> slots;

std::mutex registry_mutex;  // taking and freeing slots, installing the handler
int held = 0;
std::array<bool, kSignals.size()> installed{};

void on_signal(int sig) {
  const int saved_errno = errno;
  const pid_t self = getpid();
  for (auto& slot : slots)
    if (slot.used.load(std::memory_order_acquire) && slot.owner == self) unlink(slot.path);
  // Installed only over the default action (the process ends): end it the same way, the
  // signal re-raised under its default action and delivered when this handler returns.
  signal(sig, SIG_DFL);
  raise(sig);
  errno = saved_errno;
}

// Only where the signal would end the process by default: a signal that is ignored or
// handled by someone else (a graceful shutdown) keeps the names, and its disposition.
void install() {
  for (size_t i = 0; i < kSignals.size(); ++i) {
    struct sigaction current {};
    sigaction(kSignals[i], nullptr, &current);
    installed[i] = !(current.sa_flags & SA_SIGINFO) && current.sa_handler == SIG_DFL;
    if (!installed[i]) continue;
    struct sigaction action {};
    action.sa_handler = on_signal;
    action.sa_flags = SA_RESTART;
    sigemptyset(&action.sa_mask);
    sigaction(kSignals[i], &action, nullptr);
  }
}

// Back to the default action, except where someone replaced ours meanwhile.
void uninstall() {
  for (size_t i = 0; i < kSignals.size(); ++i) {
    if (!installed[i]) continue;
    struct sigaction current {};
    sigaction(kSignals[i], nullptr, &current);
    if (!(current.sa_flags & SA_SIGINFO) && current.sa_handler == on_signal)
      signal(kSignals[i], SIG_DFL);
    installed[i] = false;
  }
}

}  // namespace

OwnedShmName::OwnedShmName(const std::string& name) {
  const std::string path = "/dev/shm" + name;
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].used.load(std::memory_order_relaxed)) continue;
    if (path.size() >= sizeof(slots[i].path))
      throw std::invalid_argument("cgx shm: name too long: " + name);
    std::memcpy(slots[i].path, path.c_str(), path.size() + 1);
    slots[i].owner = getpid();
    slots[i].used.store(true, std::memory_order_release);
    slot_ = static_cast<int>(i);
    if (held++ == 0) install();
    return;
  }
  // More segments in set-up at once than slots: only the signal path loses them.
}

OwnedShmName& OwnedShmName::operator=(OwnedShmName&& other) noexcept {
  if (this != &other) {
    release();
    slot_ = other.slot_;
    other.slot_ = -1;
  }
  return *this;
}

void OwnedShmName::release() {
  if (slot_ < 0) return;
  std::lock_guard<std::mutex> lock(registry_mutex);
  slots[slot_].used.store(false, std::memory_order_release);
  slot_ = -1;
  if (--held == 0) uninstall();
}

}  // namespace cgx::transport
