#include "transport/shm_names.h"

#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace cgx::transport {
namespace {

constexpr std::array<int, 2> kSignals{SIGTERM, SIGHUP};

// Fixed storage the handler can read without locks or allocation.
struct Slot {
  std::atomic<bool> used{false};
  char path[256] = {};  // "/dev/shm/cgx-..."
};
std::array<Slot, 64> slots;

std::mutex registry_mutex;  // taking and freeing slots, installing the handler
int held = 0;
std::array<struct sigaction, kSignals.size()> previous{};

void on_signal(int sig, siginfo_t* info, void* context) {
  for (auto& slot : slots)
    if (slot.used.load(std::memory_order_acquire)) unlink(slot.path);  // async-signal-safe
  for (size_t i = 0; i < kSignals.size(); ++i) {
    if (kSignals[i] != sig) continue;
    const struct sigaction& old = previous[i];
    if (old.sa_flags & SA_SIGINFO) {
      if (old.sa_sigaction != nullptr) old.sa_sigaction(sig, info, context);
    } else if (old.sa_handler == SIG_DFL) {
      // End the process as the signal would have: default action, re-raised (delivered
      // when this handler returns).
      sigaction(sig, &old, nullptr);
      raise(sig);
    } else if (old.sa_handler != SIG_IGN) {
      old.sa_handler(sig);
    }
  }
}

void install() {
  struct sigaction action {};
  action.sa_sigaction = on_signal;
  action.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &action, &previous[i]);
}

// Restores the previous dispositions, except where someone replaced ours meanwhile.
void uninstall() {
  for (size_t i = 0; i < kSignals.size(); ++i) {
    struct sigaction current {};
    sigaction(kSignals[i], nullptr, &current);
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_signal)
      sigaction(kSignals[i], &previous[i], nullptr);
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
    slots[i].used.store(true, std::memory_order_release);
    slot_ = static_cast<int>(i);
    if (held++ == 0) install();
    return;
  }
  // More segments in set-up at once than slots: only the signal path loses them.
  slot_ = -1;
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
